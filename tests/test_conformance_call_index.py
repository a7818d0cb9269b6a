"""call_index numbers a layer's invocations in the order they begin, and the rows equal plain hooks.

design.md defines a call as the n-th invocation of a layer inside one sampled root forward. Where
invocation order and return order differ, the number is the invocation's: a module that calls
itself (a recursive net with parameters of its own, or the root called inside its own forward)
has call 0 for the outermost call, which returns last; a call that raised keeps its number and has
no rows, also when the model caught the exception and called the layer again. The reference
(`hook_reference.HookRecorder`) numbers calls with a forward pre-hook, so these cases are compared
both ways like the zoo's, and each test also names which call is which on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import polars as pl
import torch
from torch import nn

from hook_reference import Conformance, run_both


class Recursive(nn.Module):
    """A layer (no children) that calls itself `depth` times: each call adds its own tanh to the
    result of the call it makes, so the outermost call returns the whole sum."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        y = torch.tanh(x @ self.weight)
        return y + self(y, depth - 1) if depth > 0 else y


class RetriesAfterRaising(nn.Module):
    """Calls `linear` on a bad shape first (it raises; the model catches it), then twice."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(RuntimeError):  # e.g. a model probing what its layer takes
            self.linear(x[:, :3])
        return self.head(self.linear(torch.tanh(self.linear(x))))


def squares_step(width: int) -> Callable[[nn.Module, int], torch.Tensor]:
    """Forward on fresh inputs, backward of the sum of squares."""

    def step(m: nn.Module, i: int) -> torch.Tensor:
        out = m(torch.randn(3, width))
        out.square().sum().backward()
        return out.detach()

    return step


def maxima(result: Conformance, layer: str) -> dict[int, float]:
    """The `max` of each call's output in sample 0, by call_index."""
    rows = result.history.filter(
        pl.col("sample_id") == 0,
        pl.col("layer") == layer,
        pl.col("signal") == "output",
        pl.col("metric") == "max",
    )
    return dict(zip(rows["call_index"].to_list(), rows["value"].to_list(), strict=True))


def test_a_layer_that_calls_itself_numbers_the_outermost_call_first(
    run_dir: Path, one_thread: None
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Recursive())
    result = run_both(model, squares_step(4), run_dir, steps=2)
    result.assert_conforms()
    model_output = result.observed_outputs[0]
    assert maxima(result, "1")[0] == model_output.max().item()  # the outermost call's result


def test_a_root_that_calls_itself_numbers_the_enclosing_call_first(
    run_dir: Path, one_thread: None
) -> None:
    result = run_both(Recursive(), squares_step(4), run_dir, steps=2)
    result.assert_conforms()
    assert sorted(result.history["forward_index"].unique().to_list()) == [0, 1]
    assert maxima(result, "")[0] == result.observed_outputs[0].max().item()


def test_a_call_that_raised_keeps_its_number_when_the_model_calls_the_layer_again(
    run_dir: Path, one_thread: None
) -> None:
    result = run_both(RetriesAfterRaising(), squares_step(8), run_dir, steps=2)
    result.assert_conforms()
    calls = result.history.filter(pl.col("layer") == "linear", pl.col("metric") == "mean")
    per_sample = calls.group_by("sample_id", "signal").agg(pl.col("call_index").sort())
    assert per_sample["call_index"].to_list() == [[1, 2]] * 4
    assert not result.history.filter(pl.col("metric") == "interrupted").height  # caught: whole
