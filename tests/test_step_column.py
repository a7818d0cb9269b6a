"""History's `step` column in a plain loop: the value given with `set_step`, null otherwise.

The trainer callbacks' step (the trainer's global step) is pinned in
tests/test_trainer_phases.py, with real trainers.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import cast

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

import torchinstruments
from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer, set_step

from conftest import run_status


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def test_step_is_what_the_loop_gave_and_null_before(run_dir: Path) -> None:
    model = small_model()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    model(torch.randn(3, 4)).sum().backward()  # forward 0, sampled before any set_step
    for step in range(6):  # forwards 1..6: 2, 4, 6 sampled, at steps 1, 3, 5
        set_step(model, np.int64(10 * step) if step % 2 else 10 * step)
        model(torch.randn(3, 4)).sum().backward()
    set_step(model, None)
    model(torch.randn(3, 4)).sum().backward()  # forward 7: not sampled
    model(torch.randn(3, 4)).sum().backward()  # forward 8: sampled, no step
    remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history.schema["step"] == pl.Int64
    per_sample = history.group_by("sample_id", "signal").agg(
        pl.col("forward_index").unique(), pl.col("step").unique()
    )
    got = {
        (row["sample_id"], row["signal"]): (row["forward_index"], row["step"])
        for row in per_sample.iter_rows(named=True)
    }
    want_steps = {0: None, 1: 10, 2: 30, 3: 50, 4: None}
    for (sample_id, _signal), (forward_index, steps) in got.items():
        assert forward_index == [2 * sample_id]
        assert steps == [want_steps[sample_id]]  # the gradient rows share their forward's step
    assert {signal for _, signal in got} == {"output", "output_gradient"}


def test_set_step_is_public_and_refuses_a_non_integer_or_one_beyond_int64(run_dir: Path) -> None:
    assert "set_step" in torchinstruments.__all__
    model = small_model()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError, match="set_step: step must be an integer"):
            set_step(model, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="set_step: step must be an integer"):
        set_step(model, torch.tensor(4, device="meta"))  # no value to read
    for beyond in (2**63, np.uint64(2**64 - 1), -(2**63) - 1):
        # accepted, such a step failed the write of every part holding it (their rows lost)
        with pytest.raises(ValueError, match="set_step: step must fit the history's Int64"):
            set_step(model, beyond)
    set_step(model, torch.tensor(4))  # a 0-d integer tensor is an integer
    set_step(model, 2**63 - 1)
    model(torch.ones(1, 4))
    remove_observer(model)
    assert run_status(run_dir) == "complete"
    assert pl.read_parquet(run_dir / "history.parquet")["step"].unique().to_list() == [2**63 - 1]


def test_set_step_without_an_observer_warns_and_the_loop_goes_on() -> None:
    model = small_model()
    with pytest.warns(RuntimeWarning, match="set_step: this Sequential has no observer"):
        set_step(model, 3)


def test_set_step_on_a_compiled_wrapper_reaches_the_observer(run_dir: Path) -> None:
    model = small_model()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    wrapper = cast(nn.Module, torch.compile(model, backend="eager"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # found through the wrapper: no "no observer" warning
        set_step(wrapper, 12)
    assert not said, [str(w.message) for w in said]
    model(torch.randn(2, 4))
    remove_observer(model)
    steps = pl.read_parquet(run_dir / "history.parquet")["step"].unique().to_list()
    assert steps == [12]
