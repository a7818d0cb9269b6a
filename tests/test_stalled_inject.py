"""inject_observer never hangs on a run directory that does not answer, and never leaves one
that failed locked or half written: it raises, naming output_dir, before the model changes.

The stall is real: the state file's temporary is a FIFO that no one reads, so inject's write
of it blocks opening it, as a write to a stalled network file system blocks. inject waits for
each of its writes at most `removal_wait_s`, then raises a TimeoutError naming output_dir; the
write goes on in a thread that holds the directory's lock, and a second inject there in the
same process is told that. Once the FIFO gets a reader (the file system answers again), the
thread deletes what the inject wrote and releases the lock, and the directory takes a new run.
Each stall runs in a child process forked from one interpreter that imported torch (`_forked`),
all at once, so that their bounds run out together, under a timeout: an inject that waits
without end fails the test.

A write that fails at once (a folder where result.json's temporary goes) is refused the same
way, with the lock released and nothing of the run left, so the same process can inject there
once the cause is gone.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from _forked import fork_each, run_forked, stderr_of
from torch import nn

import torchinstruments.sinks.directory as directory_sink
from torchinstruments import (
    EveryNForwardsSampler,
    HistoryConfig,
    has_observer,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    INDEX_FILE,
    LOCK_FILE,
    PARTS_DIR,
    RESULT_FILE,
    STATE_FILE,
    temporary_path,
)
from torchinstruments.rundir.lock import live_writer
from torchinstruments.rundir.reserve import RESERVE_FILE
from torchinstruments.rundir.state import Status, read_state

from conftest import observe, rows_in_parts

# The children's floor of removal_wait_s (sinks.directory.MIN_REMOVAL_WAIT_S, 10 s), shortened
# in the process they fork from to keep the suite short: the stalls are real FIFOs either way.
FLOOR_S = 3.0

CONFIG = HistoryConfig(flush_seconds=1.0)  # waits removal_wait_s: FLOOR_S


def released(fifo: Path, run: Path) -> None:
    """The file system answers again: the FIFO gets a reader (the write's open returns) and a
    writer (the fsync's open of it for reading returns too; the fsync of a FIFO then fails, so
    the write ends, as a failed one, and its thread releases the lock); wait for that."""
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    deadline = time.monotonic() + 120
    while live_writer(run) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.close(writer)
    os.close(reader)


def inject_child(root: Path) -> None:
    """Two injects into a directory whose state file's write blocks; then the disk answers."""
    run = root / "run"
    warnings.simplefilter("ignore")
    run.mkdir()
    fifo = temporary_path(run / STATE_FILE)
    os.mkfifo(fifo)  # inject's write of the state file blocks opening it
    model = nn.Linear(4, 2)
    report: dict[str, object] = {}
    for attempt in ("first", "again"):
        try:
            inject_observer(
                model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=CONFIG
            )
            report[attempt] = None
        except Exception as error:
            report[attempt] = [type(error).__name__, str(error)]
    report["observed"] = has_observer(model) or "forward" in vars(model)
    report["held"] = sorted(p.name for p in run.iterdir())
    released(fifo, run)
    report["released"] = sorted(p.name for p in run.iterdir())
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    (root / "report.json").write_text(json.dumps(report), "utf-8")


@pytest.fixture(scope="module")
def stalled_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each scenario's child, forked from one process (`_forked`) at once, into
    `root/<scenario>/run`; their exit statuses."""
    root = tmp_path_factory.mktemp("stalled")
    return root, run_forked(__file__, root, list(SCENARIOS))


def report_of(stalled_runs: tuple[Path, dict[str, int]], scenario: str) -> tuple[Path, dict]:
    """A scenario's run directory and what its child reported; it must have exited 0."""
    root, codes = stalled_runs
    assert codes[scenario] == 0, stderr_of(root, scenario)
    report = json.loads((root / scenario / "report.json").read_text("utf-8"))
    return root / scenario / "run", report


def test_an_inject_whose_write_does_not_return_raises_naming_output_dir_and_never_hangs(
    stalled_runs: tuple[Path, dict[str, int]],
) -> None:
    run, report = report_of(stalled_runs, "inject")
    kind, message = report["first"]
    assert kind == "TimeoutError"
    assert f"output_dir={str(run)!r} does not answer" in message, message
    assert f"writing {STATE_FILE} there had not returned after {FLOOR_S:g} s" in message
    assert "The model is not observed" in message
    assert report["observed"] is False
    # the parts folder and the catalog landed before the stall; the stuck write holds the lock
    held = [LOCK_FILE, PARTS_DIR, RESULT_FILE, temporary_path(run / STATE_FILE).name]
    assert report["held"] == sorted(held)
    kind, message = report["again"]
    assert kind == "FileExistsError"
    assert "inject_observer's opening of the run in this process" in message, message
    assert f"its thread still waits on {STATE_FILE}:" in message
    assert f"Not written: {STATE_FILE}, {INDEX_FILE}, {RESERVE_FILE}." in message
    assert "was not removed" not in message
    # once the write returned, what the inject wrote was deleted and the lock released
    assert report["released"] == [LOCK_FILE]
    assert read_state(run).status is Status.COMPLETE


def test_an_inject_whose_write_fails_raises_naming_output_dir_and_leaves_nothing_locked(
    run_dir: Path,
) -> None:
    run_dir.mkdir()
    blocker = temporary_path(run_dir / RESULT_FILE)
    blocker.mkdir()  # result.json's temporary cannot be opened for writing
    model = nn.Linear(4, 2)
    with pytest.raises(IsADirectoryError) as refused:
        inject_observer(model, output_dir=run_dir)
    message = str(refused.value)
    assert f"output_dir={str(run_dir)!r} cannot hold the run: {RESULT_FILE} could not" in message
    assert "The model is not observed" in message
    assert not has_observer(model)
    assert "forward" not in vars(model)
    assert live_writer(run_dir) is None  # the lock was released
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([LOCK_FILE, blocker.name])
    blocker.rmdir()
    observe(model, run_dir)  # the same process, once the cause is gone
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    assert read_state(run_dir).status is Status.COMPLETE


def test_an_inject_that_fails_after_its_catalog_deletes_what_it_wrote(run_dir: Path) -> None:
    """The state file's write fails after result.json landed: the run never started, so
    result.json goes again, and the directory is not taken for one that holds a run."""
    run_dir.mkdir()
    blocker = temporary_path(run_dir / STATE_FILE)
    blocker.mkdir()
    model = nn.Linear(4, 2)
    with pytest.raises(IsADirectoryError, match=f"{STATE_FILE} could not be written"):
        inject_observer(model, output_dir=run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([LOCK_FILE, blocker.name])
    assert live_writer(run_dir) is None


def resume_child(root: Path) -> None:
    """An attempt killed after its first step (a child forked from here), then resume=True
    there while one of its event files blocks, a new run and a retry; then the disk answers."""
    run = root / "run"
    warnings.simplefilter("ignore")
    pid = os.fork()
    if pid == 0:  # killed: no removal
        killed = nn.Linear(4, 2)
        inject_observer(killed, output_dir=run, sampler=EveryNForwardsSampler(1))
        killed(torch.randn(3, 4)).sum().backward()  # its first rows are written at once
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    report: dict[str, object] = {"rows": rows_in_parts(run)}
    fifo = run / "tensorboard" / "events.out.tfevents.stalled"
    os.mkfifo(fifo)  # completing the killed attempt reads its events: opening this one blocks
    model = nn.Linear(4, 2)
    for attempt, resume in (("first", True), ("new run", False), ("again", True)):
        try:
            inject_observer(
                model,
                output_dir=run,
                sampler=EveryNForwardsSampler(1),
                history_config=CONFIG,
                resume=resume,
            )
            report[attempt] = None
        except Exception as error:
            report[attempt] = [type(error).__name__, str(error)]
    report["observed"] = "forward" in vars(model)
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the disk answers again: an empty read
    deadline = time.monotonic() + 120
    while live_writer(run) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.unlink(fifo)
    inject_observer(
        model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=CONFIG, resume=True
    )
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    (root / "report.json").write_text(json.dumps(report), "utf-8")


SCENARIOS = {"inject": inject_child, "resume": resume_child}


def test_resume_whose_earlier_attempt_cannot_be_read_raises_naming_output_dir_and_never_hangs(
    stalled_runs: tuple[Path, dict[str, int]],
) -> None:
    """resume=True completes a killed earlier attempt first (`finalize`): a read or write of it
    that does not return is given up like inject's own, and the retries are told why."""
    run, report = report_of(stalled_runs, "resume")
    assert report["rows"] > 0  # the killed attempt's first rows
    merge_s = FLOOR_S + report["rows"] / 50_000  # the merge's bound: the floor, 50,000 rows a s
    kind, message = report["first"]
    assert kind == "TimeoutError"
    assert f"output_dir={str(run)!r} does not answer" in message, message
    what = "inject_observer's completion of the run's earlier attempt (resume=True)"
    assert f"{what}, at {HISTORY_FILE}, had not returned after {merge_s:g} s" in message
    assert report["observed"] is False
    for retry, kind in (("new run", "FileExistsError"), ("again", "RunLockedError")):
        got, message = report[retry]
        assert got == kind, message
        assert f"{what} in this process" in message, message
        assert f"its thread still waits on {HISTORY_FILE}:" in message
        assert "was not removed" not in message
        assert "Wait for it to end (remove_observer)" not in message
    # once the read returned, the earlier attempt was completed and the run continued
    state = read_state(run)
    assert [attempt.attempt for attempt in state.attempts] == [0, 1]


if __name__ == "__main__":
    directory_sink.MIN_REMOVAL_WAIT_S = FLOOR_S  # in every child forked below
    scenario = fork_each(Path(sys.argv[1]), sys.argv[2:], together=True)
    if scenario is not None:
        SCENARIOS[scenario](Path(sys.argv[1]) / scenario)
