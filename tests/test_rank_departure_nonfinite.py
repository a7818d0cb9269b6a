"""`compare PARENT` departs on NaN and infinite values as the two-run `compare` differs on them:
two equal values (two NaN, two infinities of one sign) are no distance apart, a NaN or an
infinity and any other value are infinitely far apart, so a rank whose value turned NaN where the
others hold numbers departs. The library writes null (with a reason) where a statistic is not
finite, so such values come from hand-edited or concatenated histories only: here every rank
is written by a real observer (the launcher's RANK and WORLD_SIZE) on the same data, and a few
of its values are edited afterwards. The parent's index.md departure query gives the same first
departures (values, nonfinite ones and nulls alike), run as printed."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from test_rank_parent_queries import csv, run_blocks
from test_rank_parent_readers import history
from torch import nn

from conftest import cli_in_process

SERIES = ["layer", "call_index", "signal", "tensor_path", "mode", "metric"]
NAN, INF = float("nan"), float("inf")

# (rank, layer, signal, metric, sample_id) -> the value written over the measured one
Edits = dict[tuple[int, str, str, str, int], float]


def observe(parent: Path, rank: int, world_size: int, *, empty_last: bool = False) -> None:
    """Rank `rank` of `world_size` observes one MLP on the same batches as every other rank (one
    seed), for four training forwards, the last on an empty batch with `empty_last` (nulls)."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", str(rank))
        env.setenv("WORLD_SIZE", str(world_size))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inject_observer(
            model, output_dir=parent, sampler=EveryNForwardsSampler(1), rank_policy="all"
        )
    for i in range(4):
        batch = torch.randn(0 if empty_last and i == 3 else 5, 4)
        model(batch).sum().backward()
    remove_observer(model)


def make_parent(directory: Path, world_size: int, edits: Edits, empty_last: int = -1) -> Path:
    """A parent of `world_size` ranks measured alike, then with `edits` written into the ranks'
    history.parquet (and rank `empty_last`'s last forward on an empty batch)."""
    parent = directory / "stats"
    for rank in range(world_size):
        if rank == empty_last:
            with pytest.warns(RuntimeWarning):  # empty tensors are said loudly
                observe(parent, rank, world_size, empty_last=True)
        else:
            observe(parent, rank, world_size)
    for rank in range(world_size):
        path = parent / f"rank-{rank:03d}" / "history.parquet"
        rows = pl.read_parquet(path)
        for (r, layer, signal, metric, sample), value in edits.items():
            if r != rank:
                continue
            at = (
                (pl.col("layer") == layer)
                & (pl.col("signal") == signal)
                & (pl.col("metric") == metric)
                & (pl.col("sample_id") == sample)
            )
            assert rows.filter(at).height == 1
            rows = rows.with_columns(value=pl.when(at).then(value).otherwise("value"))
        rows.write_parquet(path)
    return parent


def gap(a: float, b: float) -> float:
    """How far apart two values are: 0 when equal (NaN and NaN too), else |a - b|, where a NaN
    or an infinity is infinitely far from any other value."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else INF


def walk(parent: Path, ranks: int, tolerance: float) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Per series, from the ranks' histories alone: the first sample at which a rank's nearest
    other value is farther than `tolerance`, or the ranks' rows differ in what they hold (a
    value, or a null's reason), and the ranks departing there."""
    held: dict[tuple[Any, ...], dict[int, dict[int, Any]]] = {}
    for rank in range(ranks):
        for r in (
            history(parent, rank).filter(pl.col("metric") != "interrupted").iter_rows(named=True)
        ):
            kind = r["value"] if r["value"] is not None else f"null: {r['unavailable_reason']}"
            series = tuple(r[k] for k in SERIES)
            held.setdefault(series, {}).setdefault(r["sample_id"], {})[rank] = kind
    found = {}
    for series, samples in held.items():
        found[series] = (None, [])
        for sample in sorted(samples):
            at = samples[sample]
            kinds = {rank: "value" if isinstance(k, float) else k for rank, k in at.items()}
            counts = {k: list(kinds.values()).count(k) for k in set(kinds.values())}
            most = max(counts.values())
            tops = [k for k, n in counts.items() if n == most]
            departing = set()
            if len(counts) > 1:
                departing |= {r for r, k in kinds.items() if len(tops) > 1 or k != tops[0]}
            values = {r: v for r, v in at.items() if isinstance(v, float)}
            for rank, value in values.items():
                others = [gap(value, v) for r, v in values.items() if r != rank]
                if others and min(others) > tolerance:
                    departing.add(rank)
            if departing:
                found[series] = (sample, sorted(departing))
                break
    return found


def parent_departures(parent: Path, *args: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    done = cli_in_process("compare", parent, "--format", "json", *args)
    assert done.returncode == 0, done.stderr
    return {tuple(r[k] for k in SERIES): r for r in json.loads(done.stdout)["rows"]}


def two_run_differences(a: Path, b: Path, *args: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    done = cli_in_process("compare", a, b, "--format", "json", *args)
    assert done.returncode == 0, done.stderr
    return {tuple(r[k] for k in SERIES): r for r in json.loads(done.stdout)["rows"]}


def key(layer: str, signal: str, metric: str) -> tuple[Any, ...]:
    return (layer, 0, signal, "", "train", metric)


TWO_RANKS: Edits = {
    (1, "0", "output", "mean", 1): NAN,  # a NaN against a number: a departure
    (0, "0", "output", "max", 2): INF,  # +inf on both ranks: equal, none
    (1, "0", "output", "max", 2): INF,
    (1, "2", "output", "min", 2): -INF,  # -inf against a number: a departure
    (0, "2", "output", "std", 1): NAN,  # NaN on both ranks: equal, none
    (1, "2", "output", "std", 1): NAN,
    (0, "0", "output_gradient", "p50", 3): INF,  # +inf against -inf: a departure
    (1, "0", "output_gradient", "p50", 3): -INF,
}


@pytest.mark.parametrize("tolerance", ["0", "1e300"])
def test_two_ranks_depart_where_the_two_run_compare_of_the_same_ranks_differs_nonfinite_values_too(
    tmp_path: Path, tolerance: str
) -> None:
    parent = make_parent(tmp_path, 2, TWO_RANKS)
    ranks = parent_departures(parent, "--tolerance", tolerance)
    runs = two_run_differences(parent / "rank-000", parent / "rank-001", "--tolerance", tolerance)
    assert set(ranks) == set(runs)
    for series, r in ranks.items():
        assert r["first_departure"] == runs[series]["first_difference"], series
        assert r["matched_samples"] == runs[series]["matched_samples"], series
    departed = {
        s: r["first_departure"] for s, r in ranks.items() if r["first_departure"] is not None
    }
    expected = {
        key("0", "output", "mean"): 1,
        key("2", "output", "min"): 2,
        key("0", "output_gradient", "p50"): 3,
    }
    assert departed == expected  # the ranks measured alike: no finite value departs
    for series in expected:
        assert ranks[series]["departing_ranks"] == [0, 1]
        assert math.isinf(_by(parent, series, tolerance))


def _by(parent: Path, series: tuple[Any, ...], tolerance: str) -> float:
    """The `by` (nearest other rank's distance) of a series, read from the CSV (which, unlike
    JSON, holds an infinity)."""
    done = cli_in_process("compare", parent, "--tolerance", tolerance, "--format", "csv")
    frame = pl.read_csv(done.stdout.encode(), schema_overrides={"layer": pl.String})
    frame = frame.with_columns(pl.col("tensor_path").fill_null(""))
    row = frame.filter(*(pl.col(k) == v for k, v in zip(SERIES, series, strict=True)))
    assert row.height == 1
    return float(row["nearest_other"][0])


THREE_RANKS: Edits = {
    (1, "0", "output", "mean", 1): NAN,  # one rank's NaN: that rank departs
    (0, "2", "output", "max", 2): INF,  # two ranks' +inf against one number: the number's rank
    (2, "2", "output", "max", 2): INF,
    (2, "0", "output_gradient", "std", 0): -INF,  # one rank's -inf: that rank departs
}


def test_of_three_ranks_the_one_whose_value_turned_nonfinite_departs_alone(
    tmp_path: Path,
) -> None:
    parent = make_parent(tmp_path, 3, THREE_RANKS, empty_last=2)
    expected = walk(parent, 3, 0.0)
    ranks = parent_departures(parent)
    assert set(ranks) == set(expected)
    for series, r in ranks.items():
        assert (r["first_departure"], r["departing_ranks"] or []) == expected[series], series
    assert expected[key("0", "output", "mean")] == (1, [1])
    assert expected[key("2", "output", "max")] == (2, [1])
    assert expected[key("0", "output_gradient", "std")] == (0, [2])
    assert expected[key("0", "output", "p25")] == (3, [2])  # rank 2's empty batch: a null


@pytest.mark.parametrize("tolerance", ["0.0", "1e300"])
def test_the_parent_departure_query_departs_on_nonfinite_values_and_nulls_as_compare_parent(
    tmp_path: Path, tolerance: str
) -> None:
    parent = make_parent(tmp_path, 3, THREE_RANKS, empty_last=2)
    departed = _query_departures(parent, tolerance, ["mean", "max", "std", "p25"])
    ranks = parent_departures(parent, "--tolerance", tolerance, "--metrics", "mean,max,std,p25")
    expected = {
        s: (r["first_departure"], r["departing_ranks"])
        for s, r in ranks.items()
        if r["first_departure"] is not None
    }
    assert set(departed) == set(expected)
    for series, (sample, rank) in departed.items():
        assert sample == expected[series][0], series
        assert rank in expected[series][1], series
    assert key("0", "output", "mean") in departed  # a NaN
    assert key("0", "output", "p25") in departed  # a null against values


def _query_departures(
    parent: Path, tolerance: str, metrics: Sequence[str]
) -> dict[tuple[Any, ...], tuple[int, int]]:
    """The index.md departure query's first sample and rank per series, metric by metric."""
    found = {}
    for metric in metrics:
        edit = {"X = 0.0 ": f"X = {tolerance} ", 'METRIC = "mean" ': f'METRIC = "{metric}" '}
        outputs = run_blocks(parent / "index.md", edit)
        rows = csv(outputs[4])
        for r in rows.iter_rows(named=True):
            found[tuple(r[k] for k in SERIES)] = (r["first_sample"], r["rank"])
    return found
