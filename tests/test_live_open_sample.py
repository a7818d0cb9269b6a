"""A live run's latest sample is still open: its output rows can be on disk while its
backward has not ended (or its gradient rows not yet reached a part). `compare` and
`compare PARENT` do not call the gradient rows it lacks there a difference, and say so; the
rows it has there are compared as any others, and once the backward is written the sample is
an ordinary one. Every run is written by a real observer; expected values come from the
history files with Polars."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from test_comparison_query_agreement import query_firsts
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.layout import list_parts

from conftest import cli_in_process, wait_for_rows

LAYERS = 3
ROWS = LAYERS * len(DEFAULT_METRICS)  # one sample's rows of one signal
SERIES = ["layer", "call_index", "signal", "tensor_path", "mode", "metric"]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def batches(changed_last: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(1)
    found = [torch.randn(5, 4) for _ in range(3)]
    return [*found[:2], found[2] * 2] if changed_last else found


def finished(directory: Path, **observe: Any) -> Path:
    """Three samples, each with its backward, then removed."""
    m = model()
    with pytest.MonkeyPatch.context() as env:
        for name, value in observe.items():
            env.setenv(name, str(value))
        inject_observer(
            m,
            output_dir=directory,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all" if observe else "rank0",
        )
    for x in batches():
        m(x).sum().backward()
    remove_observer(m)
    return directory


def live(
    directory: Path, changed_last: bool = False, **observe: Any
) -> tuple[nn.Module, torch.Tensor]:
    """Two samples with their backward, then a third forward whose backward has not run, every
    row on disk (a part per sample and signal); returns the model and the loss still to
    backpropagate."""
    m = model()
    with pytest.MonkeyPatch.context() as env:
        for name, value in observe.items():
            env.setenv(name, str(value))
        inject_observer(
            m,
            output_dir=directory,
            sampler=EveryNForwardsSampler(1),
            history_config=HistoryConfig(buffer_rows=ROWS),
            rank_policy="all" if observe else "rank0",
        )
    xs = batches(changed_last)
    for x in xs[:2]:
        m(x).sum().backward()
    loss = m(xs[2]).sum()
    own = directory / f"rank-{observe['RANK']:03d}" if observe else directory
    wait_for_rows(own, 5 * ROWS)
    return m, loss


def parts(directory: Path) -> pl.DataFrame:
    return pl.read_parquet(list_parts(directory), glob=False)


def json_rows(*args: str | Path) -> tuple[dict[tuple[Any, ...], dict[str, Any]], Any]:
    done = cli_in_process(*args, "--format", "json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    return {tuple(r[k] for k in SERIES): r for r in found["rows"]}, found["run"]


def text(*args: str | Path) -> str:
    done = cli_in_process(*args, "--width", "200")
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def csv_said(*args: str | Path) -> str:
    """What `--format csv` says on stderr beside its rows (one line each, as printed)."""
    done = cli_in_process(*args, "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert "still open" not in done.stdout  # the rows alone: a note is no csv row
    return done.stderr


def query_departures(parent: Path) -> dict[tuple[Any, ...], int]:
    """The parent index.md's departure query (metric mean, as printed): first sample per series."""
    from test_rank_parent_queries import csv, run_blocks

    found = csv(run_blocks(parent / "index.md")[4])
    return dict(zip(found.select(SERIES).rows(), found["first_sample"], strict=True))


def open_gradients(finished_rows: pl.DataFrame, live_rows: pl.DataFrame) -> pl.DataFrame:
    """The gradient rows the finished run has at sample 2 and the live run has not."""
    at = [*SERIES, "sample_id"]
    return finished_rows.filter(
        pl.col("sample_id") == 2, pl.col("signal") == "output_gradient"
    ).join(live_rows, on=at, how="anti")


def test_compare_does_not_call_the_gradients_a_live_runs_open_sample_lacks_a_difference(
    tmp_path: Path,
) -> None:
    a = finished(tmp_path / "a")
    b, loss = live(tmp_path / "b")
    history_a, rows_b = pl.read_parquet(a / "history.parquet"), parts(tmp_path / "b")
    assert rows_b["sample_id"].max() == 2
    lacked = open_gradients(history_a, rows_b)
    assert lacked.height == ROWS  # the open sample: outputs on disk, no gradient yet
    # The rows both have hold the same values (same model, same batches).
    both = history_a.join(rows_b, on=[*SERIES, "sample_id"], suffix="_b")
    assert both.height == rows_b.height
    assert (both["value"] == both["value_b"]).all()

    rows, facts = json_rows("compare", a, tmp_path / "b")
    assert {s for s, r in rows.items() if r["first_difference"] is not None} == set()
    for r in lacked.iter_rows(named=True):
        series = rows[tuple(r[k] for k in SERIES)]
        assert series["matched_samples"] == 2
        assert series["last_b"] == 1
    assert facts["open_samples"] == {"b": 2}
    assert query_firsts(a, tmp_path / "b") == {}  # A's index.md comparison query, as compare
    said = text("compare", a, tmp_path / "b", "--metrics", "mean")
    assert "series that stop or start in one run" not in said
    open_b = (
        "B is in progress: its latest sample (sample_id 2) is still open: a gradient row "
        "it lacks there is no difference"
    )
    assert open_b in said
    assert f"torchinstruments compare: {open_b}" in csv_said("compare", a, tmp_path / "b")

    loss.backward()
    remove_observer(b)
    rows, facts = json_rows("compare", a, tmp_path / "b")
    assert all(r["first_difference"] is None for r in rows.values())
    assert all(r["matched_samples"] == 3 for r in rows.values())
    assert facts["open_samples"] == {}


def test_the_rows_a_live_runs_open_sample_has_are_still_compared(tmp_path: Path) -> None:
    a = finished(tmp_path / "a")
    b, loss = live(tmp_path / "b", changed_last=True)
    history_a, rows_b = pl.read_parquet(a / "history.parquet"), parts(tmp_path / "b")
    joined = history_a.join(rows_b, on=[*SERIES, "sample_id"], suffix="_b")
    differ = joined.filter(pl.col("value") != pl.col("value_b"))
    expected = differ.group_by(SERIES).agg(pl.col("sample_id").min())
    assert set(expected["signal"]) == {"output"}
    assert set(expected["sample_id"]) == {2}
    rows, _ = json_rows("compare", a, tmp_path / "b")
    found = {s: r["first_difference"] for s, r in rows.items() if r["first_difference"] is not None}
    assert found == dict(zip(expected.select(SERIES).rows(), expected["sample_id"], strict=True))
    loss.backward()
    remove_observer(b)


def test_compare_parent_does_not_depart_on_a_live_ranks_open_sample_as_compare(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stats"
    finished(parent, RANK=0, WORLD_SIZE=2)
    b, loss = live(parent, RANK=1, WORLD_SIZE=2)
    rank0 = pl.read_parquet(parent / "rank-000" / "history.parquet")
    lacked = open_gradients(rank0, parts(parent / "rank-001"))
    assert lacked.height == ROWS

    ranks, facts = json_rows("compare", parent)
    runs, _ = json_rows("compare", parent / "rank-000", parent / "rank-001")
    assert set(ranks) == set(runs)
    for series, r in ranks.items():
        assert r["first_departure"] is None, series
        assert r["first_departure"] == runs[series]["first_difference"], series
        assert r["matched_samples"] == runs[series]["matched_samples"], series
    assert facts["open_samples"] == {"1": 2}
    open_1 = (
        "rank 1 is in progress: its latest sample (sample_id 2) is still open: a gradient "
        "row it lacks there is no departure"
    )
    assert open_1 in text("compare", parent, "--metrics", "mean")
    assert f"torchinstruments compare: {open_1}" in csv_said("compare", parent)
    assert query_departures(parent) == {}  # the page's query, as compare PARENT

    loss.backward()
    remove_observer(b)
    ranks, facts = json_rows("compare", parent)
    assert all(r["first_departure"] is None for r in ranks.values())
    assert all(r["matched_samples"] == 3 for r in ranks.values())
    assert facts["open_samples"] == {}
    assert "still open" not in csv_said("compare", parent)
