"""The Hugging Face Trainer: training forwards are the samples, the step column is the global
step, and evaluation forwards are recorded only on request, as their own series (the Lightning
half is test_trainer_phases.py).

The trainer marks its own training steps (an independent record, never the library's); history
is checked against that record sample by sample.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import polars as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver

from _trainer_samples import check_samples
from conftest import read_history, read_result

# -- Hugging Face ---------------------------------------------------------------------------------


class RecordingTrainer(Trainer):
    """Marks its own training steps, so the test knows which forwards are training ones."""

    in_training = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.in_training = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self.in_training = False


def hf_train(
    tmp_path: Path,
    callback: HuggingFaceObserver,
    before: Callable[[Trainer], object] | None = None,
) -> tuple[Trainer, list]:
    """4 optimizer steps of 2 micro-batches (gradient accumulation), evaluation every 2 steps
    (2 batches each); `before(trainer)` first, if given (its forwards are not in the calls)."""
    config = BertConfig(
        vocab_size=32,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    config.num_labels = 2
    model = BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)

    def examples(n: int) -> list[dict[str, torch.Tensor]]:
        return [
            {
                "input_ids": torch.randint(0, 32, (6,), generator=generator),
                "labels": torch.tensor(i % 2),
            }
            for i in range(n)
        ]

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=["tensorboard"],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = RecordingTrainer(
        model=model,
        args=args,
        train_dataset=examples(16),
        eval_dataset=examples(4),
        callbacks=[callback],
    )
    if before is not None:
        before(trainer)
    calls: list[tuple[str, int]] = []

    def record(module: nn.Module, args: Any, kwargs: Any) -> None:
        calls.append(("train" if trainer.in_training else "eval", trainer.state.global_step))

    model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train()
    return trainer, calls


def test_huggingface_samples_training_forwards_only_on_the_global_step(tmp_path: Path) -> None:
    callback = HuggingFaceObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))
    _, calls = hf_train(tmp_path, callback)
    training = [call for call in calls if call[0] == "train"]
    assert [step for _, step in training] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [phase for phase, _ in calls].count("eval") == 4  # 2 evaluations of 2 batches
    history = read_history(tmp_path / "run")
    check_samples(history, training)
    assert set(history["mode"]) == {"train"}
    lines = (tmp_path / "run" / "index.md").read_text(encoding="utf-8").splitlines()
    [note] = [line for line in lines if "4 evaluation forwards inside the fit" in line]
    assert note.startswith(  # the Trainer's own words: no Lightning sanity check or validation
        "**Note:** 4 evaluation forwards inside the fit (the evaluation the Trainer runs during "
        "training: eval_strategy, eval_on_start: forwards outside a training step"
    )
    assert "sanity check" not in note


def test_huggingface_record_eval_gives_eval_series_of_their_own(tmp_path: Path) -> None:
    callback = HuggingFaceObserver(
        tmp_path / "run",
        sampler=EveryNForwardsSampler(1),
        record_eval=True,
        max_histogram_modules=1,
    )
    _, calls = hf_train(tmp_path, callback)
    run = tmp_path / "run"
    history = read_history(run)
    check_samples(history, calls)
    assert history.filter(pl.col("mode") == "eval")["sample_id"].n_unique() == 4
    layer = next(r for r in read_result(run) if r["layer"] == "classifier")
    modes = sorted((t["signal"], t["mode"]) for t in layer["tensors"])
    assert modes == [("output", "eval"), ("output", "train"), ("output_gradient", "train")]

    logs = [p.parent for p in (tmp_path / "out" / "runs").rglob("events.out.tfevents.*")]
    events = EventAccumulator(str(logs[0]), {HISTOGRAMS: 0}).Reload()
    tag = "bert.embeddings.word_embeddings/call_0/output/tensor"
    evals = sorted({step for phase, step in calls if phase == "eval"})  # 2, 4: one per step
    assert [e.step for e in events.Histograms("eval/" + tag)] == evals
    assert [e.step for e in events.Histograms(tag)] == sorted({s for p, s in calls if p == "train"})


def test_huggingface_evaluate_and_predict_after_train_are_neither_observed_nor_counted(
    tmp_path: Path,
) -> None:
    """The run is `train()`'s: `evaluate()` and `predict()` after it run the model unobserved,
    and index.md names them as the user calls them (not Lightning's validate/test). Before any
    `train()` no run exists to say so: a warning does, once."""
    callback = HuggingFaceObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))
    run = tmp_path / "run"

    def evaluate_first(trainer: Trainer) -> None:
        with warnings.catch_warnings(record=True) as before:
            warnings.simplefilter("always")
            trainer.evaluate()
            trainer.predict(cast(Any, trainer.eval_dataset))
        said = [str(w.message) for w in before if "torchinstruments" in str(w.message)]
        assert said == [
            "torchinstruments: HuggingFaceObserver: trainer.evaluate() ran before any "
            "trainer.train() with this callback and was not observed: HuggingFaceObserver "
            "observes trainer.train() (its training steps, and the evaluation inside it with "
            "record_eval), so no run directory was written for it; call inject_observer(model, "
            "...) and remove_observer(model) around it to record it"
        ]
        assert not run.exists()

    trainer, calls = hf_train(tmp_path, callback, evaluate_first)
    state = (run / ".state.json").read_text(encoding="utf-8")
    trained = len(calls)
    with warnings.catch_warnings(record=True) as after:  # index.md says these
        warnings.simplefilter("always")
        trainer.evaluate()
        trainer.predict(cast(Any, trainer.eval_dataset))
    assert not [w for w in after if "torchinstruments" in str(w.message)]
    assert len(calls) == trained + 4  # 2 batches each: they did run the model ...
    assert (run / ".state.json").read_text(encoding="utf-8") == state  # ... unseen by the run
    lines = (run / "index.md").read_text(encoding="utf-8").splitlines()
    [note] = [line for line in lines if "after the fit run after the observer" in line]
    assert note.startswith("**Note:** 4 evaluation forwards inside the fit")
    assert note.endswith(
        "trainer.evaluate() and trainer.predict() calls after the fit run after the observer was "
        "removed: not observed, not counted."
    )
    assert "validate()" not in note
    assert "test()" not in note
