"""global_statistics over float64 outputs of extreme magnitude: the exact mean and std, not a null
and not a std that underflowed to 0.

Two gloo ranks, data parallel, the world group named. The layers scale a float64 activation by
1e-170 (squares below the smallest float64: a std computed from them is 0), by 1e200 (squares
beyond the largest: inf), by 1e200 on one rank and 1e-200 on the other (ranks of different
scales), and one returns entries of +-float64 max (sums overflow). The reference is exact:
Python fractions of every rank's values, gathered by the test itself through plain forward
hooks, rounded once to float64.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _ranks import joined, run_ranks

FLOAT64_MAX = float(np.finfo(np.float64).max)
LAYERS = ("tiny", "huge", "apart", "limit")


class Scaled(nn.Module):
    """Multiplies its input by `factor` (one per rank)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Limit(nn.Module):
    """+-float64 max, by the sign of each entry."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = torch.full_like(x, FLOAT64_MAX)
        return torch.where(x > 0, top, -top)


class Net(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 6).double()
        self.tiny = Scaled(1e-170)
        self.huge = Scaled(1e200)
        self.apart = Scaled(1e200 if rank == 0 else 1e-200)
        self.limit = Limit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        for layer in LAYERS:
            getattr(self, layer)(h)
        return h


def worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with joined(rank, world_size, port):
        torch.manual_seed(0)
        model = Net(rank)
        seen: dict[str, list[float]] = {}
        for name in LAYERS:
            getattr(model, name).register_forward_hook(
                lambda m, a, out, name=name: seen.__setitem__(name, out.reshape(-1).tolist())
            )
        inject_observer(
            model,
            output_dir=output_dir,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
        )
        torch.manual_seed(10 + rank)
        model(torch.randn(3 + rank, 4, dtype=torch.float64))
        remove_observer(model)
        gathered: list[object] = [None] * world_size
        dist.all_gather_object(gathered, seen)
        if rank == 0:
            Path(output_dir, "seen.json").write_text(json.dumps(gathered))


def exact_mean_and_std(values: list[float]) -> tuple[float, float]:
    """The mean and population std of `values`, exact, each rounded once to float64."""
    entries = [Fraction(value) for value in values]
    mean = sum(entries) / len(entries)
    variance = sum((entry - mean) ** 2 for entry in entries) / len(entries)
    shift = 0  # a power of four out of the variance, so float() neither overflows nor underflows
    while variance > Fraction(2) ** 1000:
        variance, shift = variance / 4, shift + 1
    while 0 < variance < Fraction(2) ** -1000:
        variance, shift = variance * 4, shift - 1
    return float(mean), math.ldexp(math.sqrt(float(variance)), shift)


def test_float64_outputs_beyond_the_range_of_their_squares_have_their_exact_global_moments(
    tmp_path: Path,
) -> None:
    run_ranks(worker, str(tmp_path))
    seen = json.loads((tmp_path / "seen.json").read_text())
    for rank in range(2):
        history = pl.read_parquet(tmp_path / f"rank-{rank:03d}" / "history.parquet")
        for layer in LAYERS:
            values = [value for part in seen for value in part[layer]]
            rows = history.filter(layer=layer, signal="output")
            assert rows["population"].unique().to_list() == ["global:ranks=0,1"]
            got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
            mean, std = exact_mean_and_std(values)
            largest = max(abs(value) for value in values)
            assert got["std"] == pytest.approx(std, rel=1e-12, abs=0), layer
            # the mean's error is relative to the largest magnitude (cancellation)
            assert got["mean"] == pytest.approx(mean, rel=1e-12, abs=1e-15 * largest), layer
            assert (got["min"], got["max"]) == (min(values), max(values)), layer
