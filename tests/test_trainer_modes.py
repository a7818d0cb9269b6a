"""Under a trainer callback a row's mode is its forward's phase: a training step's rows are
`train` also for a part the user froze in eval mode (a fine-tuned backbone's BatchNorm), so
they never join the evaluation samples' series of that part. The training samples of
StochasticWeightAveraging's batch-norm epoch, which runs training batches forward only, and those
of a batch whose training_step returned None (Lightning then runs no backward for it) are said in
index.md for what they are.

The reference is a forward pre-hook of the test's own that records, at each call of the model,
whether the trainer was in a training batch (or its epoch and global step)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning
import polars as pl
import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver
from torchinstruments.registry import OBSERVERS

from conftest import read_history, read_result


class FrozenBackbone(lightning.LightningModule):
    """A backbone frozen and put in eval mode at each training epoch's start, a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.head = nn.Linear(8, 2)
        self.backbone.requires_grad_(False)
        self.phases: list[str] = []
        self.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: Any) -> None:
        self.phases.append("train" if self.trainer.training else "eval")

    def on_train_epoch_start(self) -> None:
        self.backbone.eval()  # its running statistics stay those it was given

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def test_a_frozen_part_in_eval_mode_keeps_training_and_evaluation_series_apart(
    tmp_path: Path,
) -> None:
    model = FrozenBackbone()
    callback = LightningObserver(
        tmp_path / "run", sampler=EveryNForwardsSampler(1), record_eval=True
    )
    trainer = lightning.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[callback],
        num_sanity_val_steps=0,
        val_check_interval=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train = TensorDataset(torch.randn(16, 4) * 5 + 3, torch.randint(0, 2, (16,)))
    val = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    trainer.fit(model, DataLoader(train, batch_size=4), DataLoader(val, batch_size=4))
    assert model.phases == ["train", "train", "eval", "eval"] * 2

    history = read_history(tmp_path / "run")
    modes = history.group_by("sample_id").agg(pl.col("mode").unique().sort()).sort("sample_id")
    assert [m.to_list() for m in modes["mode"]] == [[phase] for phase in model.phases]
    for layer in read_result(tmp_path / "run"):
        if layer["layer"].startswith("backbone"):
            entries = {t["mode"]: t["observations"] for t in layer["tensors"]}
            assert entries == {"train": 4, "eval": 4}, layer["layer"]


class WithBatchNorm(lightning.LightningModule):
    """A BatchNorm between two Linear layers; records at each call the epoch and the global step
    (the reference for the samples of each epoch). Its training_step returns None (skips the
    batch) at the global steps in `skip`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        self.calls: list[tuple[int, int]] = []
        self.skip: set[int] = set()
        self.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: Any) -> None:
        self.calls.append((self.trainer.current_epoch, self.trainer.global_step))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        return None if self.trainer.global_step in self.skip else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_training_samples_without_a_backward_are_said_swa_epoch_and_steps_returning_none(
    tmp_path: Path,
) -> None:
    """With batch norm in the model, StochasticWeightAveraging adds an epoch that runs each
    training batch forward only, on the averaged weights: its samples have output rows alone,
    share one step, and index.md says which epoch and step they are (they read as gradient
    accumulation's micro-batches otherwise). A training_step that returns None (step 1 here)
    gets no backward from Lightning: its sample is named, once in a warning and in index.md,
    and SWA's forward-only samples are not taken for such steps."""
    model = WithBatchNorm()
    model.skip = {1}
    trainer = lightning.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[
            LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1)),
            StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1),
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data, batch_size=4))
    assert model.calls == [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 4)]  # epoch 2: SWA's

    history = read_history(tmp_path / "run")
    signals = history.group_by("sample_id").agg(pl.col("signal").unique().sort(), pl.col("step"))
    rows = [
        (s, sorted(set(steps)))
        for s, steps in signals.sort("sample_id").select("signal", "step").rows()
    ]
    both = ["output", "output_gradient"]
    assert rows == [
        (both, [0]),
        (["output"], [1]),  # training_step returned None: no backward
        (both, [2]),
        (both, [3]),
        (["output"], [4]),
        (["output"], [4]),
    ]
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "epoch 2 is StochasticWeightAveraging's batch-norm update" in index
    assert "(step 4, from here to the fit's end) have output rows and no output_gradient" in index
    skipped = "training_step returned None for 1 training batch (global step 1)"
    assert skipped in index
    assert index.count("training_step returned None") == 1  # the fit's note, not the live one
    assert "sample 1 of that batch has output rows and no output_gradient rows" in index
    said = [str(w.message) for w in caught if "LightningObserver: training_step" in str(w.message)]
    assert len(said) == 1
    assert "training batch 1 (global step 1)" in said[0]
    assert "sample 1 of that batch" in said[0]


class StopsWithoutEndingTheFit(lightning.Callback):
    """Raises at the end of global step 2, and again in its own on_exception: the callbacks
    after it (the observer) hear neither on_fit_end nor on_exception."""

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == 2:
            raise RuntimeError("stop")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        raise RuntimeError("stopped again") from exception


def fit_ended_unseen(run: Path) -> nn.Module:
    """A fit whose step 0 returned None, ended unseen by the observer: its model, whose run
    is never removed (the observer's finalizer finishes it, at the exit or the collection)."""
    model = WithBatchNorm()
    model.skip = {0}
    trainer = lightning.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[
            StopsWithoutEndingTheFit(),
            LightningObserver(run, sampler=EveryNForwardsSampler(1)),
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match=r"^stopped again$"):
            trainer.fit(model, DataLoader(data, batch_size=4))
    return model


def test_a_fit_ended_unseen_keeps_the_note_on_steps_returning_none_when_its_run_is_finalized(
    tmp_path: Path,
) -> None:
    """A fit ended with neither on_fit_end nor on_exception (another callback's on_exception
    raised first): the run is finished without removal, by its finalizer, and its index.md
    still names the batch whose training_step returned None, as the run state did live."""
    run = tmp_path / "run"
    model = fit_ended_unseen(run)
    finalizer = OBSERVERS[model]._finalizer
    assert finalizer is not None
    finalizer()  # as at the process's exit, which the model outlives here
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert "remove_observer was not called: the run was finished" in index
    assert (
        "training_step returned None for 1 training batch (global step 0), and Lightning runs no "
        "backward for such a batch"
    ) in index
    assert "sample 0 of that batch has output rows and no output_gradient rows" in index
    assert index.count("training_step returned None") == 1
