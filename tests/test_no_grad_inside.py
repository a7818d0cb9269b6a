"""Layers run under torch.no_grad() inside a sampled forward that otherwise runs with grad
enabled (reentrant `torch.utils.checkpoint` runs its block so in the forward, a `torch.no_grad()`
block in a model's forward), also when that block holds every selected layer: no gradient flows
into their outputs, so they have no gradient rows, as plain hooks see; a warning and index.md
name them and say why, never a silent gap. A forward called under the caller's own no_grad
(evaluation, a frozen teacher) is no such gap.
"""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import polars as pl
import torch
from test_huggingface_callback import examples, tiny_bert
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.gradient_gaps import GradientGaps
from torchinstruments.integrations import HuggingFaceObserver

from conftest import read_history
from hook_reference import run_both

SAID = "ran under torch.no_grad() inside sampled forwards that otherwise ran with grad enabled"


class Checkpointed(nn.Module):
    """`inside` (a Linear and a ReLU) under reentrant checkpointing, between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.inside = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.inside, self.first(x), use_reentrant=True)
        return self.last(h)


def train_step(model: nn.Module, i: int) -> Any:
    out = model(torch.randn(3, 4))
    out.square().sum().backward()
    return out


def page(run: Path) -> str:
    return " ".join((run / "index.md").read_text(encoding="utf-8").split())


def test_layers_under_reentrant_checkpointing_are_named_as_having_no_gradient_rows(
    run_dir: Path,
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = run_both(Checkpointed(), train_step, run_dir, steps=2)
    both.assert_conforms()  # the rows are what plain hooks see: no gradient into `inside`
    gradients = both.history.filter(pl.col("signal") == "output_gradient")
    assert set(gradients["layer"]) == {"first", "last"}
    said = [str(w.message) for w in caught if SAID in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    index = page(run_dir)
    assert f"2 selected layers {SAID}" in index
    assert "`inside.0`, `inside.1`" in index
    assert "reentrant torch.utils.checkpoint" in index
    assert "never returned an output that requires grad" not in index


def test_evaluation_under_no_grad_is_no_such_gap(run_dir: Path) -> None:
    """A forward wholly under no_grad has no gradient anywhere: nothing to say about it."""

    def step(model: nn.Module, i: int) -> Any:
        with torch.no_grad():
            return model.eval()(torch.randn(3, 4))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_both(Checkpointed(), step, run_dir, steps=2).assert_conforms()
    assert not [w for w in caught if SAID in str(w.message)]
    assert SAID not in page(run_dir)


def test_hf_gradient_checkpointing_with_use_reentrant_names_the_layers_without_gradients(
    tmp_path: Path,
) -> None:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    run = tmp_path / "run"
    callback = HuggingFaceObserver(run, sampler=EveryNForwardsSampler(1), max_histogram_modules=1)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=examples(8), callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert [w for w in caught if SAID in str(w.message)]
    history = read_history(run)
    outputs = history.filter(pl.col("signal") == "output")
    inside = set(outputs.filter(~pl.col("grad_enabled"))["layer"])  # the checkpointed layer's
    assert inside
    assert all(name.startswith("bert.encoder.layer.0.") for name in inside)
    assert not inside & set(history.filter(pl.col("signal") == "output_gradient")["layer"])
    index = page(run)
    assert f"{len(inside)} selected layers {SAID}" in index
    assert all(f"`{name}`" in index for name in sorted(inside)[:20])


class Masked(nn.Module):
    """A parameter-free layer called under no_grad in forward (a mask, positions), then a
    Linear that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.angles = Angles()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            angles = self.angles(x)
        return self.proj(x) * angles


class Angles(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(torch.arange(x.shape[-1], dtype=x.dtype))


def test_a_parameter_free_layer_under_no_grad_is_named_without_a_warning(run_dir: Path) -> None:
    """It loses no gradient anything trains on: index.md names it, no warning is raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_both(Masked(), train_step, run_dir, steps=2).assert_conforms()
    assert not [w for w in caught if SAID in str(w.message)]
    assert f"1 selected layer {SAID}" in page(run_dir)
    assert "`angles`" in page(run_dir)


def test_no_grad_outputs_before_and_after_the_samples_first_output_with_grad_are_all_named() -> (
    None
):
    """A sample's no_grad outputs wait until it makes one with grad, and those after that are
    named at once; none is lost between (the sample's later no_grad outputs skip the lock)."""
    gaps = GradientGaps()
    gaps.output_without_grad_mode(0, "before")
    gaps.output_without_grad_mode(0, "before too")
    gaps.sample_with_grad(0)
    gaps.output_without_grad_mode(0, "after")
    gaps.output_without_grad_mode(1, "evaluation")  # a sample with no grad anywhere: not named
    (note,) = gaps.notes()
    assert f"3 selected layers {SAID}" in note
    assert "`before`, `before too`, `after`" in note


def race(gaps: GradientGaps, adders: int, outputs: int) -> None:
    """`adders` threads each add `outputs` no_grad outputs of sample 0 while another thread
    finds that sample made an output with grad, all let go at once."""
    start = threading.Barrier(adders + 1)

    def add(thread: int) -> None:
        start.wait()
        for i in range(outputs):
            gaps.output_without_grad_mode(0, f"{thread}.{i}")

    def turn() -> None:
        start.wait()
        gaps.sample_with_grad(0)

    threads = [threading.Thread(target=add, args=(t,)) for t in range(adders)]
    threads.append(threading.Thread(target=turn))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_no_grad_outputs_from_threads_sharing_a_sample_are_all_named() -> None:
    """Threads add a sample's no_grad outputs while another finds the sample made one with grad:
    every layer is named, whichever came first (threads switched as often as the interpreter
    can, so they interleave inside each call)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(20):
            gaps = GradientGaps()
            for i in range(100):  # waiting when the race starts
                gaps.output_without_grad_mode(0, f"first.{i}")
            race(gaps, adders=4, outputs=200)
            (note,) = gaps.notes()
            assert f"900 selected layers {SAID}" in note
    finally:
        sys.setswitchinterval(interval)


class CheckpointedWhole(nn.Module):
    """Every selected layer inside one checkpointed block: under `use_reentrant=True` none of
    them runs with grad enabled in the forward, though the model is called with it."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def input_step(model: nn.Module, i: int) -> Any:
    """A step whose input requires grad, as reentrant checkpointing needs for any gradient."""
    out = model(torch.randn(3, 4, requires_grad=True))
    out.square().sum().backward()
    return out


def test_a_forward_that_checkpoints_every_layer_reentrantly_names_them_all(run_dir: Path) -> None:
    """No layer's output is made with grad enabled, yet the forward was called with it and its
    backward ran: that is no evaluation forward, and the gap is said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = run_both(CheckpointedWhole(reentrant=True), input_step, run_dir, steps=2)
    both.assert_conforms()  # plain hooks see no gradient into any of them either
    assert set(both.history["signal"]) == {"output"}
    said = [str(w.message) for w in caught if SAID in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "'block.0'" in said[0]
    index = page(run_dir)
    assert f"3 selected layers {SAID}" in index
    assert "`block.0`, `block.1`, `block.2`" in index
    assert "reentrant torch.utils.checkpoint" in index


def test_a_forward_that_checkpoints_every_layer_non_reentrantly_records_their_gradients(
    run_dir: Path,
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = run_both(CheckpointedWhole(reentrant=False), input_step, run_dir, steps=2)
    both.assert_conforms()
    gradients = both.history.filter(pl.col("signal") == "output_gradient")
    assert set(gradients["layer"]) == {"block.0", "block.1", "block.2"}
    assert not [w for w in caught if SAID in str(w.message)]
    assert SAID not in page(run_dir)


def test_a_frozen_teacher_called_under_no_grad_in_train_mode_is_no_such_gap(run_dir: Path) -> None:
    """The user's own torch.no_grad() around the whole call of the observed model (a teacher
    whose outputs a trained student learns from): no gradient was ever meant to reach it."""
    student = nn.Linear(4, 2)

    def distill(teacher: nn.Module, i: int) -> Any:
        x = torch.randn(3, 4)
        with torch.no_grad():
            target = teacher(x)
        (student(x) - target).square().sum().backward()
        return target

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_both(Checkpointed(), distill, run_dir, steps=2).assert_conforms()
    assert not [w for w in caught if SAID in str(w.message)]
    assert SAID not in page(run_dir)
