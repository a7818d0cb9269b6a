"""`torchinstruments show PARENT` on a model with more series than a screen holds: grouped by
module type, signal and `at`, as `show DIR` is by module type and signal.

The expected numbers are computed here from each rank's history.parquet with plain Polars: per
series, each rank's latest value (its value at its largest sample_id); per module type and
signal, the smallest and largest of any rank's, the widest spread of one series across ranks
(max - min) and that series' rank farthest from its median of the ranks' values.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    inject_observer,
    remove_observer,
)
from torchinstruments.cli.text import number

from conftest import cli_in_process as cli
from conftest import grouped_rows

PAIRS = 35  # 35 x (Linear, Tanh) + `late`: 71 tensors, 284 rows per metric
RANKS = 3
STEPS = 3


class Deep(nn.Module):
    """PAIRS Linear+Tanh pairs; `late` (a Linear) runs only where `late` is set (rank 0)."""

    def __init__(self, late: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(PAIRS) for m in (nn.Linear(4, 4), nn.Tanh())])
        self.late = nn.Linear(4, 4)
        self.run_late = late

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.late(h) if self.run_late else h


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deep") / "stats"
    for rank in range(RANKS):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", str(rank))
            env.setenv("WORLD_SIZE", str(RANKS))
            torch.manual_seed(rank)
            model = Deep(late=rank == 0)
            inject_observer(
                model,
                output_dir=directory,
                sampler=EveryNForwardsSampler(1),
                rank_policy="all",
            )
        for _ in range(STEPS):
            model(torch.randn(8, 4) * (rank + 1)).sum().backward()
        remove_observer(model)
    return directory


def latest_values(parent: Path) -> pl.DataFrame:
    """Each rank's latest value per series (rank, module_type, signal, metric, layer, value)."""
    key = ["layer", "call_index", "signal", "tensor_path", "metric"]
    frames = [
        pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet")
        .sort("sample_id")
        .group_by(key)
        .agg(pl.col("module_type").last(), pl.col("value").last())
        .with_columns(rank=pl.lit(rank))
        for rank in range(RANKS)
    ]
    return pl.concat(frames)


def farthest(values: dict[int, float]) -> int:
    """The rank farthest from the median of `values` (rank -> value); a tie: the lower rank."""
    median = statistics.median(list(values.values()))
    return min(values, key=lambda rank: (-abs(values[rank] - median), rank))


def test_show_parent_of_a_big_model_has_one_row_per_module_type_signal_and_at(
    parent: Path,
) -> None:
    result = cli("show", parent)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert len(lines) <= 40 + len(DEFAULT_METRICS) * 12  # 8 rows per metric, not 284
    assert "71 tensors of 71 layers" in result.stdout
    latest = latest_values(parent)
    for metric in DEFAULT_METRICS:
        start = lines.index(f"{metric}:")
        rows = grouped_rows(lines, start)
        assert len(rows) == 8
        table = {tuple(row[:3]): row[3:] for row in rows}
        assert set(table) == {
            (t, s, at)
            for t in ("Linear", "Tanh")
            for s in ("out", "grad")
            for at in ("latest", "window")
        }
        for module_type in ("Linear", "Tanh"):
            for signal, short in (("output", "out"), ("output_gradient", "grad")):
                mine = latest.filter(
                    pl.col("metric") == metric,
                    pl.col("module_type") == module_type,
                    pl.col("signal") == signal,
                )
                per_series: dict[str, dict[int, float]] = {}
                for layer, rank, value in mine.select("layer", "rank", "value").iter_rows():
                    per_series.setdefault(layer, {})[rank] = value
                spreads = {
                    layer: max(v.values()) - min(v.values()) for layer, v in per_series.items()
                }
                widest = max(spreads, key=lambda layer: spreads[layer])
                want = [
                    str(len(per_series)),
                    str(sum(len(v) < RANKS for v in per_series.values())),  # `late`: rank 0 only
                    number(min(v for each in per_series.values() for v in each.values())),
                    number(max(v for each in per_series.values() for v in each.values())),
                    number(spreads[widest]),
                    str(farthest(per_series[widest])),
                ]
                got = table[module_type, short, "latest"]
                assert got == want, (metric, module_type, signal)
                assert table[module_type, short, "window"][:2] == want[:2]


def test_show_parent_all_prints_every_series_and_csv_every_row(parent: Path) -> None:
    result = cli("show", parent, "--all", "--metrics", "std")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("std:")
    rows = lines[start + 3 : start + 3 + 4 * (2 * PAIRS + 1)]
    names = list(dict.fromkeys(line.split()[0] for line in rows))
    assert names == [f"body.{i}" for i in range(2 * PAIRS)] + ["late"]
    csv = cli("show", parent, "--format", "csv", "--metrics", "std")
    frame = pl.read_csv(csv.stdout.encode())
    assert frame.height == (2 * PAIRS + 1) * 2 * 2  # signals x (latest, window)


def test_show_parent_of_a_small_model_prints_every_series(parent: Path) -> None:
    """15 tensors (60 rows per metric) are printed per series, as before grouping existed."""
    result = cli("show", parent, "--layers", r"^body\.([0-9]|1[0-4])$", "--metrics", "std")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("std:")
    assert lines[start + 1].split()[:3] == ["layer", "sig", "at"]
    assert len([line for line in lines[start + 3 :] if line.startswith("body.")]) == 60
