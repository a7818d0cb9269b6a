"""Real trainers: training forwards are the samples, the step column is the global step, and
evaluation forwards are recorded only on request, as their own series.

Each model writes down, at every call, what the trainer was doing (an independent record: a
forward pre-hook in the test, never the library's) and the trainer's global step; history is
checked against that record sample by sample.
"""

from __future__ import annotations

import json
import traceback
import warnings
from pathlib import Path
from typing import Any, cast

import lightning
import polars as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver

from _trainer_samples import check_samples
from conftest import cli_in_process, read_history, read_result

# -- Lightning ----------------------------------------------------------------------------------


class Recorded(lightning.LightningModule):
    """Two Linear layers; every call of the module records (phase, global step)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.calls: list[tuple[str, int]] = []
        self.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: Any) -> None:
        trainer = self.trainer
        phase = "train" if trainer.training and not trainer.sanity_checking else "eval"
        self.calls.append((phase, trainer.global_step))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lightning_fit(tmp_path: Path, callback: LightningObserver) -> Recorded:
    """8 training batches, accumulate_grad_batches=2 (4 optimizer steps), a sanity check of 2
    validation batches and a validation of 2 batches after training batches 4 and 8."""
    model = Recorded()
    train = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    val = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    trainer = lightning.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=2,
        num_sanity_val_steps=2,
        val_check_interval=4,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(train, batch_size=4), DataLoader(val, batch_size=4))
    return model


def test_lightning_samples_training_forwards_only_on_the_global_step(tmp_path: Path) -> None:
    callback = LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))
    model = lightning_fit(tmp_path, callback)
    phases = [phase for phase, _ in model.calls]
    assert phases.count("train") == 8
    assert phases.count("eval") == 6  # sanity check 2, validation 2 x 2
    history = read_history(tmp_path / "run")
    training = [call for call in model.calls if call[0] == "train"]
    assert [step for _, step in training] == [0, 0, 1, 1, 2, 2, 3, 3]
    check_samples(history, training)  # forward_index counts training forwards only
    assert set(history["mode"]) == {"train"}
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "6 evaluation forwards inside the fit (sanity check, validation" in index


def test_lightning_record_eval_gives_eval_series_of_their_own(tmp_path: Path) -> None:
    callback = LightningObserver(
        tmp_path / "run", sampler=EveryNForwardsSampler(1), record_eval=True
    )
    model = lightning_fit(tmp_path, callback)
    run = tmp_path / "run"
    history = read_history(run)
    check_samples(history, model.calls)  # every call observed, each with its own phase
    eval_samples = history.filter(pl.col("mode") == "eval")["sample_id"].unique()
    assert eval_samples.len() == 6
    assert set(history.filter(pl.col("mode") == "eval")["signal"]) == {"output"}  # no backward

    # result.json: one entry per mode, each over its own samples only.
    layer = next(r for r in read_result(run) if r["layer"] == "net.0")
    entries = {(t["signal"], t["mode"]): t for t in layer["tensors"]}
    assert set(entries) == {("output", "train"), ("output", "eval"), ("output_gradient", "train")}
    for (signal, mode), entry in entries.items():
        rows = history.filter(
            pl.col("layer") == "net.0", pl.col("signal") == signal, pl.col("mode") == mode
        )
        assert entry["observations"] == rows.filter(pl.col("metric") == "mean").height
        assert entry["latest_sample_id"] == rows["sample_id"].max()
        mean = rows.filter(pl.col("metric") == "mean").sort("sample_id")["value"].to_list()
        assert entry["metrics"]["mean"]["first"] == mean[0]
        assert entry["metrics"]["mean"]["latest"] == mean[-1]

    # show: the eval series is a row of its own.
    shown = cli_in_process("show", run, "--layers", "^net\\.0$", "--metrics", "mean", "--all")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert any(line.startswith("net.0 [eval]") for line in lines), shown.stdout
    assert any(line.startswith("net.0 ") and "[eval]" not in line for line in lines)
    csv = cli_in_process("show", run, "--format", "csv", "--metrics", "mean")
    shown_modes = pl.read_csv(csv.stdout.encode()).filter(pl.col("layer") == "net.0")["mode"]
    assert sorted(shown_modes.to_list()) == ["eval", "train", "train"]

    # TensorBoard (the trainer's logger): eval histograms under eval/, on the global step.
    events = EventAccumulator(str(tmp_path / "logs" / "version_0"), {HISTOGRAMS: 0}).Reload()
    tags = cast(dict[str, list[str]], events.Tags())["histograms"]
    # One histogram per tag and step: the batches of an evaluation, and the micro-batches of an
    # accumulated step, share their step, and only the first of them is in the logger.
    evals = [call for call in model.calls if call[0] == "eval"]
    want = sorted({step for _, step in evals})  # 0 (sanity), 2, 4
    assert [e.step for e in events.Histograms("eval/net.0/call_0/output/tensor")] == want
    train_steps = sorted({step for phase, step in model.calls if phase == "train"})
    assert [e.step for e in events.Histograms("net.0/call_0/output/tensor")] == train_steps
    assert not any(tag.startswith("eval/") and "output_gradient" in tag for tag in tags)


class Probed(Recorded):
    """A `Recorded` whose calls by the probe callback below are recorded as "probe" calls."""

    probing = False

    def _record(self, module: nn.Module, args: Any) -> None:
        if self.probing:
            self.calls.append(("probe", self.trainer.global_step))
        else:
            super()._record(module, args)


class Probe(lightning.Callback):
    """Another callback (listed before the observer) that runs the model on a fixed batch in its
    batch hooks, as a 'log predictions' callback does."""

    def _probe(self, pl_module: Probed) -> None:
        pl_module.probing = True
        try:
            with torch.no_grad():
                pl_module(torch.ones(2, 4))
        finally:
            pl_module.probing = False

    def on_train_batch_start(
        self, trainer: lightning.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._probe(pl_module)

    def on_train_batch_end(
        self, trainer: lightning.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._probe(pl_module)


def probed_fit(callback: LightningObserver) -> Probed:
    """3 training batches, no validation, the probe callback before `callback`."""
    model = Probed()
    train = TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,)))
    trainer = lightning.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[Probe(), callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(train, batch_size=4))
    assert "training_step" not in vars(trainer.strategy)  # the mark is undone
    return model


def test_another_callbacks_forwards_in_its_batch_hooks_are_not_training_forwards(
    tmp_path: Path,
) -> None:
    model = probed_fit(LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1)))
    assert [phase for phase, _ in model.calls].count("probe") == 6
    training = [call for call in model.calls if call[0] == "train"]
    history = read_history(tmp_path / "run")
    check_samples(history, training)  # the probe's forwards take no sample, are not counted
    assert set(history["grad_enabled"]) == {True}
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "6 evaluation forwards" in index


def test_another_callbacks_forwards_are_evaluation_forwards_with_record_eval(
    tmp_path: Path,
) -> None:
    callback = LightningObserver(
        tmp_path / "run", sampler=EveryNForwardsSampler(1), record_eval=True
    )
    model = probed_fit(callback)
    calls = [("eval" if phase == "probe" else phase, step) for phase, step in model.calls]
    history = read_history(tmp_path / "run")
    check_samples(history, calls)  # each probe forward: an evaluation sample, mode eval
    probe = history.filter(pl.col("mode") == "eval")
    assert probe["sample_id"].n_unique() == 6
    assert set(probe["shape"].list.first()) == {2}  # the probe's batch of 2


def test_two_observers_in_one_fit_each_see_every_training_step_and_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    """Each wraps the strategy's training_step over the other's; the fit ends unwrapping them in
    callback order (the outer one last), and the strategy is left as it was."""
    observers = [
        LightningObserver(tmp_path / name, module=name, sampler=EveryNForwardsSampler(1))
        for name in ("net.0", "net.2")
    ]
    model = Recorded()
    trainer = lightning.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        num_sanity_val_steps=1,
        callbacks=[*observers],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,))), batch_size=4)
    trainer.fit(model, data, data)
    assert "training_step" not in vars(trainer.strategy)
    training = [call for call in model.calls if call[0] == "train"]
    for name in ("net.0", "net.2"):
        check_samples(read_history(tmp_path / name), training)  # the sanity check: unobserved


class Manual(Recorded):
    """Manual optimization: the step calls the optimizer itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = cast(torch.optim.Optimizer, self.optimizers())
        optimizer.zero_grad()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.manual_backward(loss)
        optimizer.step()
        return loss.detach()


def test_lightning_manual_optimization_samples_its_training_forwards(tmp_path: Path) -> None:
    model = Manual()
    train = TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,)))
    val = TensorDataset(torch.randn(4, 4), torch.randint(0, 2, (4,)))
    trainer = lightning.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        num_sanity_val_steps=1,
        callbacks=[LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(train, batch_size=4), DataLoader(val, batch_size=4))
    training = [call for call in model.calls if call[0] == "train"]
    assert [step for _, step in training] == [0, 1, 2]
    history = read_history(tmp_path / "run")
    check_samples(history, training)
    assert set(history["signal"]) == {"output", "output_gradient"}


def test_index_md_says_which_count_each_sampler_is_asked_with_under_record_eval(
    tmp_path: Path,
) -> None:
    """Under record_eval forward_index counts evaluation forwards too, so the training samples'
    forward_index is not what the sampler line names; the line says what each is asked with."""
    callback = LightningObserver(
        tmp_path / "run", sampler=EveryNForwardsSampler(3), record_eval=True
    )
    model = lightning_fit(tmp_path, callback)
    history = read_history(tmp_path / "run")
    training = history.filter(pl.col("mode") == "train")["forward_index"].unique().sort()
    assert training.to_list() != [0, 3, 6]  # 8 training forwards, 0, 3, 6 of them sampled
    calls = [phase for phase, _ in model.calls]
    train_positions = [i for i, phase in enumerate(calls) if phase == "train"]
    assert training.to_list() == train_positions[::3]
    [line] = [
        line
        for line in (tmp_path / "run" / "index.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("- sampler: ")
    ]
    assert line.startswith("- sampler: EveryNForwardsSampler(n=3): forward_index 0, 3, 6, ...")
    assert "asked with the count of training forwards" in line
    assert "asked with the count of evaluation forwards" in line
    assert "not the samples' forward_index" in line
    assert "the `step` column is the trainer's global step" in line


class Tested(Recorded):
    """A `Recorded` with test and predict steps."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def test_validate_test_and_predict_outside_the_fit_are_neither_observed_nor_counted(
    tmp_path: Path,
) -> None:
    """The run is the fit's: the observer is removed at its end, before validate(), test() and
    predict(); index.md names them as the user calls them. Before any fit no run exists to say
    so: a warning does, once."""
    run = tmp_path / "run"
    callback = LightningObserver(run, sampler=EveryNForwardsSampler(1), record_eval=True)
    model = Tested()
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    trainer = lightning.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(
        record=True
    ) as before:  # before any fit: said once, no run written
        warnings.simplefilter("always")
        trainer.test(model, data, verbose=False)
        trainer.predict(model, data)
    said = [str(w.message) for w in before if "torchinstruments" in str(w.message)]
    assert said == [
        "torchinstruments: LightningObserver: trainer.test() ran before any trainer.fit() with "
        "this callback and was not observed: LightningObserver observes trainer.fit() (its "
        "training steps, and the evaluation inside it with record_eval), so no run directory "
        "was written for it; call inject_observer(model, ...) and remove_observer(model) "
        "around it to record it"
    ]
    assert not run.exists()
    del model.calls[:]
    trainer.fit(model, data)  # no validation loader: the fit runs no validation
    fitted = len(model.calls)
    state = (run / ".state.json").read_text(encoding="utf-8")
    with warnings.catch_warnings(record=True) as after:  # index.md says these
        warnings.simplefilter("always")
        trainer.validate(model, data, verbose=False)
        trainer.test(model, data, verbose=False)
        trainer.predict(model, data)
    assert not [w for w in after if "torchinstruments" in str(w.message)]
    assert len(model.calls) == fitted + 6  # validate, test and predict did run the model ...
    assert (run / ".state.json").read_text(encoding="utf-8") == state  # ... unseen by the run
    assert read_history(run)["sample_id"].n_unique() == fitted == 2
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "evaluation forwards inside the fit (sanity check, validation" in index
    assert (
        "trainer.validate(), trainer.test() and trainer.predict() calls after the fit run after "
        "the observer was removed: not observed, not counted."
    ) in index
    [note] = [line for line in index.splitlines() if "after the fit run after the" in line]
    assert "evaluate()" not in note  # the Hugging Face Trainer's call, not Lightning's
    assert "test, predict:" not in index


class Summarized(Recorded):
    """A `Recorded` with an example input, which Lightning's model summary and the TensorBoard
    logger's graph run through the model at the fit's start; every call also records whether
    it came from there (the call stack, independent of the callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(3, 4)  # a batch size no loader gives
        self.setup_calls = 0

    def _record(self, module: nn.Module, args: Any) -> None:
        stack = {frame.name for frame in traceback.extract_stack()}
        if {"_forward_example_input", "log_graph"} & stack:
            # the graph's trace itself passes through every observer (tracing); its check
            # runs the model again eagerly
            self.setup_calls += not torch.jit.is_tracing()
            return
        super()._record(module, args)


@pytest.mark.parametrize("record_eval", [False, True])
def test_lightning_setup_forwards_of_an_example_input_are_neither_training_nor_evaluation(
    tmp_path: Path, record_eval: bool
) -> None:
    """The model summary's and the logger graph's forwards of `example_input_array` run at the
    fit's start, before its first loop: never an evaluation sample (they would join the
    validation series with another batch size), never told as evaluation forwards, and counted
    apart in the state and index.md."""
    run = tmp_path / "run"
    callback = LightningObserver(run, sampler=EveryNForwardsSampler(1), record_eval=record_eval)
    model = Summarized()
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    trainer = lightning.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=1,
        limit_val_batches=1,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs", log_graph=True),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=True,
    )
    trainer.fit(model, data, data)
    setup = model.setup_calls  # the summary's forward and the graph's eager check (torch 2.15)
    assert setup >= 1
    evaluation = [call for call in model.calls if call[0] == "eval"]
    assert len(evaluation) == 2  # the sanity check and the validation at the end
    history = read_history(run)
    counts = json.loads((run / ".state.json").read_text(encoding="utf-8"))["counts"]
    assert counts["unobserved_setup_forwards"] == setup
    if record_eval:
        check_samples(history, model.calls)  # the sampled calls are exactly the fit's own
        assert history.filter(pl.col("mode") == "eval")["sample_id"].n_unique() == 2
        assert (counts["eval_forwards"], counts["unobserved_eval_forwards"]) == (2, 0)
    else:
        assert set(history["mode"]) == {"train"}
        assert (counts["eval_forwards"], counts["unobserved_eval_forwards"]) == (0, 2)
    assert set(history.filter(pl.col("signal") == "output")["shape"].list.first()) == {4}
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    forwards, were = ("forward", "was") if setup == 1 else ("forwards", "were")
    assert (
        f"**Note:** {setup} setup {forwards} at the fit's start, before its first loop (Lightning's "
        f"model summary and the logger's graph of example_input_array, an on_fit_start hook), {were} "
        "not observed, whatever record_eval says"
    ) in index
    seen = "2 evaluation forwards were seen" if record_eval else "2 evaluation forwards inside"
    assert seen in index
    assert f"{setup} setup {forwards} (before the fit's first loop) ran unobserved" in index


def test_record_eval_is_validated_when_the_callback_is_built() -> None:
    with pytest.raises(TypeError, match="record_eval must be False, True or a Sampler"):
        LightningObserver(record_eval="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="record_eval must be False, True or a Sampler"):
        HuggingFaceObserver(record_eval=3)  # type: ignore[arg-type]
