"""In-place layers: the gradient recorded for a layer is the one into what that layer returned.

`Linear -> ReLU(inplace=True)`: both layers return the same tensor object, with a different
autograd node after the in-place op. A hook registered on the Linear's return value receives the
gradient into the Linear's result (before the ReLU); one registered on the ReLU's return value
receives the gradient into the ReLU's result. The rows must say the same, value for value, and
the "shared output" rule (one layer returning one tensor in several calls) still holds.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history
from hook_reference import run_both
from reference_values import numpy_profile


def gradient_profile(history: pl.DataFrame, layer: str, call_index: int = 0) -> dict[str, float]:
    rows = history.filter(
        (pl.col("layer") == layer)
        & (pl.col("signal") == "output_gradient")
        & (pl.col("call_index") == call_index)
    )
    return dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))


def assert_profile(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want)
    for metric, value in want.items():
        assert got[metric] == pytest.approx(value, rel=1e-9, abs=1e-12), metric


def test_inplace_relu_gets_the_gradient_into_its_own_output(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 3))
    x = torch.randn(5, 6)
    # the reference: plain tensor hooks, registered on each layer's return value as it returns
    seen: dict[str, torch.Tensor] = {}

    def hook_output(name: str):
        def forward_hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            output.register_hook(lambda grad: seen.setdefault(name, grad.clone()))

        return forward_hook

    handles = [model[i].register_forward_hook(hook_output(str(i))) for i in range(3)]
    model(x).square().sum().backward()
    for handle in handles:
        handle.remove()
    model.zero_grad()
    assert not torch.equal(seen["0"], seen["1"])  # the ReLU's gradient differs from the Linear's

    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(x).square().sum().backward()
    remove_observer(model)

    history = read_history(run_dir)
    for name in ("0", "1", "2"):
        assert_profile(gradient_profile(history, name), numpy_profile(seen[name]))


class TwiceInPlace(nn.Module):
    """One in-place layer applied twice to the same tensor: a new autograd node each time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.LeakyReLU(0.5, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.act(self.act(h) * 3)


class SharedIdentity(nn.Module):
    """One Identity returning the very same tensor in two calls (no in-place op between)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.same = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.same(h) * 2 + self.same(h)


def test_each_call_of_an_inplace_layer_gets_its_own_gradient(run_dir: Path) -> None:
    model = TwiceInPlace()
    x = torch.randn(3, 4)
    grads: list[torch.Tensor] = []

    def forward_hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: grads.append(grad.clone()))

    handle = model.act.register_forward_hook(forward_hook)
    model(x).sum().backward()
    handle.remove()
    model.zero_grad()
    by_call = {1: grads[0], 0: grads[1]}  # the later call's gradient arrives first

    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(x).sum().backward()
    remove_observer(model)
    history = read_history(run_dir)
    for call_index, grad in by_call.items():
        assert_profile(gradient_profile(history, "act", call_index), numpy_profile(grad))


def test_one_tensor_returned_twice_by_one_layer_is_still_a_shared_output(run_dir: Path) -> None:
    model = SharedIdentity()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    rows = read_history(run_dir).filter(
        (pl.col("layer") == "same") & (pl.col("signal") == "output_gradient")
    )
    assert sorted(set(rows["call_index"].to_list())) == [0, 1]
    assert rows["value"].is_null().all()
    assert rows["unavailable_reason"].str.starts_with("shared output").all()


class Table(nn.Module):
    """Returns its parameter itself (a leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2, 3))

    def forward(self) -> torch.Tensor:
        return self.table


class UsesTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = Table()

    def forward(self, scale: float) -> torch.Tensor:
        return self.pos() * scale


def test_a_leaf_updated_in_place_between_two_samples_is_still_one_shared_output(
    run_dir: Path,
) -> None:
    model = UsesTable()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    first = model(1.0)  # forward_index 0 returns the leaf
    with torch.no_grad():
        model.pos.table.mul_(0.5)  # its version moves; its gradient sink does not
    second = model(3.0)  # forward_index 1: the same leaf again
    (first.sum() + second.sum()).backward()  # one gradient into the leaf: the sum of both uses
    remove_observer(model)
    rows = read_history(run_dir).filter(
        (pl.col("layer") == "pos") & (pl.col("signal") == "output_gradient")
    )
    assert sorted(set(rows["sample_id"].to_list())) == [0, 1]
    assert rows["value"].is_null().all()
    assert rows["unavailable_reason"].str.starts_with("shared output").all()


class ClampedBetweenCalls(nn.Module):
    """`same` returns one tensor twice, with an in-place change under no_grad between the calls
    (its version moves, its autograd node does not); `other` returns it once more."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.same = nn.Identity()
        self.other = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        first = self.same(h)
        with torch.no_grad():
            h.clamp_(min=-100.0)
        return first * 2 + self.same(h) * 3 + self.other(h)


def test_a_tensor_changed_in_place_under_no_grad_between_two_calls_is_one_shared_output(
    run_dir: Path,
) -> None:
    def step(model: nn.Module, i: int) -> torch.Tensor:
        output = model(torch.randn(3, 4))
        output.square().sum().backward()
        return output

    result = run_both(ClampedBetweenCalls(), step, run_dir)
    result.assert_conforms()
    rows = result.history.filter(layer="same", signal="output_gradient")
    assert sorted(set(rows["call_index"].to_list())) == [0, 1]
    assert rows["unavailable_reason"].str.starts_with("shared output").all()
    assert (
        result.history.filter(layer="other", signal="output_gradient")["value"].is_not_null().all()
    )
