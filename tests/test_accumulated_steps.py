"""Gradient accumulation under the trainer callbacks: the k micro-batches of an optimizer step
share its global step, and the trainer's TensorBoard gets one histogram per tag and step, the
step's first sample, the same whatever TensorBoard reader opens it (its default data server
keeps only the last record written at a step; its Python reader keeps them all). The tag
description says so, index.md counts the samples left out, and the run directory's own events
hold every sample on its forward_index.

Read back with TensorBoard's own reader (`EventAccumulator`, every event kept); each histogram
in the trainer's logger is compared bucket by bucket with the run directory's histogram of the
sample that forward_index names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator
from test_huggingface_callback import examples, tiny_bert
from test_trainer_phases import Recorded
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver
from torchinstruments.sinks.tensorboard import ONE_PER_STEP

from conftest import read_history

ACCUMULATE, STEPS = 4, 3
SHARED = "shares step 0 with an earlier sample"


def read_events(log_dir: Path) -> EventAccumulator:
    """Every event of `log_dir`, as TensorBoard's Python reader keeps them (no sampling)."""
    return EventAccumulator(str(log_dir), size_guidance={HISTOGRAMS: 0}).Reload()


def buckets(event: Any) -> tuple:
    """What a histogram event draws: its range, count and buckets."""
    value = event.histogram_value
    return (value.min, value.max, value.num, tuple(value.bucket_limit), tuple(value.bucket))


def check_one_per_step(trainer_log: Path, run: Path, tags: list[str]) -> None:
    """Each tag holds one histogram per global step in the trainer's logger: the one the run
    directory holds at the forward_index of that step's first training sample."""
    history = read_history(run)
    train = history.filter(mode="train", signal="output").unique(["sample_id"])
    by_step: dict[int, list[int]] = {}
    for step, forward_index in sorted(zip(train["step"], train["forward_index"], strict=True)):
        by_step.setdefault(step, []).append(forward_index)
    assert sorted(by_step) == list(range(STEPS))
    assert all(len(fs) == ACCUMULATE for fs in by_step.values())  # all micro-batches sampled
    trainer_events, run_events = read_events(trainer_log), read_events(run / "tensorboard")
    for tag in tags:
        drawn = trainer_events.Histograms(tag)
        assert [e.step for e in drawn] == list(range(STEPS)), tag
        own = {e.step: buckets(e) for e in run_events.Histograms(tag)}
        assert sorted(own) == sorted(f for fs in by_step.values() for f in fs), tag
        for event in drawn:
            assert buckets(event) == own[by_step[event.step][0]], (tag, event.step)
            later = [own[f] for f in by_step[event.step][1:]]
            assert any(b != buckets(event) for b in later)  # the micro-batches differ
        description = trainer_events.SummaryMetadata(tag).summary_description
        assert description.endswith(ONE_PER_STEP), tag


def index_text(run: Path) -> str:
    return " ".join((run / "index.md").read_text(encoding="utf-8").split())


def left_out_note(samples: int) -> str:
    return (
        f"**Note:** {samples} samples shared a step with an earlier sample (gradient "
        "accumulation's micro-batches, an evaluation's batches), so the trainer's TensorBoard "
        "logger holds no histogram of them: it gets one histogram per tag and step, the step's "
        "first sample's"
    )


def test_hf_accumulation_puts_one_histogram_per_tag_on_each_global_step(tmp_path: Path) -> None:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=["tensorboard"],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = HuggingFaceObserver(
        tmp_path / "run", sampler=EveryNForwardsSampler(1), max_histogram_modules=1
    )
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=examples(32), callbacks=[callback]
    )
    with pytest.warns(RuntimeWarning, match=SHARED):
        trainer.train()
    [log] = {p.parent for p in (tmp_path / "out" / "runs").rglob("events.out.tfevents.*")}
    tag = "bert.embeddings.word_embeddings/call_0/output"
    check_one_per_step(log, tmp_path / "run", [f"{tag}/tensor", f"{tag}_gradient/tensor"])
    left_out = STEPS * (ACCUMULATE - 1)  # every micro-batch but each step's first
    assert left_out_note(left_out) in index_text(tmp_path / "run")


def test_lightning_accumulation_puts_one_histogram_per_tag_on_each_global_step(
    tmp_path: Path,
) -> None:
    data = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=ACCUMULATE,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs", version=0),
        callbacks=[LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(RuntimeWarning, match=SHARED):
        trainer.fit(Recorded(), DataLoader(data, batch_size=4))
    tags = [
        f"net.{i}/call_0/{signal}/tensor"
        for i in (0, 2)
        for signal in ("output", "output_gradient")
    ]
    check_one_per_step(tmp_path / "logs" / "version_0", tmp_path / "run", tags)
    assert left_out_note(STEPS * (ACCUMULATE - 1)) in index_text(tmp_path / "run")


def test_one_sample_per_step_leaves_nothing_out_and_says_nothing(tmp_path: Path) -> None:
    """Without accumulation each step has one sample: every one is in the logger, no note."""
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs", version=0),
        callbacks=[LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Recorded(), DataLoader(data, batch_size=4))
    drawn = read_events(tmp_path / "logs" / "version_0").Histograms("net.0/call_0/output/tensor")
    assert [e.step for e in drawn] == list(range(STEPS))
    assert "shared a step with an earlier sample" not in index_text(tmp_path / "run")
