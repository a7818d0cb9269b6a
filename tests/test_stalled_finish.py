"""A run whose finish at removal (the merge, result.json, the state file, index.md) never returns
does not hang remove_observer: removal gives it up and says which files were not written.

The stall is real: the temporary of one of those files is a FIFO that no one reads, so its
write blocks in `open` for as long as the FIFO has no reader, as a write to a stalled network
file system blocks. Removal runs the finish on a thread of its own and waits for each step at
most `removal_wait_s` (the merge longer by its rows); then it returns, with a warning naming the
step and every file after it. Readers see the run as its state file last said: the process held
the lock while the write hung, and once it has ended (and the file system answers again)
`finalize` completes the run. Run in a child process, under a timeout: a removal that waits for
the write without end fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest

from torchinstruments.rundir.finishing import Finishing
from torchinstruments.rundir.layout import HISTORY_FILE, INDEX_FILE, RESULT_FILE, STATE_FILE
from torchinstruments.rundir.state import Status, read_state

from conftest import child_report, run_cli

# The children's floor of removal_wait_s (sinks.directory.MIN_REMOVAL_WAIT_S, 10 s), shortened
# by each child (its first lines) to keep the suite short: the stalls are real FIFOs either way.
FLOOR_S = 3.0

STEPS = 3
ROWS_PER_SAMPLE = 18  # one Linear, default metrics, output and gradient

CHILD = r"""
import json, os, sys, warnings
import torch
from torch import nn
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
import torchinstruments.sinks.directory as directory_sink
directory_sink.MIN_REMOVAL_WAIT_S = 3.0  # FLOOR_S: the test's floor, shortened; the stall is real
from torchinstruments.rundir.layout import temporary_path

from pathlib import Path

run, steps, stalled = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = nn.Linear(4, 2)
x = torch.randn(3, 4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    config = HistoryConfig(flush_seconds=1.0)  # waits removal_wait_s: FLOOR_S
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
    for _ in range(steps):
        model(x).sum().backward()
    os.mkfifo(temporary_path(run / stalled))  # its write at removal blocks
    remove_observer(model)  # returns although the write never does
print(json.dumps([str(w.message) for w in caught]))
"""


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


@pytest.mark.parametrize("stalled", CASES)
def test_removal_gives_up_a_finish_that_never_returns_and_says_what_was_not_written(
    tmp_path: Path, stalled: str
) -> None:
    run = tmp_path / "run"
    said = "\n".join(child_report(CHILD, run, STEPS, stalled))
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


SAVE_CHILD = r"""
import json, os, sys, warnings
import torch
from torch import nn
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
import torchinstruments.sinks.directory as directory_sink
directory_sink.MIN_REMOVAL_WAIT_S = 3.0  # FLOOR_S: the test's floor, shortened; the stall is real
from torchinstruments.rundir.layout import STATE_FILE, part_path, part_temporary_path, temporary_path
from torchinstruments.sinks.directory import SAVE_TAG

from pathlib import Path

run, steps = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = nn.Linear(4, 2)
x = torch.randn(3, 4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    config = HistoryConfig(buffer_rows=18, max_buffered_rows=36, flush_seconds=1.0)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
    model(x).sum().backward()  # parts 0 and 1: the first forward's and backward's rows
    os.mkdir(part_temporary_path(part_path(run, 2), 0))  # every later part write fails at once
    os.mkfifo(temporary_path(run / STATE_FILE, SAVE_TAG))  # the flush thread's save hangs
    for _ in range(steps - 1):
        model(x).sum().backward()  # rows beyond the cap are dropped: the ledger has news
    remove_observer(model)  # the flush thread's last round saves the ledger first: it hangs
print(json.dumps([str(w.message) for w in caught]))
"""


def test_removal_finishes_the_run_beside_a_save_of_the_state_file_that_never_returns(
    tmp_path: Path,
) -> None:
    """The flush thread's saves of the loss ledger into the state file have temporaries of their
    own: removal gives the stuck save up and writes the final state beside it."""
    run = tmp_path / "run"
    steps = 10
    said = "\n".join(child_report(SAVE_CHILD, run, steps))
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


FORK_CHILD = r"""
import os, sys, time, warnings
import torch
from torch import nn
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
import torchinstruments.sinks.directory as directory_sink
directory_sink.MIN_REMOVAL_WAIT_S = 3.0  # FLOOR_S: the test's floor, shortened; the stall is real
from torchinstruments.rundir.layout import STATE_FILE, temporary_path

from pathlib import Path

run = Path(sys.argv[1])
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
print(pid, flush=True)
"""


def test_a_child_forked_while_the_finish_hangs_does_not_keep_the_runs_lock(tmp_path: Path) -> None:
    """The stuck finish holds the run's lock until this process ends; a child forked meanwhile
    closes its copy of the lock's descriptor, so the lock ends with the process that took it,
    not with the child, and finalize completes the run while the child lives."""
    run = tmp_path / "run"
    child = int(child_report(FORK_CHILD, run))
    try:
        (run / f"{STATE_FILE}.torchinstruments-tmp").unlink()  # the file system answers again
        finalized = run_cli("finalize", str(run))
        assert finalized.returncode == 0, finalized.stderr
        assert pl.read_parquet(run / HISTORY_FILE).height == ROWS_PER_SAMPLE
    finally:
        os.kill(child, signal.SIGKILL)
