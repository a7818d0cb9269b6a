"""`torchinstruments show` on a model with more tensors than a screen holds: grouped by module type.

The expected numbers are computed here from history.parquet with plain Polars: per module type
and signal, the latest value of each tensor (its value at its largest sample_id), then the
smallest, median and largest of those; a tensor whose largest sample_id is older than the run's
has a series that stopped.
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
from torchinstruments.cli.overview import OVERVIEW_TENSORS
from torchinstruments.cli.text import number

from conftest import cli_in_process as cli
from conftest import grouped_rows

PAIRS = 35  # 35 x (Linear, Tanh) = 70 tensors, more than OVERVIEW_TENSORS
STEPS = 3


class Deep(nn.Module):
    """PAIRS Linear+Tanh pairs; `late` (a Linear) runs only in the first two forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(PAIRS) for m in (nn.Linear(4, 4), nn.Tanh())])
        self.late = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.body(x)
        return self.late(h) if self.calls <= 2 else h


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deep") / "stats"
    model = Deep()
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(STEPS):
        model(torch.randn(8, 4)).sum().backward()
    remove_observer(model)
    return directory


def test_default_text_has_one_row_per_module_type_and_signal(deep: Path) -> None:
    assert 2 * PAIRS + 1 > OVERVIEW_TENSORS
    result = cli("show", deep)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert len(lines) <= 20 + len(DEFAULT_METRICS) * 8  # 4 rows per metric, not 71
    history = pl.read_parquet(deep / "history.parquet")
    last = history["sample_id"].max()
    key = ["layer", "call_index", "signal", "tensor_path", "metric"]
    latest = (
        history.sort("sample_id")
        .group_by(key)
        .agg(pl.col("module_type").last(), pl.col("value").last(), pl.col("sample_id").last())
    )
    for metric in DEFAULT_METRICS:
        start = lines.index(f"{metric}:")
        rows = grouped_rows(lines, start)
        assert len(rows) == 4
        table = {tuple(row[:2]): row[2:] for row in rows}
        assert set(table) == {
            ("Linear", "out"),
            ("Linear", "grad"),
            ("Tanh", "out"),
            ("Tanh", "grad"),
        }
        for module_type in ("Linear", "Tanh"):
            for signal, short in (("output", "out"), ("output_gradient", "grad")):
                rows = latest.filter(
                    pl.col("metric") == metric,
                    pl.col("module_type") == module_type,
                    pl.col("signal") == signal,
                )
                values = [v for v in rows["value"].to_list() if v is not None]
                stopped = rows.filter(pl.col("sample_id") < last).height
                want = [
                    str(rows.height),
                    str(rows["value"].null_count()),
                    str(stopped),
                    number(min(values)),
                    number(statistics.median(values)),
                    number(max(values)),
                ]
                assert table[module_type, short] == want, (metric, module_type, signal)
    # `late` ran in samples 0 and 1 only: its output and gradient series stopped
    std = grouped_rows(lines, lines.index("std:"))
    assert [row[4] for row in std] == ["1", "1", "0", "0"]


def test_all_and_csv_give_every_tensor(deep: Path) -> None:
    result = cli("show", deep, "--all", "--metrics", "std")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("std:")
    names = [line.split()[0] for line in lines[start + 3 : start + 3 + 2 * PAIRS + 1]]
    assert names == [f"body.{i}" for i in range(2 * PAIRS)] + ["late"]
    assert len(cli("show", deep, "--all").stdout.splitlines()) > len(DEFAULT_METRICS) * 71
    csv = cli("show", deep, "--format", "csv")
    assert csv.returncode == 0, csv.stderr
    frame = pl.read_csv(csv.stdout.encode())
    assert frame.height == (2 * PAIRS + 1) * 2 * len(DEFAULT_METRICS)


def test_eval_samples_are_rows_of_their_own(tmp_path: Path) -> None:
    """Two train steps, then an eval forward: the grouped view's train rows hold the train
    samples' latest values only, and the eval samples have their own `[eval]` rows."""
    directory = tmp_path / "stats"
    model = Deep()
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
    model.eval()
    with torch.no_grad():
        model(torch.randn(8, 4) * 3)
    remove_observer(model)
    result = cli("show", directory, "--metrics", "mean")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("mean:")
    table = {}
    rows = grouped_rows(lines, start)
    assert len(rows) == 6
    for words in rows:
        eval_row = words[2] == "[eval]"
        table[words[0], words[1] + (" [eval]" if eval_row else "")] = words[3 if eval_row else 2 :]
    history = pl.read_parquet(directory / "history.parquet")
    for module_type in ("Linear", "Tanh"):
        for mode, short in (("train", "out"), ("eval", "out [eval]")):
            rows = (
                history.filter(
                    pl.col("metric") == "mean",
                    pl.col("module_type") == module_type,
                    pl.col("signal") == "output",
                    pl.col("mode") == mode,
                )
                .sort("sample_id")
                .group_by("layer")
                .agg(pl.col("value").last(), pl.col("sample_id").last())
            )
            last = rows["sample_id"].max()
            values = rows["value"].to_list()
            want = [
                str(rows.height),
                "0",
                str(rows.filter(pl.col("sample_id") < last).height),
                number(min(values)),
                number(statistics.median(values)),
                number(max(values)),
            ]
            assert table[module_type, short] == want, (module_type, mode)
    assert {key for key in table if "grad" in key[1]} == {("Linear", "grad"), ("Tanh", "grad")}
