"""A tensor returned as is by several sampled calls: no gradient is attributed to one of them.

A leaf (a Parameter a module returns, an input that requires grad passed through an Identity)
receives ONE gradient per backward: the sum over every use. When several sampled calls returned
that same tensor, no call owns that sum, so each of their gradient rows is null with a reason
saying so; a leaf returned by one call gets its own, exact row. Reference gradients come from
plain autograd on the same values (`.grad`), reduced with NumPy.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history
from reference_values import numpy_profile


class Table(nn.Module):
    """Returns its parameter itself (like a learned positional table)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 3))

    def forward(self) -> torch.Tensor:
        return self.table


class TwoUses(nn.Module):
    """Calls the shared `pos` twice per forward; the two uses get different gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = Table()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.pos()).sum() + (x.square() * self.pos()).sum() * 3


def gradient_rows(directory: Path, layer: str) -> pl.DataFrame:
    history = read_history(directory)
    return history.filter((pl.col("layer") == layer) & (pl.col("signal") == "output_gradient"))


def test_parameter_returned_by_two_calls_gets_null_gradient_rows_with_reason(
    run_dir: Path,
) -> None:
    model = TwoUses()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(4, 3)).backward()
    remove_observer(model)
    rows = gradient_rows(run_dir, "pos")
    assert sorted(set(rows["call_index"].to_list())) == [0, 1]
    assert rows["value"].null_count() == rows.height
    assert all("returned by 2 sampled calls" in reason for reason in rows["unavailable_reason"])
    outputs = read_history(run_dir).filter(pl.col("signal") == "output")
    expected = numpy_profile(model.pos.table)["mean"]
    assert outputs.filter(pl.col("metric") == "mean")["value"].to_list() == [
        pytest.approx(expected),
        pytest.approx(expected),
    ]


def test_leaf_returned_once_per_sample_gets_its_exact_gradient(run_dir: Path) -> None:
    model = nn.Sequential(nn.Identity(), nn.Linear(3, 2))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    expected = []
    for step in range(3):
        x = torch.randn(5, 3, requires_grad=True)  # a leaf, returned as is by the Identity
        (model(x) * (step + 1)).square().sum().backward()
        assert x.grad is not None
        expected.append(numpy_profile(x.grad))
    remove_observer(model)
    rows = gradient_rows(run_dir, "0")
    for sample_id, profile in enumerate(expected):
        got = {
            r["metric"]: r["value"]
            for r in rows.filter(pl.col("sample_id") == sample_id).rows(named=True)
        }
        assert got == {
            name: pytest.approx(value, rel=1e-6, abs=1e-7) for name, value in profile.items()
        }


def test_eval_sample_of_a_leaf_is_not_credited_with_a_later_gradient(run_dir: Path) -> None:
    model = nn.Sequential(nn.Identity(), nn.Linear(3, 2))
    x = torch.randn(5, 3, requires_grad=True)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with torch.no_grad():
        model(x)  # sample 0: no graph, so no gradient will ever flow into this output
    model(x).square().sum().backward()  # sample 1
    remove_observer(model)
    assert x.grad is not None
    rows = gradient_rows(run_dir, "0")
    assert rows["sample_id"].unique().to_list() == [1]
    got = {r["metric"]: r["value"] for r in rows.rows(named=True)}
    assert got["mean"] == pytest.approx(numpy_profile(x.grad)["mean"], rel=1e-6, abs=1e-7)


def test_leaf_shared_by_two_samples_before_one_backward_is_null_for_both(run_dir: Path) -> None:
    model = nn.Sequential(nn.Identity(), nn.Linear(3, 2))
    x = torch.randn(5, 3, requires_grad=True)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    loss = model(x).square().sum() + model(x).sum()  # samples 0 and 1, one backward
    loss.backward()
    remove_observer(model)
    rows = gradient_rows(run_dir, "0")
    assert sorted(rows["sample_id"].unique().to_list()) == [0, 1]
    assert rows["value"].null_count() == rows.height
    assert all("returned by 2 sampled calls" in reason for reason in rows["unavailable_reason"])


def test_non_leaf_returned_by_two_calls_is_null_too(run_dir: Path) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)
            self.same = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.linear(x)
            return (self.same(hidden) * 2 + self.same(hidden).square()).sum()

    model = Twice()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(4, 3)).backward()
    remove_observer(model)
    rows = gradient_rows(run_dir, "same")
    assert sorted(set(rows["call_index"].to_list())) == [0, 1]
    assert rows["value"].null_count() == rows.height
    # the gradient into `linear`'s output is the same sum, and it belongs to that one call
    assert gradient_rows(run_dir, "linear")["value"].null_count() == 0
