"""The run's first rows, written at once, never hang the training step on a stalled disk.

The run's first forward rows and first backward rows go to disk at once, so a run killed right
after its first sample has them. The stall is real: the first part's temporary name is a FIFO
that no one reads, so a write of it blocks in `open` for as long as the FIFO has no reader, as a
write to a stalled network file system blocks. The step hands that write to the flush thread and
waits for it at most `removal_wait_s`; then it goes on, warns once, and the rows stay in memory
(removal counts them, with why, in the loss ledger and index.md). Each case runs in a child
process forked from one interpreter that imported torch (`_forked`), all at once, so that their
stalls' bounds run out together, under a timeout: a step that waits for the write without end
fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import polars as pl
import pytest
from _forked import fork_each, run_forked, stderr_of
from _stall_runs import observed_linear

import torchinstruments.sinks.directory as directory_sink
from torchinstruments import HistoryConfig, remove_observer
from torchinstruments.rundir.layout import part_path, part_temporary_path
from torchinstruments.rundir.state import Status, read_state

# The children's floor of removal_wait_s (sinks.directory.MIN_REMOVAL_WAIT_S, 10 s), shortened
# in the process they fork from to keep the suite short: the stalls are real FIFOs either way.
FLOOR_S = 3.0

STEPS = 5  # sampled steps in all
ROWS_PER_SAMPLE = 18  # one Linear, default metrics, output and gradient


def said_by(root: Path) -> str:
    """What a child warned, one warning a line."""
    return "\n".join(json.loads((root / "said.json").read_text("utf-8")))


def stalled_child(root: Path) -> None:
    """STEPS sampled steps whose first part's write blocks, then a removal that gives it up."""
    run = root / "run"
    config = HistoryConfig(flush_seconds=1.0)  # waits removal_wait_s: FLOOR_S
    with observed_linear(run, config) as (model, x, caught):
        os.mkfifo(part_temporary_path(part_path(run, 0), 0))  # the first part's write blocks
        for _ in range(STEPS):
            model(x).sum().backward()
        remove_observer(model)  # gives the write up
    (root / "said.json").write_text(json.dumps([str(w.message) for w in caught]), "utf-8")


def default_child(root: Path) -> None:
    """STEPS sampled steps at the default flush_seconds whose first part's write blocks; the
    file system answers again before removal."""
    run = root / "run"
    with observed_linear(run) as (model, x, caught):  # flush_seconds 60
        fifo = part_temporary_path(part_path(run, 0), 0)
        os.mkfifo(fifo)  # the first part's write blocks
        for _ in range(STEPS):
            model(x).sum().backward()
        # The file system answers again: the FIFO gets a reader (the write's open returns) and
        # a writer (an open of it for reading returns too); the write then fails on the FIFO,
        # its temporary is deleted, and the rows are written again as a file.
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        remove_observer(model)
        os.close(writer)
        os.close(reader)
    (root / "said.json").write_text(json.dumps([str(w.message) for w in caught]), "utf-8")


SCENARIOS = {"stalled": stalled_child, "default": default_child}


@pytest.fixture(scope="module")
def stalled_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each scenario's child, forked from one process (`_forked`) at once, into
    `root/<scenario>/run`; their exit statuses."""
    root = tmp_path_factory.mktemp("stalled")
    return root, run_forked(__file__, root, list(SCENARIOS))


def test_the_first_rows_written_at_once_wait_for_a_stalled_disk_only_so_long(
    stalled_runs: tuple[Path, dict[str, int]],
) -> None:
    root, codes = stalled_runs
    assert codes["stalled"] == 0, stderr_of(root, "stalled")
    run, said = root / "stalled" / "run", said_by(root / "stalled")
    first = f"the run's first output rows were not on disk after {FLOOR_S:g} s"
    assert first in said, said
    state = read_state(run)
    assert state.status is Status.INCOMPLETE
    history = pl.read_parquet(run / "history.parquet")
    assert history.filter(pl.col("metric") != "interrupted").height == 0  # no part landed
    # every row of every sample is counted lost, with the stalled write as the reason
    assert sum(loss.rows for loss in state.losses) == STEPS * ROWS_PER_SAMPLE
    (loss,) = state.losses
    assert (loss.first_sample_id, loss.last_sample_id) == (0, STEPS - 1)
    assert "the write of history part part-000000000.parquet had not returned" in loss.reason
    assert loss.describe() in (run / "index.md").read_text()


def test_the_first_rows_wait_for_a_stalled_disk_the_floor_not_the_default_flush_interval(
    stalled_runs: tuple[Path, dict[str, int]],
) -> None:
    """With the default flush_seconds (60), the first sampled step stands still the floor
    (`MIN_REMOVAL_WAIT_S`), not a whole flush interval: a write not waited for costs only the
    warning, since its rows land once the disk answers, and every row reaches history."""
    root, codes = stalled_runs
    assert codes["default"] == 0, stderr_of(root, "default")
    run, said = root / "default" / "run", said_by(root / "default")
    assert f"the run's first output rows were not on disk after {FLOOR_S:g} s" in said, said
    history = pl.read_parquet(run / "history.parquet")
    assert history.filter(pl.col("metric") == "interrupted").height == 0
    assert history.height == STEPS * ROWS_PER_SAMPLE
    assert read_state(run).status is Status.COMPLETE


if __name__ == "__main__":
    directory_sink.MIN_REMOVAL_WAIT_S = FLOOR_S  # in every child forked below
    scenario = fork_each(Path(sys.argv[1]), sys.argv[2:], together=True)
    if scenario is not None:
        SCENARIOS[scenario](Path(sys.argv[1]) / scenario)
