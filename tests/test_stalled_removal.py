"""A part write that never returns does not hang remove_observer: removal gives it up and says so.

The stall is real: the next part's temporary name is a FIFO that no one reads, so the flush
thread's write of it blocks in `open` for as long as the FIFO has no reader, as a write to a
stalled network file system blocks. Removal has the flush thread write the last rows and waits
for it at most `removal_wait_s` (a flush interval, at least 10 s); then it gives the write up:
a warning names the part, the rows still in memory are counted in the loss ledger with that
reason (index.md lists them), and the run is finished from the parts on disk, readable by
`torchinstruments show` and `finalize`. Each case runs in a child process forked from one
interpreter that imported torch (`_forked`), all at once, so that their stalls' bounds run out
together, under a timeout: a removal that waits for the write without end fails the test
instead of hanging it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from _forked import fork_each, run_forked, stderr_of
from _stall_runs import observed_linear

import torchinstruments.sinks.directory as directory_sink
from torchinstruments import remove_observer
from torchinstruments.history_config import HistoryConfig
from torchinstruments.rundir import writer as writer_module
from torchinstruments.rundir.flush_timer import FlushTimer
from torchinstruments.rundir.layout import list_parts, part_path, part_temporary_path
from torchinstruments.rundir.state import Status, read_state
from torchinstruments.rundir.writer import HistoryWriter

from conftest import one_mean, run_cli

# The children's floor of removal_wait_s (sinks.directory.MIN_REMOVAL_WAIT_S, 10 s), shortened
# in the process they fork from to keep the suite short: the stalls are real FIFOs either way.
FLOOR_S = 3.0

ROWS_PER_SAMPLE = 18  # one Linear, default metrics, output and gradient

CASES = {
    # a few samples buffered when removal comes: its own last write is the one that hangs
    "at removal": (3, HistoryConfig(buffer_rows=10_000, flush_seconds=5.0)),
    # the flush thread hangs from the first full chunk on; the steps drop rows at the cap
    "since training": (40, HistoryConfig(buffer_rows=36, max_buffered_rows=72, flush_seconds=0.5)),
}


def stalled_child(root: Path, case: str) -> None:
    """The case's steps after the first, whose next part's write blocks; then a removal."""
    steps, config = CASES[case]
    run = root / "run"
    with observed_linear(run, config) as (model, x, caught):
        model(x).sum().backward()  # the first forward's and backward's rows: written at once
        stalled = part_path(run, len(list_parts(run)))
        os.mkfifo(part_temporary_path(stalled, 0))  # the next part's write blocks opening it
        for _ in range(steps):
            model(x).sum().backward()
        remove_observer(model)  # returns although the write never does
    report = {"part": stalled.name, "warnings": [str(w.message) for w in caught]}
    (root / "report.json").write_text(json.dumps(report), "utf-8")


@pytest.fixture(scope="module")
def stalled_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each case's child, forked from one process (`_forked`) at once, into `root/<case>/run`;
    their exit statuses."""
    root = tmp_path_factory.mktemp("stalled")
    return root, run_forked(__file__, root, list(CASES))


@pytest.mark.parametrize("case", CASES)
def test_removal_gives_up_a_part_write_that_never_returns_and_says_which_rows(
    stalled_runs: tuple[Path, dict[str, int]], case: str
) -> None:
    root, codes = stalled_runs
    assert codes[case] == 0, stderr_of(root, case)
    steps, config = CASES[case]
    run = root / case / "run"
    report = json.loads((root / case / "report.json").read_text("utf-8"))
    wait = max(config.flush_seconds, FLOOR_S)
    gave_up = f"the write of history part {report['part']} had not returned after {wait:g} s"
    said = "\n".join(report["warnings"])
    assert gave_up in said, said
    state = read_state(run)
    assert state.status is Status.INCOMPLETE
    history = pl.read_parquet(run / "history.parquet")
    markers = history.filter(pl.col("metric") == "interrupted").height
    lost = sum(loss.rows for loss in state.losses)
    # every row of every sample is in history or counted lost; the removal's loss is last
    assert history.height - markers + lost == (steps + 1) * ROWS_PER_SAMPLE
    assert gave_up in state.losses[-1].reason
    assert state.losses[-1].rows > 0
    assert history.filter(pl.col("metric") != "interrupted")["sample_id"].unique().to_list() == [0]
    assert list_parts(run) == []  # no part appeared after the merge
    index = (run / "index.md").read_text()
    assert gave_up in index
    shown = run_cli("show", str(run))
    assert shown.returncode == 0, shown.stderr
    assert "INCOMPLETE" in shown.stdout
    finalized = run_cli("finalize", str(run))
    assert finalized.returncode == 1, finalized.stderr  # incomplete: the rows are lost for good
    assert gave_up in finalized.stderr
    assert pl.read_parquet(run / "history.parquet").height == history.height
    assert sum(loss.rows for loss in read_state(run).losses) == lost


def test_a_part_write_that_returns_after_it_was_given_up_puts_no_part_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows of a write given up are counted lost; were its part put in place when the write
    returned, they would be in the ledger and (after a later finalize) in history both."""
    writing, release = threading.Event(), threading.Event()
    real = writer_module.write_parquet_atomic

    def held(frame: pl.DataFrame, path: Path, **kwargs: Any) -> None:
        writing.set()
        assert release.wait(60)
        real(frame, path, **kwargs)

    monkeypatch.setattr(writer_module, "write_parquet_atomic", held)
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=100))
    writer.append([one_mean(i) for i in range(5)])
    flush = threading.Thread(target=writer.flush)
    flush.start()
    assert writing.wait(60)
    assert writer.writing_part is not None
    assert writer.give_up("the write hangs", 60)
    assert not writer.close(write=False)
    (loss,) = writer.losses
    assert (loss.rows, loss.first_sample_id, loss.last_sample_id) == (5, 0, 4)
    assert "the write hangs" in loss.reason
    release.set()
    flush.join(60)
    assert not flush.is_alive()
    assert list_parts(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["history.parts"]  # its temporary is gone
    assert writer.rows_written == 0


def test_the_flush_threads_last_round_is_waited_for_only_while_it_returns() -> None:
    """`FlushTimer.finish`: True once the last flush ran and the thread ended; False, without
    waiting for it, when that round is still in the flush after `stall_s` (the thread ends by
    itself when it returns)."""
    release = threading.Event()
    rounds: list[bool] = []

    def flush(everything: bool) -> None:
        rounds.append(everything)
        assert release.wait(60)

    timer = FlushTimer(lambda: None, flush, "stalled flush")
    assert not timer.finish(0.1)
    assert rounds == [True]
    release.set()
    timer._thread.join(60)
    assert not timer._thread.is_alive()
    assert rounds == [True]

    quick = FlushTimer(lambda: None, rounds.append, "quick flush")
    assert quick.finish(60)
    assert not quick._thread.is_alive()
    assert rounds == [True, True]


def test_a_last_round_that_keeps_landing_parts_is_waited_for_however_long_it_runs() -> None:
    """A round that writes part after part (full chunks arrive while the training thread
    outpaces the flush thread, under Ctrl-Cs in Polars calls on two shared cores) runs longer
    than `stall_s` and is no stall: `finish` waits while `progress()` moves, and still gives up
    a round whose parts stop landing."""
    landed = [0]
    stop_landing_after = [12]

    def flush(everything: bool) -> None:
        while landed[0] < 12:
            time.sleep(0.05)  # one part written: 12 of them take 0.6 s, stall_s is 0.3
            if landed[0] < stop_landing_after[0]:
                landed[0] += 1
            else:
                time.sleep(60)  # this part never lands

    busy = FlushTimer(lambda: -1.0, flush, "busy flush")  # a round due at once: in flight
    while not landed[0]:
        time.sleep(0.01)
    assert busy.finish(0.3, lambda: landed[0])
    assert landed[0] == 12

    landed[0], stop_landing_after[0] = 0, 3
    stuck = FlushTimer(lambda: -1.0, flush, "stuck flush")
    while not landed[0]:
        time.sleep(0.01)
    assert not stuck.finish(0.3, lambda: landed[0])  # given up: its parts stopped landing
    assert landed[0] == 3


if __name__ == "__main__":
    directory_sink.MIN_REMOVAL_WAIT_S = FLOOR_S  # in every child forked below
    case = fork_each(Path(sys.argv[1]), sys.argv[2:], together=True)
    if case is not None:
        stalled_child(Path(sys.argv[1]) / case, case)
