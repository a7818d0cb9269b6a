"""The trainers' TensorBoard scalars against the histograms the callbacks put beside them: the
steps each trainer logs its metrics under, as README and index.md state them.

A training histogram is on the global step its forward ran at; the Hugging Face Trainer logs
that step's loss one step later, Lightning on the same step. An evaluation histogram
(`record_eval`, under `eval/`) is on the global step its forwards ran at; the Hugging Face
Trainer logs that evaluation on the same step, Lightning one step lower.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import lightning
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    SCALARS,
    EventAccumulator,
)
from test_huggingface_callback import examples, tiny_bert
from test_lightning_callback import ValidationRecorded
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver


def steps(events: EventAccumulator, tag: str, kind: str) -> list[int]:
    """The steps of `tag`'s events of `kind` (histograms or scalars), in order."""
    records: Any = events.Histograms(tag) if kind == HISTOGRAMS else events.Scalars(tag)
    return [record.step for record in records]


def logging_each_step(
    tmp_path: Path, val_check_interval: int, accumulate_grad_batches: int = 1
) -> lightning.Trainer:
    """Four steps logged each to TensorBoard under `tmp_path/logs/version_0`, one validation
    batch per validation, evaluation forwards recorded."""
    return lightning.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(tmp_path, name="logs", version=0),
        callbacks=[LightningObserver(sampler=EveryNForwardsSampler(1), record_eval=True)],
        log_every_n_steps=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=val_check_interval,
        accumulate_grad_batches=accumulate_grad_batches,
    )


def test_lightning_logs_training_metrics_on_the_histograms_step_and_validations_one_lower(
    tmp_path: Path,
) -> None:
    model = ValidationRecorded()
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)
    trainer = logging_each_step(tmp_path, val_check_interval=2)
    trainer.fit(model, data, data)
    sizes = {HISTOGRAMS: 0, SCALARS: 0}
    events = EventAccumulator(str(tmp_path / "logs" / "version_0"), sizes).Reload()
    tag = "net.0/call_0/output/tensor"
    assert steps(events, "train_loss", SCALARS) == steps(events, tag, HISTOGRAMS) == [0, 1, 2, 3]
    validated = [step for step, _ in model.validations]
    assert steps(events, f"eval/{tag}", HISTOGRAMS) == validated == [2, 4]
    assert steps(events, "val_loss", SCALARS) == [step - 1 for step in validated]


def test_a_lightning_validation_between_accumulated_micro_batches_is_logged_on_its_own_step(
    tmp_path: Path,
) -> None:
    """accumulate_grad_batches=2, val_check_interval=3: the validation after batch 3 runs
    before the optimizer step of batches 3-4, and Lightning logs it on the step its samples
    carry, not one lower as the one after batch 6; index.md and a warning say so, once."""
    model = ValidationRecorded()
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)
    trainer = logging_each_step(tmp_path, accumulate_grad_batches=2, val_check_interval=3)
    with pytest.warns(RuntimeWarning, match="validation at global step 1 ran between the micro"):
        trainer.fit(model, data, data)
    events = EventAccumulator(str(tmp_path / "logs" / "version_0"), {HISTOGRAMS: 0, SCALARS: 0})
    events.Reload()
    validated = [step for step, _ in model.validations]
    assert steps(events, "eval/net.0/call_0/output/tensor", HISTOGRAMS) == validated == [1, 3]
    assert steps(events, "val_loss", SCALARS) == [1, 2]  # its own step, then one lower
    index = " ".join((tmp_path / "logs/version_0/torchinstruments/index.md").read_text().split())
    assert index.count("**Note:** the validation at global step 1 ran between the micro") == 1
    assert "global step 3 ran between" not in index


def test_the_hf_trainer_logs_a_steps_loss_one_step_later_and_evaluations_on_their_step(
    tmp_path: Path,
) -> None:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        report_to=["tensorboard"],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = HuggingFaceObserver(
        sampler=EveryNForwardsSampler(1), record_eval=True, max_histogram_modules=1
    )
    trainer = Trainer(
        model=tiny_bert(),
        args=args,
        train_dataset=examples(32),
        eval_dataset=examples(4),
        callbacks=[callback],
    )
    trainer.train()
    sizes = {HISTOGRAMS: 0, SCALARS: 0}
    (log,) = {p.parent for p in (tmp_path / "out" / "runs").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(log), sizes).Reload()
    histograms = cast(dict[str, list[str]], events.Tags())["histograms"]
    (tag,) = [t for t in histograms if t.endswith("/output/tensor") and not t.startswith("eval/")]
    trained = steps(events, tag, HISTOGRAMS)
    assert trained == [0, 1, 2, 3]
    assert steps(events, "train/loss", SCALARS) == [step + 1 for step in trained]
    assert steps(events, f"eval/{tag}", HISTOGRAMS) == steps(events, "eval/loss", SCALARS)
    assert steps(events, "eval/loss", SCALARS) == [2, 4]
