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
    samples add up, the first difference is the earliest range's (on forward_index too)."""
    whole = compare.compare(*runs, Selection(), tolerance=1e-3).frame
    by_forward = compare.compare(*runs, Selection(), tolerance=1e-3, x="forward_index").frame
    monkeypatch.setattr(chunked, "CHUNK_ROWS", 1)
    ranged = compare.compare(*runs, Selection(), tolerance=1e-3).frame
    assert ranged.equals(whole)
    ranged = compare.compare(*runs, Selection(), tolerance=1e-3, x="forward_index").frame
    assert ranged.equals(by_forward)
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


SCALED_FROM = 4  # from this step on, run B's second call of the shared layer differs from A's


class Shared(nn.Module):
    """One Linear called twice per forward; from `scaled_from` on its second call's input is
    doubled (the first call, and everything before `scaled_from`, as in every run)."""

    def __init__(self, scaled_from: int | None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scaled_from = scaled_from
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        late = self.scaled_from is not None and self.calls >= self.scaled_from
        self.calls += 1
        return self.lin(torch.tanh(self.lin(x)) * (2.0 if late else 1.0))


def train_twice(directory: Path, scaled_from: int | None) -> Path:
    """Every step sampled; the shared Linear's two calls then written under one call_index (as
    a history whose writer did not tell calls apart holds them): each of its series has two
    rows in every sample, the same key, in write order."""
    torch.manual_seed(0)
    model = Shared(scaled_from)
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
    path = directory / "history.parquet"
    rows = pl.read_parquet(path)
    assert set(rows.filter(pl.col("layer") == "lin")["call_index"]) == {0, 1}
    rows.with_columns(pl.lit(0, pl.Int32).alias("call_index")).write_parquet(path)
    return directory


@pytest.fixture(scope="module")
def twice(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("twice")
    return train_twice(base / "a", None), train_twice(base / "b", SCALED_FROM)


def occurrences(directory: Path) -> dict[tuple[Any, ...], dict[tuple[int, int], float | None]]:
    """Per series: its value at each (sample_id, occurrence), occurrences numbered in write
    order within the sample, row by row in Python."""
    out: dict[tuple[Any, ...], dict[tuple[int, int], float | None]] = {}
    seen: dict[tuple[Any, ...], int] = {}
    for r in history(directory).sort("sample_id", "order").iter_rows(named=True):
        key = tuple(r[k] for k in SERIES_KEY)
        n = seen.get((key, r["sample_id"]), 0)
        seen[(key, r["sample_id"])] = n + 1
        out.setdefault(key, {})[(r["sample_id"], n)] = r["value"]
    return out


def expected_comparison(a: Path, b: Path) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Per series: matched samples, first differing sample, and A's and B's values at its first
    differing occurrence there (tolerance 0; occurrence k of A against occurrence k of B)."""
    values_a, values_b = occurrences(a), occurrences(b)
    common = set(history(a)["sample_id"]) & set(history(b)["sample_id"])
    out = {}
    for key in values_a.keys() | values_b.keys():
        mine, theirs = values_a.get(key, {}), values_b.get(key, {})
        cells = sorted(c for c in mine.keys() | theirs.keys() if c[0] in common)
        matched = len({c[0] for c in cells if c in mine and c in theirs})
        differ = [
            c
            for c in cells
            if c not in mine
            or c not in theirs
            or (mine[c] is None) != (theirs[c] is None)
            or (mine[c] is not None and theirs[c] is not None and theirs[c] != mine[c])
        ]
        first = differ[0] if differ else None
        out[key] = (
            matched,
            None if first is None else first[0],
            None if first is None else mine.get(first),
            None if first is None else theirs.get(first),
        )
    return out


def test_the_twice_runs_hold_two_rows_of_each_series_per_sample(
    twice: tuple[Path, Path],
) -> None:
    for run in twice:
        rows = history(run).group_by(*SERIES_KEY, "sample_id").len()
        assert set(rows["len"]) == {2}
        assert rows["sample_id"].n_unique() == STEPS


@pytest.mark.parametrize("chunk_rows", [1, None])
def test_a_series_measured_twice_per_sample_is_summarized_and_compared_occurrence_by_occurrence(
    twice: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, chunk_rows: int | None
) -> None:
    """show: both rows count, the latest is the sample's second; compare: occurrence k of A
    against occurrence k of B, so B's second call's output differs from SCALED_FROM on, and
    its first call's never does. Read in ranges of one sample (1) and of the default size."""
    if chunk_rows is not None:
        monkeypatch.setattr(chunked, "CHUNK_ROWS", chunk_rows)
    _, frame = summary(twice[0], Selection(window=WINDOW))
    expected = expected_summary(twice[0])
    got = {tuple(r[k] for k in SERIES_KEY): r for r in frame.iter_rows(named=True)}
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert {k: got[key][k] for k in want} == want, key

    compared = compare.compare(*twice, Selection(), tolerance=0.0).frame
    columns = (
        "matched_samples",
        "first_difference",
        "value_a_at_first_difference",
        "value_b_at_first_difference",
    )
    got_cmp = {
        tuple(r[k] for k in SERIES_KEY): tuple(r[c] for c in columns)
        for r in compared.iter_rows(named=True)
    }
    want_cmp = expected_comparison(*twice)
    assert got_cmp == want_cmp
    outputs = {v[1:] for k, v in want_cmp.items() if k[2] == "output" and k[5] == "mean"}
    (at_first,) = outputs  # the second call's output, never the first's (equal in A and B)
    assert at_first[0] == SCALED_FROM
    second_a = values_at(twice[0], SCALED_FROM, 1)
    second_b = values_at(twice[1], SCALED_FROM, 1)
    assert at_first[1:] == (second_a, second_b) != (values_at(twice[0], SCALED_FROM, 0),) * 2


def values_at(run: Path, sample_id: int, occurrence: int) -> float:
    """The mean of the shared layer's output at `sample_id`, the occurrence-th in write order."""
    rows = history(run).filter(
        pl.col("signal") == "output", pl.col("metric") == "mean", pl.col("sample_id") == sample_id
    )
    return rows.sort("order")["value"][occurrence]


def test_a_range_out_of_sample_order_still_takes_its_latest_sample(
    runs: tuple[Path, Path],
) -> None:
    """A concatenated history may hold a later sample before an earlier one in a range: the
    range is sorted before its latest row is taken (a range in order is taken as it is)."""
    rows = history(runs[0]).filter(pl.col("metric") != "interrupted")
    backwards = rows.sort("sample_id", descending=True, maintain_order=True)
    whole = chunked.summarize_series(rows.lazy(), lambda lf: lf, WINDOW)
    reversed_ = chunked.summarize_series(backwards.lazy(), lambda lf: lf, WINDOW)
    assert reversed_.equals(whole)
    last = rows.group_by(SERIES_KEY).agg(pl.col("sample_id").max(), pl.len())
    got = whole.select(*SERIES_KEY, "latest_sample_id", "observations")
    expected = last.rename({"sample_id": "latest_sample_id", "len": "observations"})
    joined = got.join(expected, on=SERIES_KEY, nulls_equal=True, suffix="_expected")
    assert joined.height == whole.height == expected.height
    assert (joined["latest_sample_id"] == joined["latest_sample_id_expected"]).all()
    assert (joined["observations"] == joined["observations_expected"]).all()
