"""The ready queries of a parent's index.md run while a rank is live: a rank's continued attempt
in progress is read with its earlier attempts (its parts beside its history.parquet), and a
rank that has written no part yet is named as left out and listed with its state, never
dropped from the per-rank summary as if it did not exist; a rank the world size expects but no
directory holds is listed with counts unknown, as is a rank killed before its first part. A rank's own "Ranks" query reads the ranks the
same way, and names that missing rank too. Real observers (the launcher's RANK and WORLD_SIZE); what the queries print is
checked against the files read with Polars."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
from test_rank_parent_live_readers import ROWS_PER_PART, observe
from torch import nn

from torchinstruments import inject_observer, remove_observer
from torchinstruments.rundir.page_ranks import render_parent_index

from conftest import cli_in_process, wait_for_rows


def page_blocks(parent: Path) -> list[str]:
    return re.findall(
        r"```python\n(.*?)```", (parent / "index.md").read_text(encoding="utf-8"), re.DOTALL
    )


def setup_and_per_rank(parent: Path) -> tuple[str, pl.DataFrame]:
    """The setup block's output and the per-rank block's table, run as printed."""
    setup, per_rank = page_blocks(parent)[:2]
    scope: dict[str, object] = {}
    said, table = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(said):
        exec(compile(setup, "setup", "exec"), scope)
    with contextlib.redirect_stdout(table):
        exec(compile(per_rank, "per rank", "exec"), scope)
    return said.getvalue(), pl.read_csv(io.StringIO(table.getvalue()))


def test_the_parent_queries_read_a_continued_ranks_live_attempt_with_its_earlier_ones(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stats"
    remove_observer(observe(parent, 0, forwards=3))  # finished: writes the parent's index.md
    remove_observer(observe(parent, 1, forwards=3))
    live = observe(parent, 1, resume=True, forwards=2)  # samples 3-4, in parts while live
    try:
        rank_dir = parent / "rank-001"
        wait_for_rows(rank_dir, 2 * ROWS_PER_PART)
        # Independently: the earlier attempt in history.parquet, this one in its parts.
        earlier = pl.read_parquet(rank_dir / "history.parquet")
        parts = pl.read_parquet(sorted((rank_dir / "history.parts").glob("part-*.parquet")))
        assert earlier.height == parts.height + ROWS_PER_PART == 3 * ROWS_PER_PART
        _, per_rank = setup_and_per_rank(parent)
        assert per_rank.rows(named=True) == [
            {"rank": 0, "state": "complete", "samples": 3, "last_sample": 2, "rows": 54},
            {"rank": 1, "state": "in progress", "samples": 5, "last_sample": 4, "rows": 90},
        ]
        assert sorted(parts["sample_id"].unique()) == [3, 4]
    finally:
        remove_observer(live)


def test_the_parent_queries_name_a_rank_without_a_part_and_list_it_with_its_state(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stats"
    remove_observer(observe(parent, 0, forwards=3))
    waiting = observe(parent, 1, forwards=0)  # injected, no sample taken yet
    try:
        assert not (parent / "rank-001" / "history.parts").exists() or not list(
            (parent / "rank-001" / "history.parts").iterdir()
        )
        said, per_rank = setup_and_per_rank(parent)
        assert said == (
            "left out: rank 1 wrote no part yet (in progress before its first sample, or its "
            "process died before it); run this block again later\n"
        )
        assert per_rank.rows(named=True) == [
            {"rank": 0, "state": "complete", "samples": 3, "last_sample": 2, "rows": 54},
            {"rank": 1, "state": "in progress", "samples": 0, "last_sample": None, "rows": 0},
        ]
        # A copy is as a kill leaves it: no process holds rank 1's lock. What it took before
        # the kill is unknown, never 0 samples, on the page a rank writes now and after finalize
        killed = tmp_path / "killed"
        shutil.copytree(parent, killed)
    finally:
        remove_observer(waiting)
    (killed / "index.md").write_text(render_parent_index(killed), encoding="utf-8")
    ended = "not finished: its process ended without closing the run (killed or crashed)"
    for state in (ended, "interrupted"):
        if state == "interrupted":
            assert cli_in_process("finalize", killed).returncode == 0  # rewrites the page
        _, per_rank = setup_and_per_rank(killed)
        unknown = {"samples": None, "last_sample": None, "rows": None}
        assert per_rank.row(1, named=True) == {"rank": 1, "state": state, **unknown}
    # finalized, rank 1 is read, without a row: a picture of the ranks says it is not drawn
    drawn = cli_in_process("heatmap", killed, "--metrics", "mean", "--output-dir", tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert ", 1 rank (1 train row) x 3 samples" in drawn.stdout
    said = drawn.stderr.splitlines()
    assert "torchinstruments heatmap: rank 1: interrupted" in said
    assert (
        "torchinstruments heatmap: rank 1: not drawn, no row of tensor <root> that the selection reads"
        in said
    )


def test_a_ranks_ranks_query_reads_a_live_continued_rank_and_names_a_rank_without_a_part(
    tmp_path: Path,
) -> None:
    """The "Ranks" query of a rank's own index.md reads every rank as `history_of` does: a
    continued rank's live attempt with its earlier ones (not its history.parquet alone), and a
    rank with no part yet named as left out."""
    parent = tmp_path / "stats"
    remove_observer(observe(parent, 0, forwards=3))
    remove_observer(observe(parent, 1, forwards=3))
    live = observe(parent, 1, resume=True, forwards=2)
    waiting = nn.Linear(4, 4)
    with pytest.MonkeyPatch.context() as env:  # a third rank, injected, no sample taken yet
        env.setenv("RANK", "2")
        env.setenv("WORLD_SIZE", "3")
        inject_observer(waiting, output_dir=parent, rank_policy="all")
    try:
        wait_for_rows(parent / "rank-001", 2 * ROWS_PER_PART)
        page = parent / "rank-000" / "index.md"
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
        scope: dict[str, object] = {}
        said = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(blocks[0], str(page), "exec"), scope)
        with contextlib.redirect_stdout(said):
            exec(compile(next(b for b in blocks if "rank-*" in b), str(page), "exec"), scope)
        assert said.getvalue().splitlines()[0] == (
            "left out: rank-002 wrote no part yet (in progress before its first sample, or its "
            "process died before it)"
        )
        by_rank = scope["by_rank"]
        assert isinstance(by_rank, pl.DataFrame)
        samples = dict(by_rank.group_by("rank").agg(pl.col("samples").max()).iter_rows())
        assert samples == {0: 3, 1: 5}
    finally:
        remove_observer(live)
        remove_observer(waiting)


def test_the_parent_queries_list_a_rank_the_world_size_expects_but_no_directory_holds(
    tmp_path: Path,
) -> None:
    """Rank 2 of 3 never attached: the setup names it, and the per-rank query lists it with
    counts unknown (null), not as 0 samples, nor leaves it out."""
    parent = tmp_path / "stats"
    for rank in (0, 1):
        model = nn.Linear(4, 4)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", str(rank))
            env.setenv("WORLD_SIZE", "3")
            inject_observer(model, output_dir=parent, rank_policy="all")
        model(torch.randn(2, 4)).sum().backward()
        remove_observer(model)
    said, per_rank = setup_and_per_rank(parent)
    assert said == (
        "missing: no directory for rank 2 (it never attached, or wrote elsewhere): what it saw "
        "is unknown\n"
    )
    assert per_rank.rows(named=True) == [
        {"rank": 0, "state": "complete", "samples": 1, "last_sample": 0, "rows": 18},
        {"rank": 1, "state": "complete", "samples": 1, "last_sample": 0, "rows": 18},
        {"rank": 2, "state": "no directory", "samples": None, "last_sample": None, "rows": None},
    ]
    # a rank's own "Ranks" query names it too, never reading two ranks as all there are
    page = parent / "rank-000" / "index.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    scope: dict[str, object] = {}
    own = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(blocks[0], str(page), "exec"), scope)
    with contextlib.redirect_stdout(own):
        exec(compile(next(b for b in blocks if "rank-*" in b), str(page), "exec"), scope)
    assert own.getvalue().splitlines()[0] == said.strip()
