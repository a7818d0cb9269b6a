"""Control flow operators in an eager model: `torch.cond` whose branches call layers.

In eager mode `torch.cond` compiles its branches with dynamo (`fullgraph=True`) whatever the
compile stance, so in a sampled forward dynamo meets a layer's forward proxy inside them. The
reference is plain hooks on a deep copy, as in the zoo (`hook_reference`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _zoo import squares_step
from hook_reference import run_both


class Branches(nn.Module):
    """`torch.cond` on the sign of `pre`'s output: `then` in one branch, `other` in the other."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.then, self.other = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.pre(x)
        return torch.cond(h.sum() > 0, lambda t: self.then(t), lambda t: self.other(t), (h,))


@pytest.mark.xfail(
    strict=True,
    reason=(
        "a sampled forward raises in the user's step: torch.cond compiles its branches with "
        "fullgraph=True, and dynamo cannot trace a layer's forward proxy (UncapturedHigherOrderOp"
        "Error: 'call to a callable object with no traceable __call__'; with the branches "
        "compiled before, an AssertionError from FakeTensorMode as the proxy is called)"
    ),
)
def test_layers_called_in_torch_cond_branches_equal_plain_hooks(
    run_dir: Path, one_thread: None
) -> None:
    step = squares_step(lambda: torch.randn(3, 4))
    result = run_both(Branches(), step, run_dir, steps=2)
    result.assert_conforms()
