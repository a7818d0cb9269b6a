"""A layer's output the loss never uses, from an autograd node with several outputs: no gradient.

A backward pass that reaches a node with several outputs (`split`, `chunk`, `unbind`,
`linalg.svd`, a custom autograd Function's) calls the gradient hooks of all of them, with None
for an output no gradient flowed into. That output gets no gradient row from the pass and nothing
fails or warns; a later pass that does use it records its gradient, the first that brings one,
as plain hooks see it (`hook_reference`, compared both ways).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import polars as pl
import torch
from torch import nn

from hook_reference import Conformance, run_both


class Halves(nn.Module):
    """Returns the two halves of its input's features (one `split` node, two outputs)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.split(4, dim=1)


class FirstHalfHead(nn.Module):
    """A head on the first half; the second half is returned as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.halves = Halves()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = self.halves(self.linear(x))
        return self.head(first), second


Step = Callable[[nn.Module, int], torch.Tensor]


def head_loss(model: nn.Module, i: int) -> torch.Tensor:
    """One backward pass, of the head's output only: the second half gets no gradient."""
    head, _ = model(torch.randn(3, 8))
    head.square().sum().backward()
    return head.detach()


def head_then_second_half(model: nn.Module, i: int) -> torch.Tensor:
    """Two passes over one graph: the head's loss, then one of the second half alone."""
    head, second = model(torch.randn(3, 8))
    head.square().sum().backward(retain_graph=True)
    (second * torch.arange(1.0, 5.0)).sum().backward()
    return head.detach()


def observed_without_warnings(run_dir: Path, step: Step) -> Conformance:
    """The model observed for two steps and compared with plain hooks; no warning of ours."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_both(FirstHalfHead(), step, run_dir, steps=2)
    ours = [str(w.message) for w in caught if "torchinstruments" in str(w.message)]
    assert ours == []
    result.assert_conforms()
    return result


def gradient_paths(result: Conformance, layer: str) -> list[str]:
    """The tensor_paths of `layer` with output_gradient rows, over all samples."""
    rows = result.history.filter(pl.col("layer") == layer, pl.col("signal") == "output_gradient")
    return sorted(set(rows["tensor_path"]))


def test_a_piece_the_loss_never_uses_has_no_gradient_row_and_nothing_fails(
    run_dir: Path, one_thread: None
) -> None:
    result = observed_without_warnings(run_dir, head_loss)
    assert gradient_paths(result, "halves") == ["[0]"]
    outputs = result.history.filter(pl.col("layer") == "halves", pl.col("signal") == "output")
    assert sorted(set(outputs["tensor_path"])) == ["[0]", "[1]"]


def test_a_later_pass_that_uses_the_piece_records_its_gradient(
    run_dir: Path, one_thread: None
) -> None:
    result = observed_without_warnings(run_dir, head_then_second_half)
    assert gradient_paths(result, "halves") == ["[0]", "[1]"]
    second = result.history.filter(
        pl.col("layer") == "halves",
        pl.col("signal") == "output_gradient",
        pl.col("tensor_path") == "[1]",
        pl.col("metric").is_in(["min", "max"]),
    )
    assert sorted(set(second["value"])) == [1.0, 4.0]  # the second pass's weights 1, 2, 3, 4
