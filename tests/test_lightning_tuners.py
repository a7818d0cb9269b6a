"""Lightning's tuner callbacks (`LearningRateFinder`, `BatchSizeFinder`) run their trials at the
fit's start, before `LightningObserver` attaches: the trials' forwards are not observed, and
index.md and a warning say that they ran, so a run that starts at the fit's first training
step is never read as the whole of what the model computed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import polars as pl
import pytest
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, Callback, LearningRateFinder
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver

STEPS = 3


class Tunable(lightning.LightningModule):
    """A Linear model with the `lr` and `batch_size` the tuners set, counting its training
    steps (trials included)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.lr = 0.1
        self.batch_size = 2
        self.training_steps = 0
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(256, 4, generator=generator),
            torch.randint(0, 2, (256,), generator=generator),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def tuned_fit(tmp_path: Path, tuner: Callback) -> tuple[Tunable, Path, str]:
    """A fit of STEPS steps with `tuner` and an observer sampling every forward; returns the
    model, the run directory and index.md's text (whitespace collapsed)."""
    torch.manual_seed(0)
    model = Tunable()
    callback = LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[callback, tuner],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.warns(RuntimeWarning, match="tuner callbacks ran their trials"):
        trainer.fit(model)
    assert trainer.global_step == STEPS
    run = tmp_path / "run"
    return model, run, " ".join((run / "index.md").read_text(encoding="utf-8").split())


def sample_steps(run: Path) -> list[tuple[int, int]]:
    """(forward_index, step) of each sample, in sample_id order."""
    history = pl.read_parquet(run / "history.parquet")
    samples = history.group_by("sample_id").agg(pl.col("forward_index", "step").first())
    return samples.sort("sample_id").select("forward_index", "step").rows()


def test_a_learning_rate_finders_trial_steps_are_named_and_counted_in_index_md(
    tmp_path: Path,
) -> None:
    model, run, index = tuned_fit(tmp_path, LearningRateFinder(num_training_steps=5))
    trials = model.training_steps - STEPS
    assert trials > 0
    assert sample_steps(run) == [(step, step) for step in range(STEPS)]
    assert (
        "the fit's tuner callbacks ran their trials (short runs of the training loop) at its "
        f"start, before LightningObserver attached: LearningRateFinder ({trials} training "
        "steps). Their forwards were not observed"
    ) in index


def test_a_batch_size_finders_trials_are_named_in_index_md_with_the_size_it_chose(
    tmp_path: Path,
) -> None:
    model, run, index = tuned_fit(tmp_path, BatchSizeFinder(steps_per_trial=1, max_trials=2))
    assert model.batch_size > 2  # it tried and chose a larger batch than the model's own
    assert model.training_steps > STEPS
    assert sample_steps(run) == [(step, step) for step in range(STEPS)]
    history = pl.read_parquet(run / "history.parquet")
    assert {tuple(shape) for shape in history["shape"]} == {(model.batch_size, 2)}
    assert (
        "before LightningObserver attached: BatchSizeFinder (trials per batch size tried; it "
        f"chose {model.batch_size})."
    ) in index
