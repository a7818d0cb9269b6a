"""Compiled autograd: the gradients of sampled forwards are recorded, and their samples are whole.

With `torch._dynamo.config.compiled_autograd`, a backward inside a compiled function runs as a
graph dynamo compiles, tensor hooks included. The library's gradient hook is called as plain
Python there (as the autograd engine calls it), and since compiled autograd never runs a callback
queued for the end of its pass, each gradient is written as it arrives. So the rows equal plain
hooks on an eager copy, no sample is marked interrupted, and nothing warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters

from hook_reference import run_both


@pytest.fixture
def compiled_autograd_on() -> Iterator[None]:
    """Compiled autograd on, and no compiled code or setting left to the next test."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):
        yield
    torch._dynamo.reset()


def train_step(model: nn.Module, x: torch.Tensor, engaged: list[bool]) -> torch.Tensor:
    """A training step to compile whole; `engaged` gets, per backward, whether compiled autograd
    ran it (read where the backward reaches the model's output)."""
    out = model(x)
    out.register_hook(lambda grad: engaged.append(compiled_autograd.in_compiled_autograd_region))
    out.square().sum().backward()
    return out.detach()


def eager_step(model: nn.Module, i: int) -> torch.Tensor:
    """The same step on the reference's copy, without compilation."""
    out = model(torch.randn(4, 8))
    out.square().sum().backward()
    return out.detach()


def test_gradients_under_compiled_autograd_equal_plain_hooks_and_no_sample_is_interrupted(
    run_dir: Path, one_thread: None, compiled_autograd_on: None
) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    compiled_step = torch.compile(train_step, backend="eager")  # compiled autograd is read here
    engaged: list[bool] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_both(
            model,
            lambda m, i: compiled_step(m, torch.randn(4, 8), engaged),
            run_dir,
            reference_step=eager_step,
            steps=3,
            every=2,
        )
    assert engaged == [True] * 3
    assert [str(w.message) for w in caught] == []  # neither ours nor dynamo's on our code
    result.assert_conforms()
    gradients = result.history.filter(pl.col("signal") == "output_gradient")
    assert sorted(set(gradients["sample_id"])) == [0, 1]
    assert not result.history.filter(pl.col("metric") == "interrupted").height


class Positions(nn.Module):
    """Returns its parameter as it is (a leaf output, whose hook outlives the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 8))

    def forward(self) -> torch.Tensor:
        return self.table


class WithPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.positions = Positions()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.positions())


def test_a_parameter_output_keeps_no_fired_hook_so_the_backward_is_not_compiled_again(
    run_dir: Path, one_thread: None, compiled_autograd_on: None
) -> None:
    """Compiled autograd compiles the backward again whenever a tensor's count of hooks changes:
    the fired hook of each sample comes off the parameter, so the count stays the same."""
    model = WithPositions()
    compiled_step = torch.compile(train_step, backend="eager")
    engaged: list[bool] = []
    hooks_after_each_step: list[int] = []

    def step(m: nn.Module, i: int) -> torch.Tensor:
        out = compiled_step(m, torch.randn(4, 8), engaged)
        hooks_after_each_step.append(len(model.positions.table._backward_hooks or {}))
        return out

    counters.clear()
    result = run_both(model, step, run_dir, reference_step=eager_step, steps=6)
    result.assert_conforms()
    assert engaged == [True] * 6
    assert hooks_after_each_step == [0] * 6
    assert counters["compiled_autograd"]["captures"] <= 2  # warm-up, then one graph
