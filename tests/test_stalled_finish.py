"""A run whose finish at removal (the merge, result.json, the state file, index.md) never returns
does not hang remove_observer: removal gives it up and says which files were not written.

The stall is real: the temporary of one of those files is a FIFO that no one reads, so its
write blocks in `open` for as long as the FIFO has no reader, as a write to a stalled network
file system blocks. Removal runs the finish on a thread of its own and waits for each step at
most `removal_wait_s` (the merge longer by its rows); then it returns, with a warning naming the
step and every file after it. Readers see the run as its state file last said: the process held
the lock while the write hung, and once it has ended (and the file system answers again)
`finalize` completes the run. The same process asking for that directory again meanwhile (a
notebook cell run again) is refused naming the stuck write, never a model left observed or a
removal still to call; once the write returns, resume=True continues the run. Each run is a
child process forked from one interpreter that imported torch (`_forked`), all at once, so that
their stalls' bounds run out together, under a timeout: a removal that waits for the write
without end fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest
import torch
from _forked import fork_each, run_forked, stderr_of
from _stall_runs import observed_linear
from test_stalled_inject import released
from torch import nn

import torchinstruments.sinks.directory as directory_sink
from torchinstruments import (
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.finishing import Finishing
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    INDEX_FILE,
    RESULT_FILE,
    STATE_FILE,
    part_path,
    part_temporary_path,
    temporary_path,
)
from torchinstruments.rundir.state import Status, read_state

from conftest import run_cli

# The children's floor of removal_wait_s (sinks.directory.MIN_REMOVAL_WAIT_S, 10 s), shortened
# in the process they fork from to keep the suite short: the stalls are real FIFOs either way.
FLOOR_S = 3.0

STEPS = 3
ROWS_PER_SAMPLE = 18  # one Linear, default metrics, output and gradient


def _said(root: Path, caught: list[warnings.WarningMessage]) -> None:
    """The child's warnings, for the test to read (`said`)."""
    (root / "said.json").write_text(json.dumps([str(w.message) for w in caught]), "utf-8")


def said_by(root: Path) -> str:
    """What a child warned, one warning a line."""
    return "\n".join(json.loads((root / "said.json").read_text("utf-8")))


def stalled_child(root: Path, stalled: str) -> None:
    """STEPS sampled steps, then a removal whose write of `stalled` blocks."""
    run = root / "run"
    config = HistoryConfig(flush_seconds=1.0)  # waits removal_wait_s: FLOOR_S
    with observed_linear(run, config) as (model, x, caught):
        for _ in range(STEPS):
            model(x).sum().backward()
        os.mkfifo(temporary_path(run / stalled))  # its write at removal blocks
        remove_observer(model)  # returns although the write never does
    _said(root, caught)


def stalled_doing(stalled: str) -> str:
    """What removal was doing when `stalled` hung, as the note `finalize` adds says it (the
    state file's write is the finish's last step, after index.md's: its state says index.md)."""
    if stalled == HISTORY_FILE:
        return f"merging history.parts/ into {HISTORY_FILE}"
    return f"writing {INDEX_FILE} and the final {STATE_FILE}"


# the file whose write hangs: the files not written from it on
CASES = {
    HISTORY_FILE: (HISTORY_FILE, RESULT_FILE, INDEX_FILE, STATE_FILE),
    STATE_FILE: (STATE_FILE,),
}

SCENARIOS = [*CASES, "save", "fork", "refusals"]


@pytest.fixture(scope="module")
def stalled_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each scenario's child, forked from one process (`_forked`) at once, into
    `root/<scenario>/run`; their exit statuses."""
    root = tmp_path_factory.mktemp("stalled")
    return root, run_forked(__file__, root, SCENARIOS)


@pytest.mark.parametrize("stalled", CASES)
def test_removal_gives_up_a_finish_that_never_returns_and_says_what_was_not_written(
    stalled_runs: tuple[Path, dict[str, int]], stalled: str
) -> None:
    root, codes = stalled_runs
    assert codes[stalled] == 0, stderr_of(root, stalled)
    run, said = root / stalled / "run", said_by(root / stalled)
    wait = FLOOR_S + STEPS * ROWS_PER_SAMPLE / 50_000 if stalled == HISTORY_FILE else FLOOR_S
    gave_up = f"finishing the run under {run} had not returned after {wait:g} s at {stalled}"
    assert gave_up in said, said
    assert f"Not written: {', '.join(CASES[stalled])} " in said
    assert read_state(run).status is Status.IN_PROGRESS  # the state written at injection
    if stalled == STATE_FILE:  # what came before it was written
        assert pl.read_parquet(run / HISTORY_FILE).height == STEPS * ROWS_PER_SAMPLE
        assert (run / RESULT_FILE).is_file()
    shown = run_cli("show", str(run))
    assert shown.returncode == 0, shown.stderr
    (run / f"{stalled}.torchinstruments-tmp").unlink()  # the file system answers again
    finalized = run_cli("finalize", str(run))
    assert finalized.returncode == 0, finalized.stderr
    assert pl.read_parquet(run / HISTORY_FILE).height == STEPS * ROWS_PER_SAMPLE
    # removal had written every row to history.parts/ and its counts before the finish began
    finished = read_state(run)
    assert finished.status is Status.COMPLETE
    assert finished.rows_recorded == STEPS * ROWS_PER_SAMPLE
    assert any(f"while {stalled_doing(stalled)}" in note for note in finished.notes)
    assert (run / INDEX_FILE).is_file()


def test_each_finish_step_is_waited_for_up_to_its_own_bound_and_the_lock_goes_after_it() -> None:
    """`Finishing.wait`: a step that returns within its bound is waited for, however long the
    finish takes in all; one that does not is given up, naming it, and the thread runs `after`
    (the lock's release) only once the work has returned."""
    slow_done, stuck = threading.Event(), threading.Event()
    released: list[str] = []

    def work(step: Callable[[str], None]) -> str:
        step("slow")
        assert slow_done.wait(60)
        step("stuck")
        assert stuck.wait(60)
        return "finished"

    threading.Timer(0.05, slow_done.set).start()
    finishing = Finishing(work, lambda: released.append(finishing.step), "finish")
    assert finishing.wait({"starting": 60.0, "slow": 60.0, "stuck": 0.0}.__getitem__) is None
    assert finishing.step == "stuck"
    assert released == []  # the lock stays with the stuck write
    stuck.set()
    assert finishing.wait(lambda step: 60.0) == "finished"
    assert released == ["stuck"]

    def failing(step: Callable[[str], None]) -> None:
        raise ValueError("not a disk error")

    failed = Finishing(failing, lambda: released.append("after failing"), "finish")
    with pytest.raises(ValueError, match="not a disk error"):
        failed.wait(lambda step: 60.0)
    assert released == ["stuck", "after failing"]


SAVE_STEPS = 10


def save_child(root: Path) -> None:
    """A save of the loss ledger by the flush thread hangs; removal finishes beside it."""
    run = root / "run"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = HistoryConfig(buffer_rows=18, max_buffered_rows=36, flush_seconds=1.0)
        inject_observer(
            model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config
        )
        model(x).sum().backward()  # parts 0 and 1: the first forward's and backward's rows
        os.mkdir(part_temporary_path(part_path(run, 2), 0))  # every later part write fails
        os.mkfifo(
            temporary_path(run / STATE_FILE, directory_sink.SAVE_TAG)
        )  # the flush thread's save hangs
        for _ in range(SAVE_STEPS - 1):
            model(x).sum().backward()  # rows beyond the cap are dropped: the ledger has news
        remove_observer(model)  # the flush thread's last round saves the ledger first: it hangs
    _said(root, caught)


def test_removal_finishes_the_run_beside_a_save_of_the_state_file_that_never_returns(
    stalled_runs: tuple[Path, dict[str, int]],
) -> None:
    """The flush thread's saves of the loss ledger into the state file have temporaries of their
    own: removal gives the stuck save up and writes the final state beside it."""
    root, codes = stalled_runs
    assert codes["save"] == 0, stderr_of(root, "save")
    run, steps, said = root / "save" / "run", SAVE_STEPS, said_by(root / "save")
    assert f"the run's flush thread had not returned after {FLOOR_S:g} s" in said, said
    assert "finishing the run" not in said, said
    state = read_state(run)
    assert state.status is Status.INCOMPLETE
    history = pl.read_parquet(run / HISTORY_FILE)
    assert history.filter(pl.col("metric") != "interrupted").height == ROWS_PER_SAMPLE
    markers = history.filter(pl.col("metric") == "interrupted").height
    lost = sum(loss.rows for loss in state.losses)
    assert history.height - markers + lost == steps * ROWS_PER_SAMPLE
    assert "the run's flush thread had not returned" in state.losses[-1].reason
    assert state.losses[-1].describe() in (run / INDEX_FILE).read_text()


def test_a_finish_where_no_thread_can_start_runs_on_the_removing_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python 3.12 refuses to start a thread in an exit handler (RuntimeError), where a user may
    remove the observer: the finish then runs where it is asked for, as before."""

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    ran: list[str] = []

    def work(step: Callable[[str], None]) -> str:
        ran.append(threading.current_thread().name)
        return "finished"

    finishing = Finishing(work, lambda: ran.append("after"), "finish")
    assert ran == [threading.current_thread().name, "after"]
    assert finishing.wait(lambda step: 0.0) == "finished"


def fork_child(root: Path) -> None:
    """The finish hangs holding the run's lock; then this process forks a child that outlives it."""
    run = root / "run"
    model = nn.Linear(4, 2)
    warnings.simplefilter("ignore")
    config = HistoryConfig(flush_seconds=1.0)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
    model(torch.randn(3, 4)).sum().backward()
    os.mkfifo(temporary_path(run / STATE_FILE))  # the finish hangs, holding the run's lock
    remove_observer(model)
    pid = os.fork()
    if pid == 0:  # a forked child (a data loader's worker) that outlives this process
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # the test reads this process's output to its end: not the child's
        os.dup2(null, 2)
        time.sleep(120)
        os._exit(0)
    (root / "pid").write_text(str(pid), "utf-8")


def test_a_child_forked_while_the_finish_hangs_does_not_keep_the_runs_lock(
    stalled_runs: tuple[Path, dict[str, int]],
) -> None:
    """The stuck finish holds the run's lock until this process ends; a child forked meanwhile
    closes its copy of the lock's descriptor, so the lock ends with the process that took it,
    not with the child, and finalize completes the run while the child lives."""
    root, codes = stalled_runs
    assert codes["fork"] == 0, stderr_of(root, "fork")
    run, child = root / "fork" / "run", int((root / "fork" / "pid").read_text("utf-8"))
    try:
        (run / f"{STATE_FILE}.torchinstruments-tmp").unlink()  # the file system answers again
        finalized = run_cli("finalize", str(run))
        assert finalized.returncode == 0, finalized.stderr
        assert pl.read_parquet(run / HISTORY_FILE).height == ROWS_PER_SAMPLE
    finally:
        os.kill(child, signal.SIGKILL)


def refusals_child(root: Path) -> None:
    """The finish hangs at the state file; the same process then asks for the directory again
    (a notebook cell run again), without and with resume=True; then the disk answers and
    resume=True continues the run."""
    run = root / "run"
    warnings.simplefilter("ignore")
    config = HistoryConfig(flush_seconds=1.0)
    model = nn.Linear(4, 2)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
    model(torch.randn(3, 4)).sum().backward()
    fifo = temporary_path(run / STATE_FILE)
    os.mkfifo(fifo)  # the finish's write of the state file blocks opening it
    remove_observer(model)  # gives the finish up; its thread holds the lock
    refusals: dict[str, list[str] | None] = {}
    for resume in (False, True):
        try:
            inject_observer(nn.Linear(4, 2), output_dir=run, resume=resume, history_config=config)
            refusals[str(resume)] = None
        except Exception as error:
            refusals[str(resume)] = [type(error).__name__, str(error)]
    released(fifo, run)  # the file system answers again, and the finish's thread lets go
    again = nn.Linear(4, 2)
    inject_observer(again, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    again(torch.randn(3, 4)).sum().backward()
    remove_observer(again)
    (root / "refusals.json").write_text(json.dumps(refusals), "utf-8")


def test_a_directory_held_by_a_given_up_finish_of_this_process_is_refused_naming_that_write(
    stalled_runs: tuple[Path, dict[str, int]],
) -> None:
    """A directory whose lock a given-up write of this very process still holds is refused for
    that reason: the stuck write is named, never a model left observed or a removal still to
    call. Once the write returns, its thread releases the lock and resume=True continues."""
    root, codes = stalled_runs
    assert codes["refusals"] == 0, stderr_of(root, "refusals")
    run = root / "refusals" / "run"
    refusals = json.loads((root / "refusals" / "refusals.json").read_text("utf-8"))
    kinds = {resume: refusal[0] for resume, refusal in refusals.items()}
    assert kinds == {"False": "FileExistsError", "True": "RunLockedError"}
    for _, message in refusals.values():
        assert "remove_observer's finish of the run in this process" in message, message
        assert f"after a write had not returned in {FLOOR_S:g} s" in message
        assert f"its thread still waits on {STATE_FILE}:" in message
        assert f"Not written: {STATE_FILE}." in message  # index.md is written before it
        assert f"check the disk or file system under {run}" in message
        assert "pass another output_dir" in message
        assert "was not removed" not in message  # it was removed
        assert "Wait for it to end (remove_observer)" not in message  # it was called
    # once the write returned, the lock was released and the run continued in a second attempt
    assert [attempt.attempt for attempt in read_state(run).attempts] == [0, 1]


if __name__ == "__main__":
    directory_sink.MIN_REMOVAL_WAIT_S = FLOOR_S  # in every child forked below
    scenario = fork_each(Path(sys.argv[1]), sys.argv[2:], together=True)
    if scenario == "save":
        save_child(Path(sys.argv[1]) / scenario)
    elif scenario == "fork":
        fork_child(Path(sys.argv[1]) / scenario)
    elif scenario == "refusals":
        refusals_child(Path(sys.argv[1]) / scenario)
    elif scenario is not None:
        stalled_child(Path(sys.argv[1]) / scenario, scenario)
