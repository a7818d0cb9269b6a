"""The trainer callbacks hand their trainer's loss scaler over: each sample's scale is recorded.

Lightning: a real `precision="16-mixed"` fit on the CPU (its MixedPrecision plugin holds a
`torch.amp.GradScaler("cpu")`; given here with a scale too large for float16 so that it changes
during the fit). Hugging Face: accelerate holds no scaler on the CPU, so the Trainer's Accelerator
is given one before train(), which its own backward and optimizer then use as on a GPU with
fp16=True. In both, the scale recorded for the sample of each global step is the scaler's
`get_scale()` at the start of that step; a bfloat16 fit, which scales nothing, records none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import polars as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from test_huggingface_callback import examples, tiny_bert
from test_lightning_callback import Tiny
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver

from conftest import read_history, strict_json

STEPS = 8


def scale_of_each_sample(run: Path) -> list[float | None]:
    """The recorded scale of each sample, in sample order, from `.state.json`'s spans."""
    spans = strict_json(run / ".state.json")["counts"]["loss_scales"]
    samples = sorted(read_history(run)["sample_id"].unique())
    assert samples == list(range(STEPS))  # one sample per training step, in order
    return [
        next(s["scale"] for s in reversed(spans) if s["first_sample_id"] <= sample)
        for sample in samples
    ]


class ScaleAtStepStart(lightning.Callback):
    """The scaler's scale when each training batch starts (before its forward)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler, self.scales = scaler, []

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self.scales.append(self.scaler.get_scale())


def lightning_fit(tmp_path: Path, precision: Any, scaler: Any = None) -> tuple[Path, list]:
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    callback = LightningObserver(sampler=EveryNForwardsSampler(1))
    seen = ScaleAtStepStart(scaler) if scaler is not None else None
    trainer = lightning.Trainer(
        default_root_dir=tmp_path,  # the callback's run directory is made under it
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[callback, *([seen] if seen is not None else [])],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **precision,
    )
    trainer.fit(Tiny(), train_dataloaders=DataLoader(data, batch_size=4))
    assert callback.directory is not None
    return callback.directory, [] if seen is None else seen.scales


def test_lightning_16_mixed_records_its_scalers_scale_of_each_step(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    run, scales = lightning_fit(tmp_path, precision, scaler)
    assert len(set(scales)) > 1  # the scale changed during the fit
    assert scale_of_each_sample(run) == scales
    page = (run / "index.md").read_text(encoding="utf-8")
    assert "**Gradient rows are scaled:**" in page


def test_lightning_bf16_mixed_records_no_scale(tmp_path: Path) -> None:
    run, _ = lightning_fit(tmp_path, {"precision": "bf16-mixed"})
    assert strict_json(run / ".state.json")["counts"]["loss_scales"] == []
    assert "## Loss scale" not in (run / "index.md").read_text(encoding="utf-8")
    assert read_history(run).filter(pl.col("signal") == "output_gradient").height > 0


class HfScaleAtStepStart(TrainerCallback):
    """The Accelerator's scale when each step starts (before its forward)."""

    def __init__(self) -> None:
        self.scaler: torch.amp.GradScaler | None = None
        self.scales: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.scaler is not None
        self.scales.append(self.scaler.get_scale())


def test_hugging_face_trainer_records_the_accelerators_scale_of_each_step(
    tmp_path: Path,
) -> None:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    seen = HfScaleAtStepStart()
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1))
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=examples(40), callbacks=[callback, seen]
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    trainer.accelerator.scaler = seen.scaler = scaler  # what fp16=True holds on a GPU
    trainer.train()
    assert callback.directory is not None
    assert len(set(seen.scales)) > 1  # it grows after every step without an overflow
    assert scale_of_each_sample(callback.directory) == seen.scales
    assert "**Gradient rows are scaled:**" in (callback.directory / "index.md").read_text("utf-8")
    history = read_history(callback.directory)
    assert history.filter(pl.col("signal") == "output_gradient").height > 0


def test_callbacks_refuse_a_grad_scaler_that_is_not_one_when_built() -> None:
    for callback in (LightningObserver, HuggingFaceObserver):
        with pytest.raises(TypeError, match=r"grad_scaler must be a torch\.amp\.GradScaler"):
            callback(grad_scaler="fp16")
