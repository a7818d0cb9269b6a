"""What the resumed-fit tests share: a Lightning fit of `FIRST` steps resumed to `TOTAL`, the check
that two fits' rows read as one run, and the training steps a run's samples hold."""

from __future__ import annotations

import json
from pathlib import Path

import lightning
import polars as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from polars.testing import assert_frame_equal
from test_lightning_callback import Tiny
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver
from torchinstruments.rundir.state import Status, read_state

from conftest import cli_in_process

FIRST, TOTAL = 3, 6


def check_continued(run: Path, first: pl.DataFrame) -> None:
    """The two fits' rows in `run` as one run, the first fit's kept as they were."""
    history = pl.read_parquet(run / "history.parquet")
    assert_frame_equal(history.filter(pl.col("attempt") == 0), first)
    assert first["attempt"].unique().to_list() == [0]
    later = history.filter(pl.col("attempt") == 1)
    first_ids = first["sample_id"].unique().sort().to_list()
    assert first_ids == list(range(FIRST))
    assert later["sample_id"].unique().sort().to_list() == list(range(FIRST, TOTAL))
    steps = history.group_by("sample_id").agg(pl.col("step").unique()).sort("sample_id")
    assert steps["step"].to_list() == [[step] for step in range(TOTAL)]  # global steps 0-5
    result = json.loads((run / "result.json").read_text(encoding="utf-8"))
    entry = next(t for layer in result for t in layer["tensors"])
    assert entry["observations"] == TOTAL
    assert (entry["first_sample_id"], entry["latest_sample_id"]) == (0, TOTAL - 1)
    state = read_state(run)
    assert state.status is Status.COMPLETE
    assert [(a.attempt, a.ended, a.samples) for a in state.attempts] == [
        (0, "removed", FIRST),
        (1, "removed", TOTAL - FIRST),
    ]
    # The callback passed resume for the fit resumed from a checkpoint: the user never wrote
    # resume=True, and the state and `show` say what happened.
    assert [a.continued_by for a in state.attempts] == [None, "checkpoint"]
    shown = cli_in_process("show", run, "--metrics", "mean")
    assert shown.returncode == 0, shown.stderr
    said = "attempts: 2, continued by a fit resumed from a checkpoint (removed: attempts 0-1);"
    assert said in " ".join(shown.stdout.split())  # `show` wraps long lines
    assert "resume=True" not in shown.stdout


def lightning_fit(
    tmp_path: Path,
    max_steps: int,
    ckpt: Path | None,
    callback: LightningObserver | None = None,
    version: int | None = 0,
) -> lightning.Trainer:
    """A fit of `Tiny` for `max_steps` (from `ckpt`), every forward sampled by `callback`
    (default: a fresh LightningObserver), logged to `tmp_path/logs/version_<version>` (None: the
    logger's next version)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs", version=version),
        callbacks=[callback or LightningObserver(sampler=EveryNForwardsSampler(1))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Tiny(),
        train_dataloaders=DataLoader(data, batch_size=4),
        ckpt_path=None if ckpt is None else str(ckpt),
    )
    return trainer


def training_steps(run: Path) -> list[tuple[int, list[int]]]:
    """Per attempt, the steps of its training samples (those with gradient rows)."""
    history = pl.read_parquet(run / "history.parquet")
    grads = history.filter(pl.col("signal") == "output_gradient")
    return grads.group_by("attempt").agg(pl.col("step").unique().sort()).sort("attempt").rows()
