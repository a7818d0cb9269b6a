"""`LightningObserver` on a real Lightning Trainer: a tiny model, three steps, on the CPU."""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, cast

import lightning
import polars as pl
import pytest
import torch
import torch._dynamo
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler, ObserverConfig, has_observer
from torchinstruments.integrations import LightningObserver
from torchinstruments.registry import OBSERVERS
from torchinstruments.rundir.page_queries import LIGHTNING_EVAL_SCALARS, LIGHTNING_SCALARS

from conftest import read_history, read_spans, run_status, strict_json

STEPS = 3


class Tiny(lightning.LightningModule):
    """Two Linear layers; `training_step` calls `self(x)` (or `self.net(x)` when `direct`)."""

    def __init__(self, raise_at: int | None = None, direct: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.raise_at = raise_at
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.raise_at:
            raise ValueError("boom in training_step")
        x, y = batch
        out = self.net(x) if self.direct else self(x)
        loss = nn.functional.cross_entropy(out, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path: Path, model: Tiny, callback: LightningObserver) -> lightning.Trainer:
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs"),
        callbacks=[callback],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=4))
    return trainer


def test_fit_is_observed_into_the_log_dir_with_histograms_on_the_global_step(
    tmp_path: Path,
) -> None:
    model = Tiny()
    callback = LightningObserver(sampler=EveryNForwardsSampler(1))
    trainer = fit(tmp_path, model, callback)

    log_dir = tmp_path / "logs" / "version_0"
    assert trainer.log_dir == str(log_dir)
    run = log_dir / "torchinstruments"
    assert callback.directory == run
    assert not has_observer(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    history = read_history(run)
    assert sorted(history["forward_index"].unique()) == list(range(STEPS))
    # One forward per optimizer step: the step column is the trainer's global step then.
    assert (history["step"] == history["forward_index"]).all()
    assert set(history["layer"].unique()) == {"net.0", "net.1", "net.2"}
    assert set(history["signal"].unique()) == {"output", "output_gradient"}
    assert run_status(run) == "complete"
    # No evaluation in the fit: the calls after it, which the run never sees, are still said.
    notes = (run / "index.md").read_text(encoding="utf-8").splitlines()
    assert (
        "**Note:** trainer.validate(), trainer.test() and trainer.predict() calls after the fit "
        "run after the observer was removed: not observed, not counted."
    ) in notes

    events = EventAccumulator(str(log_dir), size_guidance={HISTOGRAMS: 0}).Reload()
    tags = cast(dict[str, list[str]], events.Tags())
    assert "train_loss" in tags["scalars"]
    for tag in ("net.0/call_0/output/tensor", "net.2/call_0/output_gradient/tensor"):
        assert [e.step for e in events.Histograms(tag)] == list(range(STEPS)), tag


def test_a_fast_dev_run_is_observed_into_a_temporary_directory_it_names_not_the_working_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fast_dev_run suppresses Lightning's logging and checkpoints (trainer.log_dir is None):
    the fit is observed, but its run goes to a fresh temporary directory, which a warning and
    index.md name (as it is, whatever it holds), not into the working directory the default
    would fall back to."""
    # Markdown's characters and a line break, no glob's (polars reads the history below)
    work, temporary = tmp_path / "work", tmp_path / "t`m|p _x_ ~\n<q>"
    work.mkdir()
    temporary.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    callback = LightningObserver(sampler=EveryNForwardsSampler(1))
    trainer = lightning.Trainer(
        fast_dev_run=True,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Tiny(), train_dataloaders=DataLoader(data, batch_size=4))

    assert list(work.iterdir()) == []  # nothing of Lightning's, nothing of ours
    [made] = temporary.iterdir()
    assert made.name.startswith("torchinstruments-fast_dev_run-")
    run = made / "torchinstruments"
    assert callback.directory == run
    assert read_history(run)["forward_index"].unique().to_list() == [0]  # the one batch
    assert run_status(run) == "complete"
    said = [
        str(w.message) for w in caught if "LightningObserver: this fit ran under" in str(w.message)
    ]
    assert len(said) == 1
    assert "writes its run to a temporary directory, " in said[0]
    assert read_spans(said[0]) == [str(run)]
    index = (run / "index.md").read_text(encoding="utf-8").splitlines()
    [note] = [line for line in index if "this fit ran under Lightning's fast_dev_run" in line]
    assert read_spans(note) == [str(run)]  # on one line, read back as the directory itself


def test_fit_that_raises_removes_the_observer_and_says_so_in_index_md(tmp_path: Path) -> None:
    model = Tiny(raise_at=2)
    callback = LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))
    with pytest.raises(ValueError, match="boom in training_step"):
        fit(tmp_path, model, callback)

    assert not has_observer(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    history = read_history(tmp_path / "run")
    assert sorted(history["forward_index"].unique()) == [0, 1]
    assert history["value"].null_count() == 0
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert run_status(tmp_path / "run") == "complete"
    assert (
        "the fit ended with an exception at global step 2: ValueError: boom in training_step."
        in index
    )


def test_options_pass_through_and_module_chooses_what_the_step_calls(tmp_path: Path) -> None:
    model = Tiny(direct=True)  # training_step calls self.net(x): the LightningModule is bypassed
    callback = LightningObserver(
        module="net",
        sampler=EveryNForwardsSampler(2),
        selector=lambda name, module: isinstance(module, nn.Linear),
        histogram_selector=lambda name, module: name == "2",
        reducers={"numel": lambda t: t.numel()},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit(tmp_path, model, callback)
    assert callback.directory is not None
    history = read_history(callback.directory)
    assert sorted(history["forward_index"].unique()) == [0, 2]
    assert set(history["layer"].unique()) == {"0", "2"}
    assert "numel" in set(history["metric"].unique())
    events = EventAccumulator(
        str(tmp_path / "logs" / "version_0"), size_guidance={HISTOGRAMS: 0}
    ).Reload()
    assert cast(dict[str, list[str]], events.Tags())["histograms"] == [
        "2/call_0/output/tensor",
        "2/call_0/output_gradient/tensor",
    ]


def test_a_step_that_bypasses_the_observed_module_is_warned_after_the_first_step(
    tmp_path: Path,
) -> None:
    model = Tiny(direct=True)
    callback = LightningObserver(sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match=r"the first training step never called the observed"):
        fit(tmp_path, model, callback)
    assert not has_observer(model)
    assert callback.directory is not None
    index = " ".join((callback.directory / "index.md").read_text(encoding="utf-8").split())
    assert (
        "LightningObserver: the first training step never called the observed `Tiny`, so no "
        "training forward is recorded"
    ) in index
    assert "pass module='net' (the attribute your step calls; its submodules: `net`)" in index
    # The training steps ran, through the module's own part: never "the model was never called".
    assert "the model was never called" not in index
    assert (
        "**No sample was recorded:** the trainer's training steps ran without calling the "
        "model (the note above says which module to observe), so history.parquet has no rows"
    ) in index


class ValidatedDirect(Tiny):
    """A `Tiny(direct=True)` whose validation step calls `self(x)`: only evaluation forwards
    reach the LightningModule."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


def test_a_bypassed_training_step_is_warned_when_only_evaluation_forwards_call_the_module(
    tmp_path: Path,
) -> None:
    """Under record_eval the sanity check's forwards are observed (as eval samples), yet no
    training forward reached the module: the first step's check still warns, and says so."""
    model = ValidatedDirect(direct=True)
    run = tmp_path / "run"
    callback = LightningObserver(run, sampler=EveryNForwardsSampler(1), record_eval=True)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    trainer = lightning.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        num_sanity_val_steps=1,
        limit_val_batches=1,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(RuntimeWarning, match=r"the first training step never called the observed"):
        trainer.fit(model, data, data)
    history = read_history(run)
    assert set(history["mode"]) == {"eval"}  # the sanity check and validation: observed
    assert history["sample_id"].n_unique() == 2
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert (
        "the first training step never called the observed `ValidatedDirect`, so no training "
        "forward is recorded"
    ) in index


def test_a_fit_whose_model_ran_only_in_unobserved_evaluation_is_never_said_never_called(
    tmp_path: Path,
) -> None:
    """Every training step bypasses the LightningModule and only validation calls it, without
    record_eval: no sample, yet the model was called. index.md, the state and the warning say
    how many evaluation forwards ran unobserved (counted here by a hook of the test's own)."""
    model = ValidatedDirect(direct=True)
    calls: list[bool] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(model.trainer.training))
    run = tmp_path / "run"
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    trainer = lightning.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        num_sanity_val_steps=1,
        limit_val_batches=1,
        callbacks=[LightningObserver(run, sampler=EveryNForwardsSampler(1))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, data)
    evaluation = len(calls)
    assert evaluation == 2
    assert not any(calls)
    said = [str(w.message) for w in caught if "no sample was recorded" in str(w.message)]
    assert said == [
        f"torchinstruments: no sample was recorded (0 root forwards seen, none sampled; "
        f"{evaluation} evaluation forwards ran unobserved): {run} holds no rows, and its index.md "
        "says so"
    ]
    assert run_status(run) == "complete"
    counts = strict_json(run / ".state.json")["counts"]
    assert (counts["root_forwards"], counts["unobserved_eval_forwards"]) == (0, evaluation)
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert "the model was never called" not in index
    assert (
        "**No sample was recorded:** no training forward called the model, and "
        f"{evaluation} evaluation forwards ran unobserved, so history.parquet has no rows"
    ) in index
    assert f"**Note:** {evaluation} evaluation forwards inside the fit" in index
    assert (
        f"0 samples with output gradients; {evaluation} evaluation forwards ran unobserved" in index
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sampler": object()}, "sampler"),
        ({"max_histogram_modules": 0}, "max_histogram_modules"),
        ({"rank_policy": "every"}, "rank_policy"),
        ({"module": 3}, "module must be None"),
        ({"model": nn.Linear(1, 1)}, "model is not an option"),
        ({"samplr": EveryNForwardsSampler(1)}, r"'samplr' is not an option.*sampler, selector"),
    ],
)
def test_bad_option_fails_when_the_callback_is_built(kwargs: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        LightningObserver(**kwargs)


def test_the_callbacks_config_is_built_once_and_is_the_runs(
    tmp_path: Path, config_builds: list[ObserverConfig]
) -> None:
    """One ObserverConfig per run: built with the callback, and that very object observes the fit."""
    seen: list[ObserverConfig] = []

    class Spy(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(OBSERVERS[self].config)
            return super().training_step(batch, batch_idx)

    callback = LightningObserver(sampler=EveryNForwardsSampler(2))
    fit(tmp_path, Spy(), callback)
    assert len(config_builds) == 1
    assert len(seen) == STEPS
    assert all(config is config_builds[0] for config in seen)
    # ... and it is what the run did: every second forward sampled, in the fit's own directory.
    assert callback.directory == tmp_path / "logs" / "version_0" / "torchinstruments"
    run = callback.directory
    assert run is not None
    assert sorted(read_history(run)["forward_index"].unique()) == [0, 2]


def test_fit_of_a_compiled_module_costs_one_graph_break_at_the_call_of_the_model(
    tmp_path: Path,
) -> None:
    """`trainer.fit(torch.compile(model))`: Lightning compiles `training_step` in place, and it
    calls the observed model through the root proxy, which dynamo cannot trace: one graph break
    there and the model's forward as a graph of its own, as for any compiled function calling
    the observed model. Everything is recorded, and index.md names the compiled root."""

    def compiled_fit(callback: LightningObserver | None) -> tuple[int, int]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
        trainer = lightning.Trainer(
            max_steps=STEPS,
            accelerator="cpu",
            devices=1,
            logger=False,
            callbacks=[] if callback is None else [callback],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        compiled = torch.compile(Tiny(), backend="eager")
        trainer.fit(compiled, train_dataloaders=DataLoader(data, batch_size=4))  # type: ignore[arg-type]
        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        torch._dynamo.reset()
        return graphs, breaks

    plain_graphs, plain_breaks = compiled_fit(None)
    callback = LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(2))
    assert compiled_fit(callback) == (plain_graphs + 1, plain_breaks + 1)
    assert sorted(read_history(tmp_path / "run")["forward_index"].unique().to_list()) == [0, 2]
    index = (tmp_path / "run" / "index.md").read_text("utf-8")
    assert "compiled modules: the root" in index


class LossRecorded(Tiny):
    """Tiny, with the loss each training forward computed, in order, and a validation step."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))


class ValidationRecorded(LossRecorded):
    """LossRecorded, with each validation forward's global step and loss."""

    def __init__(self) -> None:
        super().__init__()
        self.validations: list[tuple[int, float]] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.validations.append((self.trainer.global_step, loss.item()))
        self.log("val_loss", loss)


def by_step_query(index: str, scalars: str, mode: str) -> Any:
    """index.md's by-step query, run with `scalars` as the log and samples of `mode`."""
    setup, *blocks = re.findall(r"```python\n(.*?)```", index, re.DOTALL)
    (block,) = [b for b in blocks if "by_step = (" in b]
    block = re.sub(r"(?m)^scalars = .*$", f"scalars = {scalars}", block)
    assert 'pl.col("mode") == "train"' in block
    block = block.replace('pl.col("mode") == "train"', f'pl.col("mode") == "{mode}"')
    namespace: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(setup, "index.md:setup", "exec"), namespace)
        exec(compile(block, "index.md:by_step", "exec"), namespace)
    return namespace["by_step"]


def test_index_md_pairs_each_evaluation_sample_with_the_validation_loss_its_forward_logged(
    tmp_path: Path,
) -> None:
    """Lightning logs a validation's metrics under the global step before the one its forwards
    ran at (the step its record_eval samples carry): index.md's expression for evaluation
    samples shifts the log by one, so each eval sample meets the loss its own forward computed.
    The first validation comes after 101 logged training rows, so a CSV read that infers its
    schema from the first 100 rows read val_loss as text."""
    model = ValidationRecorded()
    callback = LightningObserver(
        sampler=EveryNForwardsSampler(50), record_eval=EveryNForwardsSampler(1)
    )
    data = TensorDataset(torch.randn(412, 4), torch.randint(0, 2, (412,)))
    trainer = lightning.Trainer(
        max_steps=103,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        callbacks=[callback],
        log_every_n_steps=1,
        val_check_interval=101,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(data, batch_size=4)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
    assert callback.directory is not None
    csv = str(Path(cast(str, trainer.log_dir)) / "metrics.csv")
    logged = pl.read_csv(csv, infer_schema_length=None).drop_nulls("val_loss")
    assert [step + 1 for step in logged["step"]] == [step for step, _ in model.validations]
    index = (callback.directory / "index.md").read_text(encoding="utf-8")
    assert LIGHTNING_EVAL_SCALARS in index
    scalars = LIGHTNING_EVAL_SCALARS.replace("lightning_logs/version_0/metrics.csv", csv)
    by_step = by_step_query(index, scalars, "eval")
    assert model.validations
    assert by_step.height == len(model.validations)
    assert by_step["step"].to_list() == [step for step, _ in model.validations]
    assert by_step["val_loss"].dtype == pl.Float64
    assert by_step["val_loss"].to_list() == pytest.approx([v for _, v in model.validations])


def test_index_md_step_query_pairs_each_sample_with_the_loss_its_forward_logged_in_lightning(
    tmp_path: Path,
) -> None:
    """The by-step query, with the page's own Lightning CSVLogger expression as `scalars`, joins
    each training sample with the loss its very forward logged, once: Lightning writes a
    validation's metrics in a row of their own under the step of a training row (here after
    steps 1 and 3), and with both rows the join doubled those steps' samples."""
    model = LossRecorded()
    callback = LightningObserver(sampler=EveryNForwardsSampler(1))
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = lightning.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        callbacks=[callback],
        log_every_n_steps=1,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(data, batch_size=4)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
    assert callback.directory is not None
    csv = Path(cast(str, trainer.log_dir)) / "metrics.csv"
    text = (callback.directory / "index.md").read_text(encoding="utf-8")
    assert LIGHTNING_SCALARS in text
    scalars = LIGHTNING_SCALARS.replace("lightning_logs/version_0/metrics.csv", str(csv))
    assert scalars != LIGHTNING_SCALARS
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
    assert by_step["step"].to_list() == list(range(4))  # one row per training sample
    assert by_step["train_loss"].to_list() == pytest.approx(model.losses)
    # the validations' metrics are kept, on the step they were logged under
    assert by_step["val_loss"].is_null().to_list() == [True, False, True, False]


def test_the_bypass_note_names_submodules_as_code_so_none_renders_as_emphasis() -> None:
    """A child named `_net_` (or a class name) written outside code rendered as an emphasised
    `net` in index.md: the module to pass was not the one named."""
    from torchinstruments.integrations._fit_notes import bypassed_note

    model = nn.Module()
    model.add_module("_net_", nn.Linear(2, 2))
    model.add_module("head", nn.Linear(2, 2))
    note = bypassed_note(model)
    assert "the observed `Module`, so no training forward" in note
    assert note.endswith(
        "(the attribute your step calls; its submodules: `_net_`, `head`) to "
        "observe that module instead"
    )
