"""A failure that leaves rows out is warned once and said in index.md, with what it left out.

A warning scrolls away; the run directory is what a reader has later. Each failure kind that
changes what the run records (a sampler that raises, a gradient or a sample that could not be
recorded) is a note in index.md, in the words of its warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, recording, remove_observer
from torchinstruments import gradients as gradients_module
from torchinstruments.notices import SHOWN_KINDS, RecordingFailures

from conftest import read_history


def notes(run_dir: Path) -> list[str]:
    index = (run_dir / "index.md").read_text("utf-8")
    return [line for line in index.splitlines() if line.startswith("**Note:**")]


# Text a bare link is made of on GitHub (GFM's extended autolinks), in an error's message.
SEE = "see https://ex.org/s or <ops@ex.org>, www.ex.org"


class RaisesAtOne:
    """Samples every forward but forward_index 1, where it raises."""

    def should_sample(self, forward_index: int) -> bool:
        if forward_index == 1:
            raise ValueError(f"schedule file missing: {SEE}")
        return True

    def __repr__(self) -> str:
        return "RaisesAtOne()"


def test_a_sampler_that_raised_is_said_in_index_with_the_forward_it_did_not_sample(
    run_dir: Path,
) -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=RaisesAtOne())
    model(torch.randn(2, 3))
    with pytest.warns(RuntimeWarning, match="schedule file missing") as caught:
        model(torch.randn(2, 3))
    assert any(SEE in str(w.message) for w in caught)
    model(torch.randn(2, 3))
    remove_observer(model)
    assert read_history(run_dir)["forward_index"].unique().sort().to_list() == [0, 2]
    (note,) = [n for n in notes(run_dir) if "RaisesAtOne()" in n]
    # the message as recorded: no bare link (a `.` or `:` behind a backslash, the address as
    # code, which GitHub never links), where the warning quotes it as it is
    assert (
        "sampler RaisesAtOne() raised ValueError('schedule file missing: see https\\://ex.org/s "
        "or <`ops@ex.org`>, www\\.ex.org') for forward_index 1; "
        "a forward whose sampler raises is not sampled (warned when it first happened; later "
        "failures of this kind are not counted)."
    ) in note


def test_a_gradient_that_could_not_be_recorded_is_said_in_index(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = gradients_module.launch

    def launch(measurer: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        if key.layer.name == "0":
            raise RuntimeError("device lost")
        return original(measurer, key, *args, **kwargs)

    monkeypatch.setattr(gradients_module, "launch", launch)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randn(2, 3)).sum().backward()
        remove_observer(model)
    grads = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    assert set(grads["layer"]) == {"1"}  # layer 0's gradient has no rows
    (note,) = [n for n in notes(run_dir) if "device lost" in n]
    assert (
        "recording a gradient failed: RuntimeError('device lost'); that gradient of sample 0 "
        "has no rows (warned when it first happened"
    ) in note


def test_a_sample_that_could_not_be_handed_to_the_sinks_is_said_in_index(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build_records(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("host buffer")

    monkeypatch.setattr(recording, "build_records", build_records)
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randn(2, 3))
        remove_observer(model)
    (note,) = [n for n in notes(run_dir) if "host buffer" in n]
    assert (
        "recording a sample failed: MemoryError('host buffer'); some or all of sample 0's "
        "output rows are not written"
    ) in note


def test_index_lists_at_most_twenty_failure_kinds_and_counts_the_rest() -> None:
    """A kind per layer (an output that cannot be read) must not fill a 3,000-layer page."""
    warned: list[str] = []
    failures = RecordingFailures(lambda key, message: warned.append(key))
    for layer in range(SHOWN_KINDS + 5):
        failures(f"walk:{layer}", f"reading the output of layer '{layer}' failed")
        failures(f"walk:{layer}", "a second time: warned and noted once")
    said = failures.notes()
    assert len(warned) == 2 * (SHOWN_KINDS + 5)  # each call reaches warn_once, which dedups
    assert len(said) == SHOWN_KINDS + 1
    assert said[0].startswith("reading the output of layer '0' failed (warned when")
    assert said[-1] == "5 more kinds of recording failure were warned (see the warnings)."
