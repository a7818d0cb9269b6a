"""`compare PARENT` departs where the ranks' rows differ in what they hold, as the two-run
`compare` differs (`cli.matching`): a null against a value, or nulls for different reasons.
Every rank is written by a real observer (the launcher's RANK and WORLD_SIZE), its last forward
on an empty batch (null: empty tensor), an all-NaN batch (null: no finite entries) or a plain
one, and the departures are checked against a walk over each rank's own history.parquet."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from test_rank_parent_readers import history
from torch import nn

from conftest import cli_in_process

SERIES = ["layer", "call_index", "signal", "tensor_path", "mode", "metric"]
NO_NUMBERS = "1e300"  # a tolerance no value distance reaches: only nulls can depart


def observe(parent: Path, rank: int, world_size: int, last: str) -> None:
    """Rank `rank` of `world_size` observes a small MLP for three training forwards, the last
    on a `last` batch: "plain", "empty" (no rows) or "nan" (every entry NaN)."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", str(rank))
        env.setenv("WORLD_SIZE", str(world_size))
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inject_observer(
            model, output_dir=parent, sampler=EveryNForwardsSampler(1), rank_policy="all"
        )
    for i in range(3):
        batch = torch.randn(5, 4)
        if i == 2 and last == "empty":
            batch = torch.randn(0, 4)
        if i == 2 and last == "nan":
            batch = torch.full((5, 4), float("nan"))
        model(batch).sum().backward()
    remove_observer(model)


def make_parent(directory: Path, lasts: list[str]) -> Path:
    parent = directory / "stats"
    for rank, last in enumerate(lasts):
        if last == "plain":
            observe(parent, rank, len(lasts), last)
            continue
        with pytest.warns(RuntimeWarning):  # empty and NaN tensors are said loudly
            observe(parent, rank, len(lasts), last)
    return parent


def walk(parent: Path, ranks: int) -> dict[tuple[Any, ...], tuple[int | None, list[int], int]]:
    """Per series, from the ranks' histories alone: the first sample where the ranks' rows
    differ in what they hold (a value, or a null's reason), the ranks departing there (those
    not holding the one kind most ranks hold; all where no kind has the most), and the samples
    where at least two ranks hold the same kind (matched)."""
    kinds: dict[tuple[Any, ...], dict[int, dict[int, str]]] = {}
    for rank in range(ranks):
        rows = history(parent, rank).filter(pl.col("metric") != "interrupted")
        for r in rows.iter_rows(named=True):
            kind = "value" if r["value"] is not None else f"null: {r['unavailable_reason']}"
            series = tuple(r[k] for k in SERIES)
            kinds.setdefault(series, {}).setdefault(r["sample_id"], {})[rank] = kind
    found = {}
    for series, samples in kinds.items():
        first, departing, matched = None, [], 0
        for sample in sorted(samples):
            held = samples[sample]
            counts = Counter(held.values())
            matched += any(n >= 2 for n in counts.values())
            if first is None and len(held) >= 2 and len(counts) > 1:
                most = max(counts.values())
                tops = [k for k, n in counts.items() if n == most]
                first = sample
                departing = sorted(r for r, k in held.items() if len(tops) > 1 or k != tops[0])
        found[series] = (first, departing, matched)
    return found


def departures(parent: Path, *args: str) -> pl.DataFrame:
    done = cli_in_process("compare", parent, "--tolerance", NO_NUMBERS, "--format", "json", *args)
    assert done.returncode == 0, done.stderr
    return pl.DataFrame(json.loads(done.stdout)["rows"])


def test_a_rank_whose_rows_became_null_departs_from_the_ranks_holding_values(
    tmp_path: Path,
) -> None:
    parent = make_parent(tmp_path, ["plain", "plain", "empty"])
    expected = walk(parent, 3)
    rows = departures(parent)
    assert rows.height == len(expected)
    departed = 0
    for r in rows.iter_rows(named=True):
        first, ranks, matched = expected[tuple(r[k] for k in SERIES)]
        assert (r["first_departure"], r["matched_samples"]) == (first, matched), r
        if first is not None:
            departed += 1
            assert r["departing_ranks"] == ranks == [2]
            assert r["departing_values"] == [None]
            assert r["departing_reasons"] == ["empty tensor"]
            assert r["nearest_other"] is None
    assert departed > 0  # the outputs and their gradients of the empty batch


def test_two_ranks_one_holding_a_null_both_depart_as_two_differing_values_do(
    tmp_path: Path,
) -> None:
    parent = make_parent(tmp_path, ["empty", "plain"])
    expected = walk(parent, 2)
    rows = departures(parent)
    nulls = rows.filter(pl.col("first_departure").is_not_null())
    assert nulls.height == sum(first is not None for first, _, _ in expected.values()) > 0
    for r in nulls.iter_rows(named=True):
        first, ranks, _ = expected[tuple(r[k] for k in SERIES)]
        assert r["first_departure"] == first == 2
        assert r["departing_ranks"] == ranks == [0, 1]
        assert r["departing_values"][0] is None
        assert r["departing_values"][1] is not None
        assert r["departing_reasons"] == ["empty tensor", None]
    csv = cli_in_process("compare", parent, "--tolerance", NO_NUMBERS, "--format", "csv")
    cells = pl.read_csv(csv.stdout.encode()).filter(pl.col("first_departure").is_not_null())
    assert set(cells["departing_reasons"]) == {"empty tensor;"}
    text = cli_in_process("compare", parent, "--tolerance", NO_NUMBERS, "--all").stdout
    table = text.split("-------\n", 1)[1].splitlines()
    departing = [line.split() for line in table if line.split()[3:5] == ["2", "0-1"]]
    assert len(departing) == nulls.height
    assert all(cells[5] == "null" for cells in departing)  # by: no distance, a null
    assert "a null against a value" in text


def test_nulls_for_different_reasons_depart_and_the_majoritys_kind_stays(
    tmp_path: Path,
) -> None:
    parent = make_parent(tmp_path, ["plain", "empty", "empty", "nan"])
    expected = walk(parent, 4)
    rows = departures(parent)
    kinds_seen = set()
    for r in rows.iter_rows(named=True):
        first, ranks, matched = expected[tuple(r[k] for k in SERIES)]
        assert (r["first_departure"], r["matched_samples"]) == (first, matched), r
        assert (r["departing_ranks"] or []) == ranks, r
        kinds_seen.add(tuple(ranks))
    # the outputs' means: ranks 1 and 2 hold "empty tensor", so the value of rank 0 and the
    # "no finite entries" of rank 3 depart; where rank 3 has a value (its nonfinite fraction,
    # its gradients), two values against two nulls leave no majority: every rank departs
    assert {(0, 3), (0, 1, 2, 3)} <= kinds_seen
    mean = rows.filter(
        pl.col("layer") == "0", pl.col("signal") == "output", pl.col("metric") == "mean"
    ).row(0, named=True)
    assert mean["departing_reasons"] == [None, "no finite entries"]


def test_null_departures_are_the_same_read_in_ranges_of_one_sample_or_all_at_once(
    tmp_path: Path,
) -> None:
    from torchinstruments.cli import ranks
    from torchinstruments.cli.selection import Selection

    parent = make_parent(tmp_path, ["plain", "empty", "empty", "nan"])
    selection = Selection()
    one = ranks.departures(parent, selection, tolerance=1e300, budget_rows=1).frame
    whole = ranks.departures(parent, selection, tolerance=1e300, budget_rows=10**9).frame
    assert one.to_dicts() == whole.to_dicts()
    assert one["first_departure"].drop_nulls().to_list() == [2] * one.height
