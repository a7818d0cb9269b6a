"""A parent's index.md gives each rank's counts as the rank's own index.md does: after real
SIGKILLs (one rank after 3 samples, one before its first) and `finalize PARENT`, the counts
rebuilt from history are "at least N", and counts nobody wrote are "unknown", never 0. A killed
rank not finalized yet reads as one whose process ended (no process holds its lock), never as
one in progress; a part that finalize left in place, unreadable, is named with its rank by the
page, its queries, `show` and `finalize`, and that rank's counts are said to be partial."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import polars as pl
import pytest
import torch
from torch import nn

from conftest import cli_in_process, wait_for_rows

ROWS_PER_SAMPLE = 3 * 9 * 2  # Linear, ReLU, Linear; the default metrics; output and gradient


def child_main(parent: Path, rank: int, samples: int, removing: bool) -> None:
    """Rank `rank` of 4 takes `samples` samples, waits until their rows are on disk, says so;
    `removing`: calls remove_observer and says so once removal begins merging its parts."""
    import torchinstruments.rundir.finish as finish
    from torchinstruments import (
        EveryNForwardsSampler,
        HistoryConfig,
        inject_observer,
        remove_observer,
    )

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
    if removing:
        finish.merge_history = killed_while_merging
        remove_observer(model)
    say_ready()


def say_ready() -> None:
    print("ready", flush=True)
    time.sleep(120)


def killed_while_merging(directory: Path) -> NoReturn:
    """Removal's merge of the parts, where the test kills the child."""
    say_ready()
    raise AssertionError(f"{directory}: not killed while merging")


def kill_each_when_ready(*children: tuple[str | Path, ...]) -> None:
    """`conftest.kill_when_ready` of this file's child mode for each of `children` (its
    arguments), all started at once (each imports torch: seconds an interpreter, one after the
    other): each is SIGKILLed once it printed "ready", at its own known point."""
    started = [
        subprocess.Popen(
            [sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE, text=True
        )
        for args in children
    ]
    try:
        for child in started:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
    finally:
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_the_parent_page_gives_killed_ranks_counts_as_their_own_pages_do(tmp_path: Path) -> None:
    from test_rank_parent_live_kill import run_page
    from test_rank_parent_readers import observe_rank

    from torchinstruments.rundir.index_page import counts_sentence
    from torchinstruments.rundir.state import read_state

    parent = tmp_path / "stats"
    observe_rank(parent, 0, world_size=4)
    # rank 3 killed merging its parts
    kill_each_when_ready((parent, "1", "3"), (parent, "2", "0"), (parent, "3", "3", "removing"))
    shown = cli_in_process("show", parent, "--width", "400")
    assert shown.returncode == 0, shown.stderr
    assert (  # as finalize tells it: no process holds its lock
        "rank 3: interrupted during remove_observer, while merging history.parts/ into "
        "history.parquet: no process holds the run's lock"
    ) in shown.stdout.splitlines()
    cut = [  # rank 1's first part and rank 3's last, cut short as by a copy or a crash
        sorted((parent / f"rank-00{rank}" / "history.parts").glob("part-*.parquet"))[at]
        for rank, at in ((1, 0), (3, -1))
    ]
    for part in cut:
        whole = part.read_bytes()
        part.write_bytes(whole[: len(whole) // 2])

    # finalize of one rank rewrites the parent's page: the killed ranks it did not finalize
    # hold no lock, so they read as ended without closing the run, never as in progress (nor
    # as finished, rank 3's counts written as its removal began)
    done = cli_in_process("finalize", parent / "rank-001")
    assert done.returncode == 1, done.stderr  # incomplete: its first part is left out
    page = (parent / "index.md").read_text(encoding="utf-8").splitlines()
    rows = {line.split(" | ")[0]: line for line in page if line.startswith("| ")}
    ended = "not finished: its process ended {} (killed or crashed)"
    assert rows["| 2"] == f"| 2 | `rank-002/` | {ended.format('without closing the run')} | - | - |"
    during = "during remove_observer, while merging history.parts/ into history.parquet"
    assert rows["| 3"] == f"| 3 | `rank-003/` | {ended.format(during)} | - | - |"
    assert any(line.startswith("**Ranks: 4 rank directories, 2 finished ") for line in page)
    assert not any("in progress" in line for line in page if line.startswith("| "))

    done = cli_in_process("finalize", parent)
    assert done.returncode == 1, done.stderr  # incomplete: ranks 1 and 3 have a part left out
    # rank 1 finalized again: its cut first part, left in place, is not the part it wrote last
    assert "the last history part could not be checked" not in done.stderr
    page = (parent / "index.md").read_text(encoding="utf-8").splitlines()
    rows = {line.split(" | ")[0]: line for line in page if line.startswith("| ")}
    state = read_state(parent / "rank-002")
    assert state.counts_recovered
    assert "unknown root forwards" in counts_sentence(state)  # its own page says the same
    assert rows["| 2"] == "| 2 | `rank-002/` | interrupted | unknown | unknown |"
    assert rows["| 0"] == "| 0 | `rank-000/` | complete | 3 | 3 |"
    assert any(line.startswith("at least N, unknown: ") for line in page)

    # each part finalize left in place is named with its rank wherever the ranks are read; rank
    # 1's counts, rebuilt after its kill, are partial; rank 3's are its live run's (removal had
    # begun), which counted that part's samples
    left = "1 part left out (see below)"
    recovered = read_state(parent / "rank-001").counts
    assert recovered is not None
    assert rows["| 1"] == (
        f"| 1 | `rank-001/` | incomplete, {left} | at least {recovered.samples} (partial) | "
        f"at least {recovered.root_forwards} (partial) |"
    )
    assert rows["| 3"] == f"| 3 | `rank-003/` | incomplete, {left} | 3 | 3 |"
    said = {
        rank: (
            f"1 history part left out, unreadable (cut short, or of another version), left in "
            f"place: history.parts/{part.name}; its rows are in neither its history.parquet nor "
            f"any query or command; its counts, {counts}"
        )
        for rank, part, counts in (
            (
                1,
                cut[0],
                "rebuilt after its process died, are lower bounds that may leave them "
                "out (partial)",
            ),
            (3, cut[1], "its live run's, include those samples"),
        )
    }
    for rank, part in ((1, cut[0]), (3, cut[1])):
        assert part.exists()
        assert f"**Rank {rank} (rank-00{rank}/):** {said[rank]}." in page
        assert f"rank {rank}: {said[rank]}" in done.stdout.splitlines()
        assert f"finalize: rank {rank}: incomplete: history part {part.name} is unreadable" in (
            done.stderr
        )
    shown = cli_in_process("show", parent, "--width", "400")
    assert shown.returncode == 0, shown.stderr
    assert {f"rank {rank}: {said[rank]}" for rank in (1, 3)} <= set(shown.stdout.splitlines())
    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra
        drawn = cli_in_process("heatmap", parent, "--metrics", "mean", "-o", tmp_path)
        assert drawn.returncode == 0, drawn.stderr
        lines = drawn.stderr.splitlines()
        assert {f"torchinstruments heatmap: rank {r}: {said[r]}" for r in (1, 3)} <= set(lines)
    setup_said, per_rank = run_page(parent)
    assert setup_said.splitlines() == [
        f"left out: {part}: unreadable (ComputeError); its rows are not read" for part in cut
    ]
    for rank in (1, 3):
        kept = pl.read_parquet(parent / f"rank-00{rank}" / "history.parquet")
        assert 0 < kept.height < 3 * ROWS_PER_SAMPLE
        assert per_rank.filter(pl.col("rank") == rank)["rows"].to_list() == [kept.height]


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
    child_main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["removing"])
