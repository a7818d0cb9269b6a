"""`show` and `compare` read a history in ranges of whole samples and fold each range per series
before reading the next (`cli.chunked`), so a 5.4 M-row history is never held whole.

Runs are real (a small model trained here, every step sampled, with a branch that stops: series
whose windows are not the run's latest samples). Expected values are computed
here from the Parquet file with Polars and Python (write order from the file's row order), not
through the reader; the range reads are checked with ranges of one sample each, and the reads
themselves by recording every frame a collect returns.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.cli import chunked, compare
from torchinstruments.cli.selection import Selection, summary
from torchinstruments.rundir.windows import SERIES_KEY

STEPS = 8
STOP_AFTER = 3  # the side branch runs in the first STOP_AFTER steps only
WINDOW = 3


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.side = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        if self.calls < STOP_AFTER:
            h = h + self.side(h)
        self.calls += 1
        return self.head(h)


def train(directory: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = Branchy()
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(window=WINDOW),
    )
    x = torch.randn(3, 4)
    for _ in range(STEPS):
        model(x).square().mean().backward()
    remove_observer(model)
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("chunked")
    return train(base / "a", 0), train(base / "b", 1)


def history(directory: Path) -> pl.DataFrame:
    """The run's rows in write order (the file's row order), with that order as a column."""
    return pl.read_parquet(directory / "history.parquet").with_row_index("order")


def rows_per_sample(*directories: Path) -> int:
    counts = pl.concat([history(d).group_by("sample_id").len() for d in directories])
    return int(counts.select(pl.col("len").max()).item())


def expected_summary(directory: Path) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Per series: its last row in (sample_id, write order), its row count, and its recent
    window (its latest WINDOW distinct samples: how many, non-null values, mean of the finite
    ones summed exactly), computed row by row in Python."""
    rows = history(directory).sort("sample_id", "order").iter_rows(named=True)
    by_series: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        by_series.setdefault(tuple(r[k] for k in SERIES_KEY), []).append(r)
    out = {}
    for key, series in by_series.items():
        last = series[-1]
        samples = sorted({r["sample_id"] for r in series}, reverse=True)[:WINDOW]
        window = [r for r in series if r["sample_id"] in samples]
        finite = [
            r["value"] for r in window if r["value"] is not None and math.isfinite(r["value"])
        ]
        out[key] = {
            "module_type": last["module_type"],
            "latest_value": last["value"],
            "latest_reason": last["unavailable_reason"],
            "latest_sample_id": last["sample_id"],
            "observations": len(series),
            "window_samples": len(samples),
            "window_valid": sum(r["value"] is not None for r in window),
            "window_mean": math.fsum(finite) / len(finite) if finite else None,
            "window_first_sample_id": min(samples),
            "window_last_sample_id": max(samples),
        }
    return out


def test_the_runs_hold_what_the_range_reads_must_get_right(runs: tuple[Path, Path]) -> None:
    """The fixture's runs hold series that stop, and more samples than a range holds."""
    rows = history(runs[0])
    assert rows.filter(pl.col("layer") == "side")["sample_id"].max() == STOP_AFTER - 1
    assert rows["sample_id"].n_unique() == STEPS


def test_show_summary_read_one_sample_at_a_time_is_the_whole_history_summary(
    runs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Latest row, row counts and recent windows of every series, a stopped one too, as
    computed from every row at once."""
    monkeypatch.setattr(chunked, "CHUNK_ROWS", rows_per_sample(runs[0]))
    _, frame = summary(runs[0], Selection(window=WINDOW))
    expected = expected_summary(runs[0])
    got = {tuple(r[k] for k in SERIES_KEY): r for r in frame.iter_rows(named=True)}
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert {k: got[key][k] for k in want} == want, key


def test_compare_read_in_ranges_is_the_comparison_read_whole(
    runs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranges of one sample and one range of the whole history give the same table: matched
    samples add up, the first difference is the earliest range's."""
    whole = compare.compare(*runs, Selection(), tolerance=1e-3).frame
    monkeypatch.setattr(chunked, "CHUNK_ROWS", 1)
    ranged = compare.compare(*runs, Selection(), tolerance=1e-3).frame
    assert ranged.equals(whole)
    side = whole.filter(pl.col("layer") == "side")
    assert set(side["matched_samples"].to_list()) == {STOP_AFTER}
    assert whole.filter(pl.col("first_difference").is_not_null()).height > 0


@pytest.fixture
def collected(monkeypatch: pytest.MonkeyPatch) -> list[pl.DataFrame]:
    """Every frame any LazyFrame.collect returns meanwhile."""
    frames: list[pl.DataFrame] = []
    collect = pl.LazyFrame.collect

    def recorded(self: pl.LazyFrame, *args: Any, **kwargs: Any) -> Any:
        frame = collect(self, *args, **kwargs)
        frames.append(frame)
        return frame

    monkeypatch.setattr(pl.LazyFrame, "collect", recorded)
    return frames


def test_show_and_compare_never_collect_more_than_one_range_of_rows(
    runs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, collected: list[pl.DataFrame]
) -> None:
    """With ranges of about one sample's rows (a range holds whole samples: under two samples'
    rows), no collect returns more rows than that, nor a column the summaries do not use: the
    history is never materialized whole."""
    per_sample = rows_per_sample(*runs)
    monkeypatch.setattr(chunked, "CHUNK_ROWS", per_sample)
    summary(runs[0], Selection(window=WINDOW))
    compare.compare(*runs, Selection(), tolerance=1e-3)
    assert history(runs[0]).height > 4 * per_sample
    assert collected
    assert max(f.height for f in collected) < 2 * per_sample
    unused = {"timestamp", "shape", "dtype", "placement", "mesh_coordinate", "grad_enabled"}
    assert not [f.columns for f in collected if unused & set(f.columns)]
