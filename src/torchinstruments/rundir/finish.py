"""The end of a run: one routine for removal and for crash recovery (`finalize`).

Design decision: `finish_run` is the only code that turns a directory of parts into a finished
run (merge, result.json, index.md, then the state file readers trust), and both
`remove_observer` (through `DirectorySink.close`) and `torchinstruments finalize` call it, so
recovery is the same code the library runs at removal. Its error policy is single: nothing it
does raises for a disk or Polars failure; each failure becomes a line in the state's
`problems`, index.md lists those lines and says "complete" only when there are none, and the
caller reports them (a warning at removal, stderr in the CLI). A failing result.json never prevents history.parquet, and a failing merge
leaves the parts in place for a later `finalize`.

"Complete" means history.parquet holds every row the run recorded. The live run knows that
number and writes it into the state file at removal; a crashed run never reached removal, so
`finalize` cannot know how many rows it still held in memory (at most one flush interval's worth)
and calls the directory "interrupted", never "complete". `finalize` reads the directory's state
through `rundir.recovery.load_state` (older directories included) and keeps what only the live
run knew: its exact counts, the rows it recorded, the problems no later finalize can check again
(`RunState.live_problems`), the loss ledger and the notes.

What the merged history is checked against (rows short, gaps, events without rows) is
`rundir.history_checks`; the state `finalize` starts from, `rundir.recovery.state_to_finish`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from torchinstruments import reasons
from torchinstruments.notices import warn
from torchinstruments.records import RunCounts
from torchinstruments.rundir.attempts import (
    at_least_attempts,
    close_attempts,
)
from torchinstruments.rundir.history_checks import (
    attempts_short,
    events_without_rows,
    unexplained_gaps,
)
from torchinstruments.rundir.index_page import write_index
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    INDEX_FILE,
    MERGE_TMP_DIR,
    PARTS_DIR,
    PARTS_GONE_DIR,
    RESULT_FILE,
    STATE_FILE,
    is_library_temporary,
)
from torchinstruments.rundir.lock import FINALIZE, RunLock
from torchinstruments.rundir.mark_counts import raised_to_mark
from torchinstruments.rundir.marks import mark_partly_written, read_marks
from torchinstruments.rundir.merge import MergeResult, merge_history
from torchinstruments.rundir.output_dir import expand_user
from torchinstruments.rundir.page_ranks import is_rank_run
from torchinstruments.rundir.parent_rewrite import rewrite_parent_index
from torchinstruments.rundir.recovery import recovered_counts, state_to_finish
from torchinstruments.rundir.repeats import with_killed_repeats
from torchinstruments.rundir.shell import error_said, literal_if_unclear, tool_command, tool_span
from torchinstruments.rundir.state import (
    RunState,
    Status,
    write_state,
)
from torchinstruments.rundir.summary import write_result


@dataclass(frozen=True)
class FinishReport:
    """What finishing a run did, and what is missing from it.

    Attributes:
        directory: the run directory.
        merge: the merge's result, or None when the merge failed.
        state: the state written into the state file and index.md.
        removed_temporaries: library temporaries deleted by `finalize`.
        kept_temporaries: those it could not delete (a directory without write permission),
            each with why; not a problem of the run (none of its rows is there).
    """

    directory: Path
    merge: MergeResult | None
    state: RunState
    removed_temporaries: tuple[Path, ...] = ()
    kept_temporaries: tuple[tuple[Path, str], ...] = ()

    @property
    def counts(self) -> RunCounts:
        """The counts written into the state (finish always has them)."""
        assert self.state.counts is not None
        return self.state.counts

    @property
    def problems(self) -> tuple[str, ...]:
        """Why the run is incomplete; empty when history.parquet holds every row the run
        recorded and result.json, the state file and index.md were written."""
        return self.state.problems

    @property
    def complete(self) -> bool:
        """Whether the run directory holds everything the run recorded (as far as is known)."""
        return self.state.status in (Status.COMPLETE, Status.INTERRUPTED)

    @property
    def interrupted(self) -> bool:
        """True when the run never reached removal (its process died): rows of its last flush
        interval may be missing, and their number is unknown."""
        return self.state.interrupted

    @property
    def run_info_recovered(self) -> bool:
        """True when the directory's run info was unreadable and rebuilt from history."""
        return self.state.run_info_recovered


# The files `finish_run` writes, in order: the names its `step` gets (the ranks' page last).
# index.md comes before the state file readers trust: a kill between them never leaves a state
# saying "complete" beside an index.md saying "in progress".
FINISH_STEPS = (HISTORY_FILE, RESULT_FILE, INDEX_FILE, STATE_FILE, f"the ranks' {INDEX_FILE}")


def _no_step(name: str) -> None:
    """`finish_run`'s `step` when no one follows its steps."""


# Whatever a merge raises but a Ctrl-C: a Polars panic (a BaseException), a MemoryError, as well
# as disk and Polars errors. Let through, it left the state "in progress" after the removal.
_MERGE_FAILURES = (Exception, pl.exceptions.PanicException)


def finish_run(
    directory: Path,
    state: RunState,
    step: Callable[[str], None] = _no_step,
    parent_page: bool = True,
) -> FinishReport:
    """Merge the parts, write result.json, index.md and the state file; never raises for disk
    or Polars errors, nor for any failure of the merge (a Polars panic, a MemoryError).

    Args:
        directory: the run directory (absolute, used literally).
        state: the run's state before finishing: `counts` None to rebuild them from history
            (after a crash), `rows_recorded` when known (history.parquet is checked against
            it), `live_problems` the failures already known (listed, and kept by later
            finishes), `interrupted` when the process ended without removal, `losses` the
            loss ledger (rows recorded but not written; kept as they are).
        step: called with each file's name in `FINISH_STEPS` as its step begins (removal
            bounds each, `rundir.finishing`).
        parent_page: whether a rank run's parent page is rewritten after it
            (`rundir.parent_rewrite`).

    Returns:
        A `FinishReport`; its `problems` are empty exactly when nothing is known to be missing.
    """
    found: list[str] = list(state.live_problems)
    merge: MergeResult | None = None
    step(HISTORY_FILE)
    state = _removal_at(directory, state, HISTORY_FILE)
    try:
        merge = merge_history(directory)
    except _MERGE_FAILURES as error:
        found.append(
            f"merging {PARTS_DIR}/ into {HISTORY_FILE} failed ({error_said(error)}); "
            "the parts are kept: run "
            f"`{tool_command('finalize', directory)}`"
        )
    recovered = state.counts is None
    counts = state.counts
    if counts is None:  # the scales the live run saved (`rundir.live_scales`) are not in history
        counts = dataclasses.replace(recovered_counts(directory), loss_scales=state.loss_scales)
    rows_recorded = state.rows_recorded
    if merge is not None:
        closed = close_attempts(state.attempts, merge.path)
        killed = [a.attempt for a, b in zip(state.attempts, closed, strict=True) if a != b]
        notes = with_killed_repeats(state.notes, merge.path, [a for a in killed if a > 0])
        state = dataclasses.replace(state, attempts=closed, notes=notes)
        if state.interrupted and (killed or recovered or not state.attempts):
            # once per kill: the finish that closes it reads the job's events (every sample's),
            # and the next attempts keep what it found (`attempt_states.start_state`)
            state, counts = events_without_rows(
                directory, merge.path, state, counts, recovered, killed
            )
        if state.interrupted:
            state, counts = raised_to_mark(directory, state, counts, recovered)
        if recovered:  # never below what the attempts' own counts say together
            counts = at_least_attempts(counts, state.attempts)
        state = dataclasses.replace(state, left_behind=_left_behind(directory, merge))
        for line in state.left_behind:
            warn(f"torchinstruments: {line}")
        found += [
            f"history part {path.name} is unreadable and was left in place ({reason}); its rows "
            "are not in history.parquet"
            for path, reason in merge.unreadable_parts
        ]
        lost = sum(loss.rows for loss in state.losses)
        # each attempt's own rows (known where the job's are not), where each loss is its own
        if len(state.attempts) > 1 and all(x.first_sample_id is not None for x in state.losses):
            found += attempts_short(merge.path, state)
        elif rows_recorded is not None and merge.rows < rows_recorded - lost:
            ledger = f" ({lost} more are in the loss ledger)" if lost else ""
            found.append(
                f"{HISTORY_FILE} holds {merge.rows} of the {rows_recorded} rows this run "
                f"recorded; {rows_recorded - lost - merge.rows} rows are missing{ledger}"
            )
        if state.interrupted:
            left = [path.name for path, _ in merge.unreadable_parts]
            found += unexplained_gaps(merge.path, state, left)
        try:
            marks, marks_total = read_marks(merge.path)
            state = dataclasses.replace(state, marks=marks, marks_total=marks_total)
        except (OSError, pl.exceptions.PolarsError) as error:
            found.append(f"marked samples could not be read ({error_said(error)})")
        step(RESULT_FILE)
        state = _removal_at(directory, state, RESULT_FILE)
        try:
            changes = write_result(
                directory,
                state.run.layers,
                state.run.history.window,
                counts.layer_samples,
                # rebuilt after a kill: a layer without an output row on disk is unknown, never 0
                lower_bounds=recovered or state.counts_recovered,
            )
            state = dataclasses.replace(
                state, dtype_changes=changes.layers, dtype_changes_total=changes.total
            )
        except (OSError, pl.exceptions.PolarsError, ValueError) as error:
            found.append(f"result.json could not be written ({error_said(error)})")
    if recovered:
        # Rebuilt counts keep the run's notes as its state keeps them, each labelled with its
        # attempt there (an earlier attempt's counts' notes, which its removal wrote there too,
        # and those the live run saved as it went): the counts the dead process would have
        # written died with it, their notes did not, and `counts.notes` never says less than
        # the state's `notes` (a second finalize rebuilds the same).
        counts = dataclasses.replace(counts, notes=state.notes)
    # counts that were lower bounds stay lower bounds (a continued run whose earlier attempt
    # was killed keeps its live attempt's exact counts on top of them)
    final = dataclasses.replace(
        state,
        counts=counts,
        counts_recovered=recovered or state.counts_recovered,
        problems=tuple(found),
        removal_step=None,
        loss_scales=counts.loss_scales,  # a later finish that rebuilds the counts keeps them
    )
    step(INDEX_FILE)
    _removal_at(directory, state, INDEX_FILE)  # a kill from here on: index.md may be written
    index_failed = None
    try:
        write_index(directory, final)
    except OSError as error:
        final = _with_problem(final, f"{INDEX_FILE} could not be written", error)
        index_failed = error
    step(STATE_FILE)
    try:
        write_state(directory, final)
    except OSError as error:
        final = _with_problem(final, f"{STATE_FILE} could not be written", error)
        if index_failed is None:  # index.md says what the state file could not
            with contextlib.suppress(OSError):
                write_index(directory, final)
    if parent_page and is_rank_run(directory, final):
        step(FINISH_STEPS[-1])
        rewrite_parent_index(directory.parent)
    return FinishReport(directory, merge, final)


def _left_behind(directory: Path, merge: MergeResult) -> tuple[str, ...]:
    """What the merge could not delete of the parts history.parquet now holds, said as index.md
    and the warning at removal say it: never a problem of the run (no row is missing), but a
    second copy of its rows on disk that nobody would otherwise find. The folder an earlier
    merge left (`PARTS_GONE_DIR`) is said as long as it is there: a finish that could not
    delete it either never drops the line."""
    lines = []
    left = list(merge.left_behind)
    gone = directory / PARTS_GONE_DIR  # an earlier merge's, that finalize could not delete
    if gone.is_dir() and all(path != gone for path, _ in left):
        left.append((gone, "left by an earlier merge, still there"))
    for path, why in left:
        size = ""
        with contextlib.suppress(OSError):
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            size = f" ({sum(p.stat().st_size for p in files):,} bytes)"
        lines.append(
            f"{literal_if_unclear(str(path))} could not be deleted after the merge ({why}): it "
            f"holds a second copy{size} of rows {HISTORY_FILE} already holds; delete it, or run "
            f"{tool_span('finalize', directory)} once it can be written"
        )
    return tuple(lines)


def _removal_at(directory: Path, state: RunState, step: str) -> RunState:
    """`state` at removal's `step` (`RunState.removal_step`), written into the state file, so
    that a process killed there reads "killed during removal", not "ended without it"; a
    finish that is no removal's is returned as it is. A failed write is no problem of the run
    (the final state is written after it)."""
    if state.removal_step is None:
        return state
    state = dataclasses.replace(state, removal_step=step)
    with contextlib.suppress(OSError):  # a temporary of its own, as the flush thread's saves
        write_state(directory, state, tag="removal")
    return state


def _with_problem(state: RunState, what: str, error: OSError) -> RunState:
    """`state` with one more problem: `what (Type: message)`."""
    problem = f"{what} ({error_said(error)})"
    return dataclasses.replace(state, problems=(*state.problems, problem))


def finalize(
    directory: Path, step: Callable[[str], None] = _no_step, parent_page: bool = True
) -> FinishReport:
    """Complete an interrupted run directory: merge parts, write result.json, state and index.md.

    Safe to run again: parts already in history.parquet are not merged twice, unreadable parts stay
    in place (and are listed in `problems`). A finished run keeps the exact counts its live
    process wrote into the state file; index.md is rendered again from the state, so a directory
    whose index.md was deleted gets it back. Only files the library created are deleted
    (temporaries ending in `.torchinstruments-tmp`). A directory it cannot write (read-only) is
    no exception: what it could not delete or write is in the report (`kept_temporaries`,
    `problems`), as at removal.

    Args:
        directory: the run's output directory.
        step: called as each step begins (`finish_run`; inject with resume=True bounds each).
        parent_page: whether a rank run's parent page is rewritten (`finalize PARENT` writes
            it once, after all its ranks, instead of once a rank).

    Returns:
        A `FinishReport`.

    Raises:
        FileNotFoundError: if `directory` holds no run (no history.parts/ nor history.parquet).
        RunLockedError: if a live process holds the run lock.
        OSError: if the run's lock file cannot be opened (nothing else was touched).
        NewerStateError: if a newer torchinstruments wrote the directory's state file.
    """
    directory = expand_user(directory, "directory").absolute()
    if not (directory / PARTS_DIR).is_dir() and not (directory / HISTORY_FILE).is_file():
        raise FileNotFoundError(
            f"{literal_if_unclear(str(directory))} holds no run: neither {PARTS_DIR}/ nor "
            f"{HISTORY_FILE} exists; pass "
            "the output_dir a run wrote"
        )
    with RunLock(directory, FINALIZE):
        removed, kept = _remove_temporaries(directory)
        state = state_to_finish(directory)
        if state.interrupted or state.losses:
            state = mark_partly_written_sample(directory, state)
        report = finish_run(directory, state, step, parent_page)
    return dataclasses.replace(
        report, removed_temporaries=tuple(removed), kept_temporaries=tuple(kept)
    )


def mark_partly_written_sample(directory: Path, state: RunState) -> RunState:
    """Mark the sample whose rows the last part split and whose rest never reached the disk
    (see `rundir.marks`): the process died (`state.interrupted`), or the removal could not
    write its last rows. A failure to check or mark is a problem of `state`, never raised."""
    why = reasons.partly_written if state.interrupted else reasons.unwritten_at_removal
    try:
        mark_partly_written(directory, why)
    except (OSError, pl.exceptions.PolarsError, ValueError, KeyError) as error:
        problem = (
            "the last history part could not be checked for a sample it split, or that sample "
            f"could not be marked as partly written ({error_said(error)})"
        )
        return dataclasses.replace(state, live_problems=(*state.live_problems, problem))
    return state


def _remove_temporaries(directory: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Delete leftovers of the library's interrupted atomic writes (the caller holds the lock):
    those deleted, and those that could not be, with why (never raised: the finish goes on and
    says what it cannot write either)."""
    removed: list[Path] = []
    kept: list[tuple[Path, str]] = []
    candidates = list(directory.iterdir())
    if (directory / PARTS_DIR).is_dir():
        candidates += list((directory / PARTS_DIR).iterdir())
    found = [p for p in candidates if p.is_file() and is_library_temporary(p)]
    found += [directory / n for n in (MERGE_TMP_DIR, PARTS_GONE_DIR) if (directory / n).is_dir()]
    for path in found:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as error:
            kept.append((path, error_said(error)))
        else:
            removed.append(path)
    return removed, kept


__all__ = [
    "FINISH_STEPS",
    "FinishReport",
    "finalize",
    "finish_run",
    "mark_partly_written_sample",
]
