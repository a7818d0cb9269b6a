"""A layer that returns a view which a later in-place op changes (on the view itself, its base
or another view of the base): the op gives the view a new autograd node, and the gradient
flows into that one, not into the node the layer returned. A hook on the layer's output, plain
or ours, receives nothing, so the layer has no gradient rows, as plain hooks see; a warning and
index.md name it and say why, never a silent gap. A non-view output changed in place keeps its
gradient (its node stays in the graph), and a view left unchanged is no such gap either.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import polars as pl
import torch
from torch import nn

from hook_reference import run_both

SAID = "returned a view that a later in-place op gave a new autograd node"


class Rescaled(nn.Module):
    """`heads` returns a view of `proj`'s output, whose base the forward then scales in place."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.heads = nn.Unflatten(1, (2, 4))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        heads = self.heads(h)
        h.mul_(0.5)  # through the base: the view's node is replaced
        return self.out(heads)


def step(model: nn.Module, i: int) -> Any:
    out = model(torch.randn(3, 1, 4, 4) if isinstance(model, nn.Sequential) else torch.randn(3, 4))
    out.square().sum().backward()
    return out


def observe(model: nn.Module, run_dir: Path) -> tuple[pl.DataFrame, list[str], str]:
    """The run's history (conforming to plain hooks), the warnings that say the gap, index.md."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = run_both(model, step, run_dir, steps=2)
    both.assert_conforms()
    said = [str(w.message) for w in caught if SAID in str(w.message)]
    page = " ".join((run_dir / "index.md").read_text(encoding="utf-8").split())
    return both.history, said, page


def gradient_layers(history: pl.DataFrame) -> set[str]:
    return set(history.filter(pl.col("signal") == "output_gradient")["layer"])


def test_a_view_an_inplace_layer_changes_next_is_named_as_having_no_gradient_rows(
    run_dir: Path,
) -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.ReLU(inplace=True), nn.Linear(8, 2))
    history, said, page = observe(model, run_dir)
    assert gradient_layers(history) == {"0", "2", "3"}  # not the Flatten's view
    assert len(said) == 1
    assert "layer '1'" in said[0]
    assert f"1 selected layer {SAID}" in page
    assert "`1`" in page.split(SAID, 1)[1]


def test_a_view_whose_base_the_forward_changes_in_place_is_named(run_dir: Path) -> None:
    history, said, page = observe(Rescaled(), run_dir)
    assert gradient_layers(history) == {"proj", "out"}
    assert len(said) == 1
    assert "layer 'heads'" in said[0]
    assert f"1 selected layer {SAID}" in page
    assert "`heads`" in page.split(SAID, 1)[1]


def test_a_plain_output_changed_in_place_keeps_its_gradient_and_is_no_such_gap(
    run_dir: Path,
) -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(8, 2))
    history, said, page = observe(model, run_dir)
    assert gradient_layers(history) == {"0", "1", "2", "3"}
    assert not said
    assert SAID not in page


def test_a_view_left_unchanged_keeps_its_gradient_and_is_no_such_gap(run_dir: Path) -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.ReLU(), nn.Linear(8, 2))
    history, said, page = observe(model, run_dir)
    assert gradient_layers(history) == {"0", "1", "2", "3"}
    assert not said
    assert SAID not in page


def test_a_returned_view_the_step_changes_in_place_after_the_forward_is_named(
    run_dir: Path,
) -> None:
    """The model's output is a view that the loss code scales in place (a temperature)."""

    def scaled_step(model: nn.Module, i: int) -> Any:
        out = model(torch.randn(3, 4))
        out.div_(2.0)
        out.square().sum().backward()
        return out

    model = nn.Sequential(nn.Linear(4, 8), nn.Unflatten(1, (2, 4)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = run_both(model, scaled_step, run_dir, steps=2)
    both.assert_conforms()
    assert gradient_layers(both.history) == {"0"}
    said = [str(w.message) for w in caught if SAID in str(w.message)]
    assert len(said) == 1
    assert "layer '1'" in said[0]
