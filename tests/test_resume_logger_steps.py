"""A fit resumed behind the last step its run recorded, whose TensorBoard logger writes where
the earlier fit's did (a pinned `version`), writes histograms at steps the earlier fit already
wrote. TensorBoard's default data server keeps one record per tag and step and drops the ones
at or after a step it sees again, so index.md says which steps lose the earlier attempt's
histograms there, while the run's own tensorboard/ never repeats a step.

The steps are read from the event files with TensorBoard's own loader, never from the note.
"""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from test_trainer_phases import Recorded
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver

TAG = "net.0/call_0/output/tensor"


def fit(tmp_path: Path, ckpt: Path | None, version: int | None) -> None:
    """7 optimizer steps, a checkpoint every 2, every forward sampled into tmp_path/run."""
    data = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    trainer = lightning.Trainer(
        max_steps=7,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(tmp_path, name="tb", version=version),
        limit_val_batches=0,
        callbacks=[
            LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1)),
            ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Recorded(), DataLoader(data, batch_size=4), ckpt_path=None if ckpt is None else str(ckpt)
    )


def steps_per_file(folder: Path) -> list[list[int]]:
    """The steps of TAG in each event file of `folder`, oldest file first."""
    return [
        [e.step for e in EventFileLoader(str(path)).Load() for v in e.summary.value if v.tag == TAG]
        for path in sorted(folder.glob("events.out.tfevents.*"))
    ]


def index_text(tmp_path: Path) -> str:
    return " ".join((tmp_path / "run" / "index.md").read_text(encoding="utf-8").split())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_resumed_fit_names_the_steps_its_pinned_logger_writes_again(tmp_path: Path) -> None:
    fit(tmp_path, None, version=0)
    fit(tmp_path, tmp_path / "ckpt" / "epoch=0-step=4.ckpt", version=0)
    first, second = steps_per_file(tmp_path / "tb" / "version_0")
    again = sorted(set(first) & set(second))
    assert again == [4, 5, 6]  # the resumed fit wrote the earlier fit's steps 4 to 6 again
    own = steps_per_file(tmp_path / "run" / "tensorboard")
    assert sum(len(s) for s in own) == len({step for s in own for step in s})  # none repeated
    assert (
        f"earlier attempts wrote records up to step {max(first)}; this fit resumed at global "
        f"step {again[0]} and writes there again, so TensorBoard's default data server (a record "
        "at a step it has seen drops the ones at or after it) shows this attempt's histograms "
        f"from step {again[0]} on and no longer the earlier attempts' at steps {again[0]} to "
        f"{again[-1]}"
    ) in index_text(tmp_path)
    assert "history.parquet every attempt's rows" in index_text(tmp_path)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_resumed_fit_with_a_new_logger_version_says_nothing_of_its_steps(
    tmp_path: Path,
) -> None:
    """Lightning's default: a new version_N per fit, a TensorBoard run of its own."""
    fit(tmp_path, None, version=None)
    fit(tmp_path, tmp_path / "ckpt" / "epoch=0-step=4.ckpt", version=None)
    assert (tmp_path / "tb" / "version_1").is_dir()
    assert "writes there again" not in index_text(tmp_path)
