"""The user's ambient torch state neither changes what is measured nor sees the measurement.

Under `torch.autocast` a custom reducer computes as outside it; a user's torch function and
dispatch modes see the model's ops only, so a mode that counts ops counts what the unobserved
model runs, and one that refuses every other op breaks neither the step nor a row.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchinstruments import EveryNForwardsSampler, L2Norm, inject_observer, remove_observer

from conftest import read_history


def gram(tensor: torch.Tensor) -> torch.Tensor:
    """A reducer whose matmul autocast would run in bfloat16."""
    return (tensor @ tensor.T).sum()


def test_a_custom_reducer_under_the_users_autocast_reads_as_outside_it(run_dir: Path) -> None:
    """The output (float32: Tanh keeps its input's dtype) and its gradient, reduced with a
    matmul: under CPU autocast the reducer's matmul ran in bfloat16 (33.0 for 33.04...)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    weights = torch.randn(8, 16)
    model = nn.Sequential(nn.Tanh())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), reducers=[gram])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (model(x) * weights).sum().backward()
    remove_observer(model)
    history = read_history(run_dir).filter(pl.col("metric") == "gram")
    got = dict(zip(history["signal"], history["value"], strict=True))
    with torch.no_grad():
        expected = {"output": gram(torch.tanh(x)).item(), "output_gradient": gram(weights).item()}
    assert got == pytest.approx(expected, rel=1e-6)


class CountedFunctions(TorchFunctionMode):
    """Counts every torch function it sees; refuses any outside `allowed` (when given)."""

    def __init__(self, allowed: Counter[str] | None = None) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()
        self.allowed = allowed

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        name = getattr(func, "__qualname__", str(func))
        self.seen[name] += 1
        if self.allowed is not None and name not in self.allowed:
            raise RuntimeError(f"refused {name}")
        return func(*args, **(kwargs or {}))


class CountedOps(TorchDispatchMode):
    """Counts every aten op it sees; refuses any outside `allowed` (when given)."""

    def __init__(self, allowed: Counter[str] | None = None) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()
        self.allowed = allowed

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.seen[str(func)] += 1
        if self.allowed is not None and str(func) not in self.allowed:
            raise RuntimeError(f"refused {func}")
        return func(*args, **(kwargs or {}))


def test_the_users_modes_see_the_models_ops_only_and_refusing_others_costs_no_row(
    run_dir: Path,
) -> None:
    """Both kinds of mode at once, around a step whose every layer is sampled (the default
    profile and a custom reducer, outputs and gradients): the hooks, the statistics and the
    host transfer were seen (a counting mode counted them, a refusing one nulled the rows)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(8, 16)

    def step(functions: CountedFunctions, ops: CountedOps) -> None:
        model.zero_grad(set_to_none=True)
        with functions, ops:
            model(x).square().sum().backward()

    plain = CountedFunctions(), CountedOps()
    step(*plain)
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), reducers=[L2Norm()]
    )
    observed = CountedFunctions(plain[0].seen), CountedOps(plain[1].seen)
    step(*observed)
    remove_observer(model)
    assert observed[0].seen == plain[0].seen
    assert observed[1].seen == plain[1].seen
    history = read_history(run_dir)
    assert history.height == 3 * 2 * 10  # layers x signals x (9 default metrics + l2_norm)
    assert history["unavailable_reason"].null_count() == history.height
