"""The ready queries of a parent's index.md and of a rank's "Ranks" query, run as printed on ranks
with train and eval samples (real observers, the launcher's RANK and WORLD_SIZE): every query
answers per mode, and the departure query agrees with `compare PARENT`."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import polars as pl
import pytest
from test_rank_parent_readers import history, observe_rank

from conftest import cli_in_process

SERIES = ["layer", "call_index", "signal", "tensor_path", "mode", "metric"]


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("modes") / "stats"
    for rank in (0, 1):
        observe_rank(directory, rank, forwards=4, eval_forwards=True)
    return directory


def run_blocks(page: Path, edit: dict[str, str] | None = None) -> list[str]:
    """Every python block of the page, in one namespace, as printed (or with `edit`'s lines
    replaced, as a user sets a marked value); each block's output."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    scope: dict[str, object] = {}
    outputs = []
    for block in blocks:
        for old, new in (edit or {}).items():
            block = block.replace(old, new)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(page), "exec"), scope)
        outputs.append(out.getvalue())
    return outputs


def csv(text: str) -> pl.DataFrame:
    """A query's CSV (after any `N rows, the first M:` line), names read as strings."""
    lines = [line for line in text.splitlines() if " rows, the first " not in line]
    lines = [line for line in lines if " series of " not in line]
    frame = pl.read_csv(
        io.StringIO("\n".join(lines)),
        schema_overrides={"layer": pl.String, "tensor_path": pl.String},
    )
    return frame.with_columns(pl.col("tensor_path").fill_null(""))


def both(parent: Path) -> pl.DataFrame:
    return pl.concat([history(parent, rank) for rank in (0, 1)])


def test_the_parent_queries_keep_train_and_eval_series_apart(parent: Path) -> None:
    rows = both(parent)
    assert set(rows["mode"]) == {"train", "eval"}
    outputs = run_blocks(parent / "index.md")
    latest = csv(outputs[2].replace(",0,1\n", ",rank_0,rank_1\n", 1))
    assert "mode" in latest.columns
    expected = (
        rows.filter(pl.col("metric") == "mean")
        .sort("sample_id")
        .group_by("rank", *SERIES, maintain_order=True)
        .agg(pl.col("value").last())
    )
    for rank in (0, 1):
        mine = expected.filter(pl.col("rank") == rank)
        got = latest.join(mine, on=SERIES)
        assert got.height == mine.height == latest.height
        assert (got[f"rank_{rank}"] == got["value"]).all()
    spread = csv(outputs[3])
    assert "mode" in spread.columns
    layer = spread["layer"][0]
    reference = (
        rows.filter(pl.col("layer") == layer, pl.col("value").is_finite())
        .group_by(*SERIES, "sample_id")
        .agg(ranks=pl.len(), min=pl.col("value").min(), max=pl.col("value").max())
    )
    got = spread.join(reference, on=[*SERIES, "sample_id"], suffix="_history")
    assert got.height == spread.height
    assert (got["ranks"] == got["ranks_history"]).all()
    assert (got["min"] == got["min_history"]).all()
    assert (got["max"] == got["max_history"]).all()


@pytest.mark.parametrize("x", ["0.0", "0.05"])
def test_the_parent_departure_query_agrees_with_compare_parent_per_mode(
    parent: Path, x: str
) -> None:
    outputs = run_blocks(parent / "index.md", {"X = 0.0 ": f"X = {x} "})
    found = csv(outputs[4])
    done = cli_in_process(
        "compare", parent, "--tolerance", x, "--metrics", "mean", "--format", "json"
    )
    assert done.returncode == 0, done.stderr
    departed = [r for r in json.loads(done.stdout)["rows"] if r["first_departure"] is not None]
    assert {r["mode"] for r in departed} == {"train", "eval"}
    assert found.height == len(departed)
    for r in departed:
        row = found.filter(*(pl.col(k) == r[k] for k in SERIES))
        assert row.height == 1, r
        assert row["first_sample"][0] == r["first_departure"]
        assert row["rank"][0] in r["departing_ranks"]


def test_a_ranks_ranks_query_gives_each_ranks_mean_of_every_series(parent: Path) -> None:
    page = parent / "rank-000" / "index.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    scope: dict[str, object] = {}
    for block in (blocks[0], next(b for b in blocks if "rank-*" in b)):
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, str(page), "exec"), scope)
    by_rank = scope["by_rank"]
    assert isinstance(by_rank, pl.DataFrame)
    expected = both(parent).group_by("rank", *SERIES).agg(pl.col("value").mean())
    got = by_rank.join(expected, on=["rank", *SERIES], suffix="_history")
    assert got.height == by_rank.height == expected.height
    assert got["value"].to_list() == pytest.approx(got["value_history"].to_list(), rel=1e-12)


def test_the_parent_queries_keep_reading_after_a_live_rank_finishes(tmp_path: Path) -> None:
    """The setup reads a live rank's parts as they are; when that rank's removal then merges
    them (and takes them away), the later blocks still run, on the rows read at setup."""
    from torchinstruments import remove_observer

    parent = tmp_path / "stats"
    observe_rank(parent, 0)  # finished: writes the parent's index.md
    live = observe_rank(parent, 1, remove=False)
    blocks = re.findall(
        r"```python\n(.*?)```", (parent / "index.md").read_text(encoding="utf-8"), re.DOTALL
    )
    scope: dict[str, object] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(blocks[0], "setup", "exec"), scope)
    parts = sorted((parent / "rank-001" / "history.parts").glob("part-*.parquet"))
    at_setup = pl.read_parquet(parts).height
    assert at_setup > 0
    remove_observer(live)
    assert not (parent / "rank-001" / "history.parts").exists()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[1], "per rank", "exec"), scope)
    rows = dict(pl.read_csv(io.StringIO(out.getvalue())).select("rank", "rows").iter_rows())
    assert rows == {0: history(parent, 0).height, 1: at_setup}
