"""Under a trainer callback a row's mode is its forward's phase: a training step's rows are
`train` also for a part the user froze in eval mode (a fine-tuned backbone's BatchNorm), so
they never join the evaluation samples' series of that part.

The reference is a forward pre-hook of the test's own that records, at each call of the model,
whether the trainer was in a training batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import polars as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver

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
