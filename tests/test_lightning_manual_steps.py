"""Lightning's manual optimization: a training step that calls the model twice and steps two
optimizers. Each call is a training sample on the trainer's global step, which counts every
optimizer's step() call, while Lightning logs its scalars once per training batch: the run says
that the two axes differ, and says nothing where each batch steps once.

The reference is a forward pre-hook of the test's own, recording what the trainer was doing at
each call, and the logger's own event file read back with TensorBoard's reader."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning
import polars as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    SCALARS,
    EventAccumulator,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver

from conftest import read_history

SAID = "advanced trainer.global_step by 2"


class TwoOptimizers(lightning.LightningModule):
    """Two forwards per training step, each followed by one optimizer's step (a GAN's shape);
    `optimizers=1`: one forward and one step per batch."""

    def __init__(self, optimizers: int = 2) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.automatic_optimization = False
        self.count = optimizers
        self.calls: list[tuple[bool, int]] = []  # (in a training batch, global step)
        self.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: Any) -> None:
        trainer = self.trainer
        self.calls.append((trainer.training and not trainer.sanity_checking, trainer.global_step))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        optimizers = self.optimizers()
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            loss = self(x).pow(2).mean()
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            optimizer.step()  # type: ignore[union-attr]
            self.log("loss", loss)

    def configure_optimizers(self) -> Any:
        first = torch.optim.SGD(self.a.parameters(), lr=0.1)
        return (first, torch.optim.SGD(self.b.parameters(), lr=0.1)) if self.count == 2 else first


def fit(tmp_path: Path, model: TwoOptimizers) -> LightningObserver:
    """4 training batches, a TensorBoardLogger logging every batch."""
    callback = LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))
    trainer = lightning.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[callback],
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    return callback


def test_two_optimizer_steps_per_batch_are_said_to_be_off_the_loggers_step_axis(
    tmp_path: Path,
) -> None:
    model = TwoOptimizers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, model)
    # Both calls of every step are training samples, each on the global step at its call.
    assert [step for training, step in model.calls if training] == list(range(8))
    history = read_history(tmp_path / "run")
    samples = history.group_by("sample_id").agg(pl.col("step").first(), pl.col("signal").unique())
    assert samples.sort("sample_id")["step"].to_list() == list(range(8))
    assert all(set(s) == {"output", "output_gradient"} for s in samples["signal"])
    # The logger's own axes: scalars per batch (0..3), histograms on the global step (0..7).
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), {HISTOGRAMS: 0, SCALARS: 0})
    events.Reload()
    assert sorted({e.step for e in events.Scalars("loss")}) == [0, 1, 2, 3]
    assert [e.step for e in events.Histograms("a/call_0/output/tensor")] == list(range(8))
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert SAID in index
    assert "once per training batch" in index
    # Its training_step returns None, as manual optimization's do: no skipped backward is said.
    assert "training_step returned None" not in index
    assert sum(SAID in str(w.message) for w in caught) == 1


def test_one_optimizer_step_per_batch_says_nothing_of_step_axes(tmp_path: Path) -> None:
    model = TwoOptimizers(optimizers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, model)
    assert [step for training, step in model.calls if training] == [0, 1, 2, 3]
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "trainer.global_step by" not in index
    assert not any("trainer.global_step by" in str(w.message) for w in caught)
