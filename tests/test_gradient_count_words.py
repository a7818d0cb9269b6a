"""The count of samples with gradients says what it counts: samples whose output_gradient rows
exist, i.e. whose backward reached a selected layer's output, not every sample a backward ran
over.

A model that wraps each selected layer in reentrant checkpointing runs a real backward every
step (the input's gradient arrives), yet the layers' forwards ran under no_grad, so no gradient
can reach the outputs they returned: the count is 0 and the page says what that 0 means.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history, strict_json

STEPS = 3


class EachLayerCheckpointed(nn.Module):
    """Two linear layers, each run through reentrant checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.first, x, use_reentrant=True)
        return checkpoint(self.second, x, use_reentrant=True)


def steps_then_remove(model: nn.Module) -> int:
    """STEPS training steps, then removal: how many steps' backward reached the input."""
    reached = 0
    for _ in range(STEPS):
        x = torch.randn(5, 3, requires_grad=True)
        model(x).sum().backward()
        reached += x.grad is not None
    remove_observer(model)
    return reached


def test_a_backward_that_reaches_no_layer_output_is_counted_as_no_gradient_not_no_backward(
    run_dir: Path,
) -> None:
    model = EachLayerCheckpointed()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match="torch.no_grad"):
        reached = steps_then_remove(model)
    assert reached == STEPS  # the backward ran, every step

    history = read_history(run_dir)
    with_gradient = history.filter(pl.col("signal") == "output_gradient")["sample_id"].n_unique()
    assert with_gradient == 0
    assert strict_json(run_dir / ".state.json")["counts"]["backward_samples"] == with_gradient
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "with a backward" not in index  # a backward ran in every sample
    found = re.search(r"- counts: (.*)", index)
    assert found is not None
    assert (
        found.group(1) == f"{STEPS} root forwards, {STEPS} samples, 0 samples with output gradients"
    )
    assert (
        "samples with output gradients: samples whose backward reached the output of at least one "
        "selected layer (they have output_gradient rows)"
    ) in index


class RaisesInBackward(torch.autograd.Function):
    """Identity forward; its backward raises (a user's custom op failing)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError("backward failed")


def test_a_backward_that_raised_before_reaching_a_layer_output_is_not_counted(
    run_dir: Path,
) -> None:
    """Sample 1's backward raises before it reaches the layer's output; samples 0 and 2 have
    ordinary backwards: 2 samples with output gradients, as the definition on the page says."""
    layer = nn.Linear(3, 2)
    model = nn.Sequential(layer)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="backward failed"):
        RaisesInBackward.apply(model(torch.randn(4, 3))).sum().backward()
    model(torch.randn(4, 3)).sum().backward()
    remove_observer(model)

    history = read_history(run_dir)
    with_gradient = history.filter(pl.col("signal") == "output_gradient")["sample_id"].unique()
    assert sorted(with_gradient.to_list()) == [0, 2]
    assert strict_json(run_dir / ".state.json")["counts"]["backward_samples"] == 2
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "- counts: 3 root forwards, 3 samples, 2 samples with output gradients" in index
    assert "a backward that raised before reaching one" in index
