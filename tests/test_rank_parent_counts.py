"""A parent's index.md gives each rank's counts as the rank's own index.md does: after real
SIGKILLs (one rank after 3 samples, one before its first) and `finalize PARENT`, the counts
rebuilt from history are "at least N", and counts nobody wrote are "unknown", never 0. A killed
rank not finalized yet reads as one whose process ended (no process holds its lock), never as
one in progress; a part that finalize left in place, unreadable, is named with its rank by the
page, its queries, `show` and `finalize`, and that rank's counts are said to be partial."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from conftest import cli_in_process, kill_when_ready, wait_for_rows

ROWS_PER_SAMPLE = 3 * 9 * 2  # Linear, ReLU, Linear; the default metrics; output and gradient


def child_main(parent: Path, rank: int, samples: int) -> None:
    """Rank `rank` of 4 takes `samples` samples, waits until their rows are on disk, says so."""
    from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer

    os.environ.update(RANK=str(rank), WORLD_SIZE="4")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    inject_observer(
        model,
        output_dir=parent,
        sampler=EveryNForwardsSampler(1),
        rank_policy="all",
        history_config=HistoryConfig(flush_seconds=0.2, buffer_rows=ROWS_PER_SAMPLE),
    )
    for _ in range(samples):
        model(torch.randn(5, 4)).sum().backward()
    wait_for_rows(parent / f"rank-{rank:03d}", samples * ROWS_PER_SAMPLE)
    print("ready", flush=True)
    time.sleep(120)


def test_the_parent_page_gives_killed_ranks_counts_as_their_own_pages_do(tmp_path: Path) -> None:
    from test_rank_parent_live_kill import run_page
    from test_rank_parent_readers import observe_rank

    from torchinstruments.rundir.index_page import counts_sentence
    from torchinstruments.rundir.state import read_state

    parent = tmp_path / "stats"
    observe_rank(parent, 0, world_size=4)
    kill_when_ready(__file__, "ready", parent, "1", "3")
    kill_when_ready(__file__, "ready", parent, "2", "0")
    kill_when_ready(__file__, "ready", parent, "3", "3")
    damaged = sorted((parent / "rank-003" / "history.parts").glob("part-*.parquet"))[-1]
    whole = damaged.read_bytes()
    damaged.write_bytes(whole[: len(whole) // 2])  # cut short, as by a copy or a crash

    # finalize of one rank rewrites the parent's page: the killed ranks it did not finalize
    # hold no lock, so they read as ended without closing the run, never as in progress
    done = cli_in_process("finalize", parent / "rank-003")
    assert done.returncode == 1  # incomplete: the part is left out
    page = (parent / "index.md").read_text(encoding="utf-8").splitlines()
    rows = {line.split(" | ")[0]: line for line in page if line.startswith("| ")}
    ended = (
        "not finished: its process ended without closing the run (killed or crashed; no "
        "process holds its lock); finalize completes it"
    )
    for rank in (1, 2):
        assert rows[f"| {rank}"] == f"| {rank} | `rank-00{rank}/` | {ended} | - | - |"
    assert not any("in progress" in line for line in page if line.startswith("| "))

    done = cli_in_process("finalize", parent)
    assert done.returncode == 1, done.stderr
    page = (parent / "index.md").read_text(encoding="utf-8").splitlines()
    rows = {line.split(" | ")[0]: line for line in page if line.startswith("| ")}
    for rank, samples, root_forwards in (
        (1, "at least 3", "at least 3"),
        (2, "unknown", "unknown"),
    ):
        state = read_state(parent / f"rank-{rank:03d}")
        assert state.counts_recovered
        own = counts_sentence(state)
        assert f"{root_forwards} root forward" in own  # the rank's own page says the same
        assert rows[f"| {rank}"] == (
            f"| {rank} | `rank-{rank:03d}/` | interrupted | {samples} | {root_forwards} |"
        )
    assert rows["| 0"] == "| 0 | `rank-000/` | complete | 3 | 3 |"
    assert any(line.startswith("at least N, unknown: ") for line in page)

    # rank 3: the part finalize left in place, named with its rank wherever the ranks are read
    assert damaged.exists()
    kept = pl.read_parquet(parent / "rank-003" / "history.parquet")
    assert 0 < kept.height < 3 * ROWS_PER_SAMPLE
    counts = read_state(parent / "rank-003").counts
    assert counts is not None
    assert counts.samples >= kept["sample_id"].n_unique()
    assert rows["| 3"] == (
        f"| 3 | `rank-003/` | incomplete, 1 part left out (see below) | at least "
        f"{counts.samples} (partial) | at least {counts.root_forwards} (partial) |"
    )
    said = (
        f"1 history part left out, unreadable (cut short, or of another version), left in "
        f"place: history.parts/{damaged.name}; its rows are in neither its history.parquet nor "
        "any query or command; its counts, rebuilt after its process died, are lower bounds "
        "that may leave them out (partial)"
    )
    assert f"**Rank 3 (rank-003/):** {said}." in page
    assert f"rank 3: {said}" in done.stdout.splitlines()
    assert f"torchinstruments finalize: rank 3: incomplete: history part {damaged.name}" in (
        done.stderr
    )
    shown = cli_in_process("show", parent, "--width", "400")
    assert shown.returncode == 0, shown.stderr
    assert f"rank 3: {said}" in shown.stdout.splitlines()
    setup_said, per_rank = run_page(parent)
    assert f"left out: {damaged}: unreadable (ComputeError); its rows are not read\n" == setup_said
    assert per_rank.filter(pl.col("rank") == 3)["rows"].to_list() == [kept.height]


def test_the_parent_page_says_a_ranks_marked_samples_and_removal_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_rank_parent_readers import observe_rank

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    parent = tmp_path / "stats"
    observe_rank(parent, 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    inject_observer(model, output_dir=parent, sampler=EveryNForwardsSampler(1), rank_policy="all")
    model(torch.randn(5, 4)).sum().backward()
    loss = model(torch.randn(5, 4)).sum()

    def remove(grad: torch.Tensor) -> None:
        remove_observer(model)

    loss.register_hook(remove)
    loss.backward()  # rank 1 removed during sample 1's backward
    page = (parent / "index.md").read_text(encoding="utf-8").splitlines()
    rows = {line.split(" | ")[0]: line for line in page if line.startswith("| ")}
    assert rows["| 0"] == "| 0 | `rank-000/` | complete | 3 | 3 |"
    assert rows["| 1"] == (
        "| 1 | `rank-001/` | complete, removed while a sample was in flight (sample 1); "
        "1 marked sample | 2 | 2 |"
    )


if __name__ == "__main__":
    child_main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
