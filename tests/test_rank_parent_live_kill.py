"""Readers of a directory of rank runs while its ranks write, on a real gloo group of 3 ranks on
127.0.0.1: rank 0 has finished (the parent's index.md is written), rank 1 goes on writing a part
per sample, and rank 2 was killed with SIGKILL after its third sample reached the disk. Every
reader, read again and again while rank 1 writes (index.md's blocks run as printed, `show`,
`compare`, a plain scan of the parts' glob), answers without failing, and each says where a
rank stands: finished, in progress, or interrupted (the per-rank query and the page's table
alike: its process ended, as its run lock tells, while rank 1's is held). Rank 2 was killed
after a fourth forward whose backward never ran: its latest sample is not open (no gradient can
still come), so `compare PARENT` calls the gradients it lacks there a departure, and the page
written after it says a rank may be further on than it says."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest
import torch
from test_comparison_query_agreement import KEY
from test_index_queries import execute
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.page_queries import OTHER_RUN_LINE
from torchinstruments.rundir.page_ranks import render_parent_index

from _ranks import TIMEOUT_SECONDS, free_port, joined
from conftest import cli_in_process, wait_for_rows

ROWS_PER_SAMPLE = 2 * len(DEFAULT_METRICS)  # one Linear: its output and its output gradient
# rank 2's state on the parent's page once its process died: told by its run lock, as
# `finalize` tells it, on a page written while rank 1 still writes and on the last one
ENDED = "not finished: its process ended without closing the run (killed or crashed)"
ROWS_KILLED = 3 * ROWS_PER_SAMPLE + len(DEFAULT_METRICS)  # rank 2: and sample 3's outputs
WORLD = 3
# a rank whose process held its lock as the page was written: said in the past, since a kill
# after the page's last rewrite cannot rewrite it
IN_PROGRESS_CELL = (
    "in progress when this page was written (its process held its lock; a kill since is not "
    "said here)"
)
READS = 8


def rank_main(rank: int, world_size: int, port: int, parent: str, signals: str) -> None:
    """Rank 0: 3 samples, then removal. Rank 2: 3 samples and a fourth forward on disk (its
    backward never runs), then SIGKILL. Rank 1: 3 samples, says so, then a sample (a part)
    every 50 ms until the test says stop: several parts added during each read, not the
    thousands of parts that every reader, and its removal's merge, would have to go through."""
    with joined(rank, world_size, port):
        torch.manual_seed(rank)
        model = nn.Linear(4, 4)
        inject_observer(
            model,
            output_dir=parent,
            sampler=EveryNForwardsSampler(1),
            # rank 2: a part per signal, so that its last forward's rows reach the disk
            history_config=HistoryConfig(buffer_rows=ROWS_PER_SAMPLE // (2 if rank == 2 else 1)),
            rank_policy="all",
        )
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
        wait_for_rows(Path(parent) / f"rank-{rank:03d}", 3 * ROWS_PER_SAMPLE)
        if rank == 2:
            model(torch.randn(2, 4))
            wait_for_rows(Path(parent) / "rank-002", ROWS_KILLED)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1:
            (Path(signals) / "writing").touch()
            deadline = time.monotonic() + TIMEOUT_SECONDS
            while not (Path(signals) / "stop").exists() and time.monotonic() < deadline:
                model(torch.randn(2, 4)).sum().backward()
                time.sleep(0.05)
        remove_observer(model)


def run_page(parent: Path) -> tuple[str, pl.DataFrame]:
    """Every block of the parent's index.md, as printed: the setup's output, the per-rank table."""
    text = (parent / "index.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    scope: dict[str, object] = {}
    outputs = []
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, "index.md", "exec"), scope)
        outputs.append(out.getvalue())
    return outputs[0], pl.read_csv(io.StringIO(outputs[1]))


def wait_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while not done():
        assert time.monotonic() < deadline, f"{what} not within {TIMEOUT_SECONDS} s"
        time.sleep(0.05)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL, fcntl")
def test_readers_of_live_ranks_and_a_killed_one_never_fail_and_say_where_each_rank_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, signals = tmp_path / "stats", tmp_path / "signals"
    signals.mkdir()
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=rank_main, args=(rank, WORLD, port, str(parent), str(signals)))
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    try:
        wait_until(lambda: not processes[0].is_alive() and not processes[2].is_alive(), "0, 2")
        wait_until(lambda: (signals / "writing").exists(), "rank 1 writing")
        assert [processes[0].exitcode, processes[2].exitcode] == [0, -signal.SIGKILL]
        seen_rows: list[int] = []
        for _ in range(READS):
            said, per_rank = run_page(parent)
            assert said == ""
            assert per_rank.select("rank", "state").rows() == [
                (0, "complete"),
                (1, "in progress"),
                (2, ENDED),  # as the table tells it: its run lock is free
            ]
            assert per_rank.filter(pl.col("rank") != 1)["samples"].to_list() == [3, 4]
            assert per_rank.filter(pl.col("rank") != 1)["rows"].to_list() == [54, ROWS_KILLED]
            live = per_rank.row(1, named=True)
            assert live["samples"] >= 3
            assert live["last_sample"] == live["samples"] - 1
            shown = cli_in_process("show", parent, "--width", "200")
            assert shown.returncode == 0, shown.stderr
            assert "rank 0: complete" in shown.stdout
            assert "rank 1: in progress" in shown.stdout
            assert "rank 2: interrupted: not finished, and no process holds" in shown.stdout
            rows = state_cells(render_parent_index(parent))  # the page a rank writes now
            assert rows[1] == IN_PROGRESS_CELL
            assert rows[2] == ENDED
            compared = cli_in_process("compare", parent, "--width", "200")
            assert compared.returncode == 0, compared.stderr
            assert "rank 2: interrupted: not finished" in compared.stdout
            parts = sorted(parent.glob("rank-*/history.parts/*.parquet"))
            rows = pl.scan_parquet(parts, glob=False).select(pl.len()).collect().item()
            assert not seen_rows or rows >= seen_rows[-1]  # parts only ever added
            seen_rows.append(rows)
        # no departure of values (--tolerance): only what the ranks hold; rank 2's gradient
        # at its latest sample is no row, never a row that may still come
        found = cli_in_process("compare", parent, "--tolerance", "1e9", "--format", "json")
        assert found.returncode == 0, found.stderr
        departed = json.loads(found.stdout)
        assert list(departed["run"]["open_samples"]) == ["1"]  # rank 1's, never rank 2's
        firsts = {(r["signal"], r["first_departure"]) for r in departed["rows"]}
        assert firsts == {("output", None), ("output_gradient", 3)}
        import fcntl

        with monkeypatch.context() as no_locks:  # a file system without locks (NFS: ENOLCK)
            no_locks.setattr(fcntl, "flock", refuse_lock)
            rows = state_cells(render_parent_index(parent))
        unknown = "in progress, or its process died (its lock cannot be read here)"
        assert (rows[1], rows[2]) == (unknown, unknown)  # never "ended" for the live rank 1
        (signals / "stop").touch()
        processes[1].join(TIMEOUT_SECONDS)
        assert processes[1].exitcode == 0
    finally:
        (signals / "stop").touch()
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    # The page rank 1's removal wrote: rank 1 finished, rank 2 still as its state file says.
    said, per_rank = run_page(parent)
    assert said == ""
    own = pl.read_parquet(parent / "rank-001" / "history.parquet")
    assert per_rank.select("rank", "state", "samples").rows() == [
        (0, "complete", 3),
        (1, "complete", own["sample_id"].n_unique()),
        (2, ENDED, 4),
    ]
    page = (parent / "index.md").read_text()
    assert state_cells(page)[2] == ENDED
    assert "may be further on than said here" in page
    # rank 1's own comparison query with rank 2 agrees with compare of the two directories:
    # rank 2's latest sample is not open, so the gradients it lacks there differ
    found = cli_in_process(
        "compare",
        parent / "rank-001",
        parent / "rank-002",
        "--tolerance",
        "1e9",
        "--format",
        "json",
    )
    assert found.returncode == 0, found.stderr
    firsts = {
        tuple(r[k] for k in KEY): r["first_difference"]
        for r in json.loads(found.stdout)["rows"]
        if r["first_difference"] is not None
    }
    assert set(firsts.values()) == {3}
    assert {series[2] for series in firsts} == {"output_gradient"}
    other = f"other_run = Path({json.dumps(str(parent / 'rank-002'))})"
    queried, _ = execute(
        (parent / "rank-001" / "index.md").read_text(encoding="utf-8"),
        {OTHER_RUN_LINE: other, "tolerance = 0.0": "tolerance = 1e9"},
    )
    query = queried["first"].select(*KEY, "first_sample").rows()
    assert {row[:-1]: row[-1] for row in query} == firsts
    restarted_rank_2(parent, monkeypatch)


def restarted_rank_2(parent: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The killed rank 2 restarted into its directory (resume=True, the launcher's RANK and
    WORLD_SIZE): from its start the parent's page calls it in progress, and `show PARENT` says
    how each of its attempts ended, as `show` of its own directory does (its state line
    names only the earlier attempt's end). The page is rendered once as it starts (the
    finalize of its killed attempt leaves it to that render, or renders it itself where the
    continuation is refused) and once as it ends."""
    from torchinstruments.rundir import parent_rewrite

    render, renders = parent_rewrite.render_parent_index, []

    def counted(*args: object) -> str:
        renders.append(True)
        return render(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(parent_rewrite, "render_parent_index", counted)
    with monkeypatch.context() as env:
        env.setenv("RANK", "2")
        env.setenv("WORLD_SIZE", str(WORLD))
        # first a model of other layers: refused after the killed attempt was finalized, so
        # no attempt starts, and the page says the finalized one instead of the killed one
        other = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        with pytest.raises(FileExistsError, match="observed other layers"):
            inject_observer(other, output_dir=parent, rank_policy="all", resume=True)
        assert len(renders) == 1
        finalized = state_cells((parent / "index.md").read_text(encoding="utf-8"))[2]
        assert finalized.startswith("interrupted"), finalized
        renders.clear()
        model = nn.Linear(4, 4)
        inject_observer(
            model,
            output_dir=parent,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            resume=True,
        )
    assert len(renders) == 1  # the start's
    model(torch.randn(2, 4)).sum().backward()
    live = "attempts: 2, continued with resume=True (killed: attempt 0; in progress: attempt 1)"
    page = (parent / "index.md").read_text(encoding="utf-8")
    assert state_cells(page)[2] == f"{IN_PROGRESS_CELL}; {live}"
    assert "**Ranks: 3 rank directories, 2 finished (removed or finalized)" in page
    shown = cli_in_process("show", parent, "--width", "1000")
    assert shown.returncode == 0, shown.stderr
    assert f"rank 2: {live}" in shown.stdout.splitlines()
    remove_observer(model)
    assert len(renders) == 2  # and the removal's own
    shown = cli_in_process("show", parent, "--width", "1000").stdout.splitlines()
    assert "rank 2: interrupted in an earlier attempt" in shown
    ended = (
        "rank 2: attempts: 2, continued with resume=True (killed: attempt 0; removed: attempt 1)"
    )
    assert ended in shown
    own = cli_in_process("show", parent / "rank-002", "--width", "1000").stdout
    assert ended.removeprefix("rank 2: ") in own
    page = (parent / "index.md").read_text(encoding="utf-8")
    assert state_cells(page)[2] == "interrupted; " + ended.removeprefix("rank 2: ")
    # a table without a header (csv, markdown) and a picture say it on stderr, as for one run,
    # never the complete ranks' state: rank 2's line is drawn like the others'
    pictures = parent.parent / "pictures"
    pictures.mkdir()
    for command, *options in (
        ("show", "--format", "csv"),
        ("compare", "--format", "markdown"),
        ("plot", "--metrics", "mean", "--output", pictures / "trends.png"),
    ):
        done = cli_in_process(command, parent, *options)
        assert done.returncode == 0, done.stderr
        said = done.stderr.splitlines()
        prefix = f"torchinstruments {command}: "
        assert prefix + "rank 2: interrupted in an earlier attempt" in said
        assert prefix + ended in said
        assert not [line for line in said if line.endswith(": complete")]


def refuse_lock(fd: int, operation: int) -> None:
    raise OSError(errno.ENOLCK, "No locks available")


def state_cells(page: str) -> dict[int, str]:
    """The state cell of each rank in a parent page's table."""
    rows = [line.split(" | ") for line in page.splitlines() if line.startswith("| ")]
    return {int(row[0][2:]): row[2] for row in rows if row[0][2:].isdigit()}
