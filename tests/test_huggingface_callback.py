"""`HuggingFaceObserver` on a real transformers Trainer: a tiny BERT from a config, CPU, 3 steps."""

from __future__ import annotations

import contextlib
import gc
import io
import re
import warnings
import weakref
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from torchinstruments import EveryNForwardsSampler, ObserverConfig, has_observer
from torchinstruments.integrations import HuggingFaceObserver
from torchinstruments.registry import OBSERVERS
from torchinstruments.rundir.page_queries import HF_EVAL_SCALARS, HF_SCALARS

from conftest import read_history, run_status

STEPS = 3


def tiny_bert() -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=32,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    config.num_labels = 2
    return BertForSequenceClassification(config)


def examples(n: int = 12) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, 32, (6,), generator=generator),
            "labels": torch.tensor(i % 2),
        }
        for i in range(n)
    ]


class RaisingTrainer(Trainer):
    """Raises in the loss (after the model's forward) at global step 2."""

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.state.global_step == 2:
            raise ValueError("boom in compute_loss")
        return super().compute_loss(model, inputs, *args, **kwargs)


def train(
    tmp_path: Path, model: nn.Module, callback: HuggingFaceObserver, trainer_class: type = Trainer
) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=["tensorboard"],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = trainer_class(model=model, args=args, train_dataset=examples(), callbacks=[callback])
    trainer.train()
    return trainer


def test_training_is_observed_into_the_output_dir_with_histograms_on_the_global_step(
    tmp_path: Path,
) -> None:
    model = tiny_bert()
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), max_histogram_modules=2)
    trainer = train(tmp_path, model, callback)

    run = tmp_path / "out" / "torchinstruments"
    assert callback.directory == run
    assert not has_observer(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert "training_step" not in trainer.__dict__  # the step guard is undone
    history = read_history(run)
    assert sorted(history["forward_index"].unique()) == list(range(STEPS))
    # One forward per optimizer step: the step column is state.global_step then.
    assert (history["step"] == history["forward_index"]).all()
    layers = set(history["layer"].unique())
    assert {"bert.embeddings.word_embeddings", "classifier"} <= layers
    assert set(history["signal"].unique()) == {"output", "output_gradient"}
    assert run_status(run) == "complete"
    # No evaluation in the fit: the calls after it, which the run never sees, are still said.
    notes = (run / "index.md").read_text(encoding="utf-8").splitlines()
    assert (
        "**Note:** trainer.evaluate() and trainer.predict() calls after the fit run after the "
        "observer was removed: not observed, not counted."
    ) in notes

    # The Trainer's own TensorBoard writer holds its scalars and the focus histograms.
    logs = [p.parent for p in (tmp_path / "out" / "runs").rglob("events.out.tfevents.*")]
    assert len(logs) == 1
    events = EventAccumulator(str(logs[0]), size_guidance={HISTOGRAMS: 0}).Reload()
    tags = cast(dict[str, list[str]], events.Tags())
    assert "train/loss" in tags["scalars"]
    tag = "bert.embeddings.word_embeddings/call_0/output/tensor"
    assert [e.step for e in events.Histograms(tag)] == list(range(STEPS))
    assert len(tags["histograms"]) == 4  # 2 focus layers x (output, output_gradient)


def test_training_that_raises_removes_the_observer_and_says_so_in_index_md(
    tmp_path: Path,
) -> None:
    model = tiny_bert()
    callback = HuggingFaceObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))
    held = raise_in_train(tmp_path, model, callback)
    gc.collect()
    # A step the Trainer does not retry: nothing of the failed train() is kept (its frame
    # would keep its callers' locals, such as this tensor, until the next train()).
    assert held() is None

    assert not has_observer(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    history = read_history(tmp_path / "run")
    assert sorted(history["forward_index"].unique()) == [0, 1]
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert run_status(tmp_path / "run") == "complete"
    assert (
        "the fit ended with an exception at global step 2: ValueError: boom in compute_loss."
        in index
    )


def raise_in_train(tmp_path: Path, model: nn.Module, callback: HuggingFaceObserver) -> Any:
    """A `RaisingTrainer` fit, raised and handled: a weak reference to a tensor that was a local
    of the frame calling `train()`, alive as long as anything keeps that frame."""
    local = torch.ones(8)
    held = weakref.ref(local)
    with pytest.raises(ValueError, match="boom in compute_loss"):
        train(tmp_path, model, callback, RaisingTrainer)
    return held


class Spread(nn.Module):
    """Its loss is its layer's output variance, so the logged loss is that output's std, squared."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        return {"loss": self.fc(x).var(correction=0)}


def test_index_md_step_query_pairs_each_sample_with_the_loss_its_forward_logged(
    tmp_path: Path,
) -> None:
    """The by-step query, with the page's own Hugging Face log expression as `scalars`, joins
    each training sample with the loss computed by that very forward, and with nothing else:
    an evaluation after each step logs an entry under the same step as that step's loss (the
    expression keeps the training entries; with them the join doubled every sample's row)."""
    generator = torch.Generator().manual_seed(0)
    data = [
        {"x": torch.randn(4, generator=generator), "labels": torch.tensor(0.0)} for _ in range(8)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1))
    trainer = Trainer(
        model=Spread(),
        args=args,
        train_dataset=data,
        eval_dataset=data[:2],
        callbacks=[callback],
    )
    trainer.train()
    trainer.save_state()
    run = tmp_path / "out" / "torchinstruments"
    text = (run / "index.md").read_text(encoding="utf-8")
    assert HF_SCALARS in text
    scalars = HF_SCALARS.replace(
        "out/trainer_state.json", str(tmp_path / "out" / "trainer_state.json")
    )
    setup, *blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    (by_step_block,) = [b for b in blocks if "by_step = (" in b]
    namespace: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(setup, "index.md:setup", "exec"), namespace)
        exec(
            compile(
                re.sub(r"(?m)^scalars = .*$", f"scalars = {scalars}", by_step_block),
                "index.md:by_step",
                "exec",
            ),
            namespace,
        )
    by_step = namespace["by_step"]
    assert any("eval_loss" in entry for entry in trainer.state.log_history)
    assert by_step["step"].to_list() == list(range(STEPS))  # one row per training sample
    assert by_step["loss"].to_list() == pytest.approx([v**2 for v in by_step["value"]], rel=1e-5)


def test_index_md_pairs_each_evaluation_sample_with_the_eval_loss_its_forward_logged(
    tmp_path: Path,
) -> None:
    """The Trainer logs an evaluation under the global step its forwards ran at, the step its
    record_eval samples carry: index.md's expression for evaluation entries joins each eval
    sample with the eval_loss its own forward computed (the eval batch is one forward, so
    eval_loss is that forward's output variance). The evaluation comes after 101 logged
    training entries, so a log read that infers its schema from the first 100 rows had no
    eval_loss column."""
    generator = torch.Generator().manual_seed(0)
    data = [
        {"x": torch.randn(4, generator=generator), "labels": torch.tensor(0.0)} for _ in range(8)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=101,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=101,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = HuggingFaceObserver(
        sampler=EveryNForwardsSampler(50), record_eval=EveryNForwardsSampler(1)
    )
    trainer = Trainer(
        model=Spread(),
        args=args,
        train_dataset=data,
        eval_dataset=data[:2],
        callbacks=[callback],
    )
    trainer.train()
    trainer.save_state()
    evaluated = [e["step"] for e in trainer.state.log_history if "eval_loss" in e]
    assert evaluated == [101]
    run = tmp_path / "out" / "torchinstruments"
    text = (run / "index.md").read_text(encoding="utf-8")
    assert HF_EVAL_SCALARS in text
    scalars = HF_EVAL_SCALARS.replace(
        "out/trainer_state.json", str(tmp_path / "out" / "trainer_state.json")
    )
    setup, *blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    (by_step_block,) = [b for b in blocks if "by_step = (" in b]
    block = re.sub(r"(?m)^scalars = .*$", f"scalars = {scalars}", by_step_block)
    block = block.replace('pl.col("mode") == "train"', 'pl.col("mode") == "eval"')
    namespace: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(setup, "index.md:setup", "exec"), namespace)
        exec(compile(block, "index.md:by_step", "exec"), namespace)
    by_step = namespace["by_step"]
    assert by_step["step"].to_list() == evaluated  # one row per evaluation sample
    assert by_step["eval_loss"].to_list() == pytest.approx(
        [v**2 for v in by_step["value"]], rel=1e-5
    )


def test_a_second_run_gets_a_directory_of_its_own(tmp_path: Path) -> None:
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(2), selector=_linear_only)
    model = tiny_bert()
    train(tmp_path, model, callback)
    first = callback.directory
    train(tmp_path, model, callback)
    assert (first, callback.directory) == (
        tmp_path / "out" / "torchinstruments",
        tmp_path / "out" / "torchinstruments-2",
    )
    history = read_history(tmp_path / "out" / "torchinstruments-2")
    assert sorted(history["forward_index"].unique()) == [0, 2]
    assert set(history["module_type"].unique()) == {"Linear"}


def _linear_only(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def test_bad_option_fails_when_the_callback_is_built() -> None:
    with pytest.raises(TypeError, match="sinks"):
        HuggingFaceObserver(sinks="tensorboard")
    with pytest.raises(TypeError, match=r"'window' is not an option.*history_config"):
        HuggingFaceObserver(window=3)


class SpyTrainer(Trainer):
    """Records the observed model's config at each loss (inside the training step)."""

    seen: list[ObserverConfig]

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(OBSERVERS[model].config)
        return super().compute_loss(model, inputs, *args, **kwargs)


def test_the_callbacks_config_is_built_once_and_is_the_runs(
    tmp_path: Path, config_builds: list[ObserverConfig]
) -> None:
    SpyTrainer.seen = []
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(2), selector=_linear_only)
    train(tmp_path, tiny_bert(), callback, SpyTrainer)
    assert len(config_builds) == 1
    assert len(SpyTrainer.seen) == STEPS
    assert all(config is config_builds[0] for config in SpyTrainer.seen)
    assert callback.directory == tmp_path / "out" / "torchinstruments"
    run = callback.directory
    assert run is not None
    assert sorted(read_history(run)["forward_index"].unique()) == [0, 2]


def test_only_the_trainers_main_process_attaches_with_rank0(tmp_path: Path) -> None:
    """A process the Trainer calls not the world's main one attaches nothing, and its end of
    training removes nothing (quietly); with rank_policy='all' it attaches."""
    model = tiny_bert()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    other = TrainerState(is_world_process_zero=False)
    callback = HuggingFaceObserver()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        callback.on_train_begin(args, other, TrainerControl(), model=model)
        assert (callback.directory, has_observer(model)) == (None, False)
        callback.on_train_end(args, other, TrainerControl(), model=model)
    assert not said, [str(w.message) for w in said]
    every = HuggingFaceObserver(rank_policy="all")
    every.on_train_begin(args, other, TrainerControl(), model=model)
    assert every.directory == tmp_path / "out" / "torchinstruments"
    assert has_observer(model)
    every.on_train_end(args, other, TrainerControl(), model=model)
    assert not has_observer(model)


def test_a_loop_without_a_trainer_says_no_count_of_evaluation_forwards_it_never_kept(
    tmp_path: Path,
) -> None:
    """Another loop drives the callback (no Trainer on the stack): training and evaluation
    forwards cannot be told apart, so every forward is on the sampler's schedule and record_eval
    records none apart; index.md said it recorded evaluation forwards as their own series and,
    at the end, that 0 were seen (a count nobody kept), against 2 eval-mode forwards."""
    model = tiny_bert()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    state = TrainerState()
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), record_eval=True)
    batch = {"input_ids": torch.randint(0, 32, (2, 6)), "labels": torch.tensor([0, 1])}
    with pytest.warns(RuntimeWarning, match="the running Trainer was not found"):
        callback.on_train_begin(args, state, TrainerControl(), model=model)
    model(**batch).loss.backward()
    with torch.no_grad():
        model.eval()(**batch)
        model(**batch)
    callback.on_train_end(args, state, TrainerControl(), model=model)
    run = tmp_path / "out" / "torchinstruments"
    assert sorted(read_history(run)["forward_index"].unique()) == [0, 1, 2]  # one schedule
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "evaluation forwards were not told apart from training forwards" in index
    assert "evaluation forwards were seen" not in index
    assert "recorded as their own series" not in index
    assert "asked with the count of training forwards" not in index  # one sampler, one count
    assert (
        "**Note:** trainer.evaluate() and trainer.predict() calls after the fit run after the "
        "observer was removed: not observed, not counted."
    ) in index.splitlines()


class RaiseAtStepEnd(TrainerCallback):
    """Another callback that raises after the first step: outside `training_step`."""

    def on_step_end(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            raise RuntimeError("boom in a callback")


def test_an_exception_outside_the_step_is_finished_by_the_next_train(tmp_path: Path) -> None:
    model = tiny_bert()
    observer = HuggingFaceObserver(sampler=EveryNForwardsSampler(1))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=examples(), callbacks=[observer])
    trainer.add_callback(RaiseAtStepEnd())
    with pytest.raises(RuntimeError, match="boom in a callback"):
        trainer.train()
    assert has_observer(model)  # transformers said nothing: the observer is still attached
    trainer.pop_callback(RaiseAtStepEnd)
    with pytest.warns(RuntimeWarning, match=r"the fit ended at global step 1 without on_train_end"):
        trainer.train()
    first = tmp_path / "out" / "torchinstruments"
    assert run_status(first) == "complete"
    assert "saw it when its callback's next train() started" in (first / "index.md").read_text(
        encoding="utf-8"
    )
    assert observer.directory == tmp_path / "out" / "torchinstruments-2"
    assert not has_observer(model)
    assert "training_step" not in trainer.__dict__  # one guard at a time, undone at the end
