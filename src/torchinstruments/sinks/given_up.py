"""Removal of the run directory with bounded waits: what it gives up, and what it says then.

Design decision: removal never waits on a stalled disk. The flush thread's last round and each
step of the finish (`rundir.finishing`) are waited for only so long (`sinks.directory`'s
`removal_wait_s`, the merge longer by its rows); one that has not returned is given up, and the
user is told which part's write hangs or which files were not written, what is lost, and how the
run is completed once the write returns. Kept apart from `sinks.directory` (the sink's life:
open, write, flush, close) because these are removal's bounds and their words: a newcomer looking
for what a stalled removal says finds it here, and a change to them never touches the sink.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torchinstruments.notices import warn
from torchinstruments.rundir import reserve, stuck_writes
from torchinstruments.rundir.finish import (
    FINISH_STEPS,
    FinishReport,
    finish_run,
    mark_partly_written_sample,
)
from torchinstruments.rundir.finishing import Finishing
from torchinstruments.rundir.layout import HISTORY_FILE, PARTS_DIR
from torchinstruments.rundir.page_ranks import is_rank_run
from torchinstruments.rundir.reserve import RESERVE_FILE
from torchinstruments.rundir.shell import literal_if_unclear, tool_command
from torchinstruments.rundir.state import RunState
from torchinstruments.rundir.writer import HistoryWriter

__all__ = [
    "MERGE_ROWS_PER_S",
    "finish_bound",
    "finish_work",
    "give_up_writes",
    "said_of_finish",
]

# Rows a second the merge at removal is given on top of `removal_wait_s`: a floor well below
# what a merge takes on a disk that answers, so only one that stopped answering is given up.
MERGE_ROWS_PER_S = 50_000


def give_up_writes(directory: Path, history: HistoryWriter, wait_s: float) -> None:
    """The flush thread's round has not returned after `wait_s` at removal: no part is put
    in place any more, and the rows still buffered are counted as not written, saying which
    part's write hangs (warned here; index.md lists them)."""
    part = history.writing_part
    what = "the run's flush thread" if part is None else f"the write of history part {part.name}"
    why = (
        f"{what} had not returned after {wait_s:g} s (a file system that stopped "
        "answering?); removal gave it up and wrote no part after it"
    )
    history.give_up(why, wait_s)
    warn(
        f"torchinstruments: {why}. The run under {literal_if_unclear(str(directory))} is "
        "finished from the "
        f"parts already on disk; the {history.rows_buffered:,} rows still in memory are not "
        "written, and index.md lists them"
    )


def finish_work(
    directory: Path, state: RunState, written: bool
) -> Callable[[Callable[[str], None]], FinishReport]:
    """The finish of the run in `directory` from `state`, step by step, for `Finishing`
    (`written`: whether the last part ended on a sample's end)."""

    def work(step: Callable[[str], None]) -> FinishReport:
        step(f"{RESERVE_FILE} (deleted)")
        reserve.release(directory)  # room for the final state and index.md
        final = state
        if not written:  # the last part may end inside a sample: marked, its own part
            step(f"the mark of the sample the last part split, in {PARTS_DIR}/")
            final = mark_partly_written_sample(directory, state)
        return finish_run(directory, final, step)

    return work


def finish_bound(wait_s: float, rows: int | None) -> Callable[[str], float]:
    """Each finish step's bound: `wait_s`, the merge longer by its `rows` (`MERGE_ROWS_PER_S`)."""
    merge_s = wait_s + (rows or 0) / MERGE_ROWS_PER_S

    def bound(step: str) -> float:
        return merge_s if step == HISTORY_FILE else wait_s

    return bound


def said_of_finish(
    directory: Path,
    finishing: Finishing[FinishReport],
    report: FinishReport | None,
    bound: Callable[[str], float],
    state: RunState,
    events_problem: str | None,
) -> None:
    """Warn what the finish found (its problems, but `events_problem`, warned when it
    happened; then the losses), or, given up (`report` None), that it was, and the losses of
    `state`."""
    if report is None:
        _gave_up_finish(directory, finishing, bound(finishing.step), state)
        for loss in state.losses:
            warn(f"torchinstruments: {loss.describe()}")
        return
    for problem in report.problems:
        if problem != events_problem:
            warn(f"torchinstruments: {problem}")
    for loss in report.state.losses:
        warn(f"torchinstruments: {loss.describe()}")


def _gave_up_finish(
    directory: Path, finishing: Finishing[FinishReport], waited_s: float, state: RunState
) -> None:
    """Warn that removal gave up finishing the run from `state` at the step `finishing` is
    at, naming what was not written, and record it for this process's later refusals of
    the directory while the finish holds its lock (`rundir.stuck_writes`)."""
    step = finishing.step
    steps = FINISH_STEPS if is_rank_run(directory, state) else FINISH_STEPS[:-1]
    # the reserve file or the mark come before them all
    later = steps[steps.index(step) :] if step in steps else (step, *steps)
    command = tool_command("finalize", directory)
    warn(
        "torchinstruments: finishing the run under "
        f"{literal_if_unclear(str(directory))} had not returned after "
        f"{waited_s:g} s at {step} (a file system that stopped answering?); removal returns "
        f"without it. Not written: {', '.join(later)} (a merge not done leaves the rows in "
        f"{PARTS_DIR}/, and readers see the run as the state file last said). This process "
        f"holds the run's lock until that write returns; `{command}` completes the run "
        "once it is released (at the latest when this process ends)"
    )
    stuck_writes.record(
        directory,
        stuck_writes.StuckWrite(
            "remove_observer's finish of the run",
            finishing,
            waited_s,
            later,
            f"once the lock is released (at the latest when this process ends), `{command}` "
            "completes the run, and resume=True continues it.",
        ),
    )
