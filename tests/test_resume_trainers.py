"""A trainer fit resumed from a checkpoint continues its run: Lightning `fit(ckpt_path=...)` and
the Hugging Face Trainer's `train(resume_from_checkpoint=...)`.

Each trainer fits a few steps and saves a checkpoint; a second trainer with a new callback (as a
restarted job builds them) resumes from it. The callback sees the resume and continues the run
in the same directory (`resume=True`): the first fit's rows are unchanged (compared value by
value with history.parquet as the first fit left it), sample_id continues, the step column
(the trainer's global step) runs on without a gap, and result.json covers both fits.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning
import polars as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from polars.testing import assert_frame_equal
from test_huggingface_callback import examples, tiny_bert
from test_lightning_callback import Tiny
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver
from torchinstruments.rundir.state import Status, read_state

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


def lightning_fit(tmp_path: Path, max_steps: int, ckpt: Path | None) -> lightning.Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs", version=0),
        callbacks=[LightningObserver(sampler=EveryNForwardsSampler(1))],
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


def test_a_lightning_fit_resumed_with_ckpt_path_continues_the_run(tmp_path: Path) -> None:
    trainer = lightning_fit(tmp_path, FIRST, None)
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)
    run = tmp_path / "logs" / "version_0" / "torchinstruments"
    first = pl.read_parquet(run / "history.parquet")
    lightning_fit(tmp_path, TOTAL, ckpt)
    assert not (run.parent / "torchinstruments-2").exists()  # continued, not a new run
    check_continued(run, first)


def hf_train(tmp_path: Path, max_steps: int, resume: bool) -> Trainer:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=FIRST,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), max_histogram_modules=1)
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=examples(32), callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer


def test_an_hf_fit_resumed_from_checkpoint_continues_the_run(tmp_path: Path) -> None:
    hf_train(tmp_path, FIRST, resume=False)
    run = tmp_path / "out" / "torchinstruments"
    first = pl.read_parquet(run / "history.parquet")
    hf_train(tmp_path, TOTAL, resume=True)
    assert not (run.parent / "torchinstruments-2").exists()
    check_continued(run, first)
