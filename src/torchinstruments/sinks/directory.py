"""The run directory as a sink: history parts and merge, result.json, index.md, TensorBoard events.

It is always the first sink, so custom sinks see exactly what the directory writes; its `start`
raises (a directory that cannot be opened refuses the run), where other sinks only warn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

from torchinstruments import forks
from torchinstruments.events import EventFile, missing_histograms
from torchinstruments.history_config import HistoryConfig
from torchinstruments.notices import warn
from torchinstruments.reasons import utf8_text
from torchinstruments.records import RunCounts, RunInfo, SampleRecord
from torchinstruments.rundir import reserve
from torchinstruments.rundir.attempt_states import BY_RESUME, job_state, start_state
from torchinstruments.rundir.attempts import Continuation, attempt_notes
from torchinstruments.rundir.finishing import Finishing
from torchinstruments.rundir.flush_timer import FlushTimer, earliest_due
from torchinstruments.rundir.gone import gone_warning, is_gone
from torchinstruments.rundir.id_mark import IdMark
from torchinstruments.rundir.index_page import write_index
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    INDEX_FILE,
    PARTS_DIR,
    RESULT_FILE,
    STATE_FILE,
    TENSORBOARD_DIR,
)
from torchinstruments.rundir.ledger import LostRows
from torchinstruments.rundir.live_notes import LiveNotes
from torchinstruments.rundir.live_refusal import refuse_a_live_run
from torchinstruments.rundir.live_scales import LiveScales
from torchinstruments.rundir.lock import RunLock
from torchinstruments.rundir.opening import open_within
from torchinstruments.rundir.output_dir import check_output_dir
from torchinstruments.rundir.page_ranks import is_rank_run
from torchinstruments.rundir.parent_rewrite import rewrite_parent_soon
from torchinstruments.rundir.part_write import GivenUpError, PartLanding
from torchinstruments.rundir.reserve import RESERVE_FILE
from torchinstruments.rundir.resume import holds_run, open_continuation_within
from torchinstruments.rundir.shell import error_said, literal_if_unclear
from torchinstruments.rundir.signals import TermFlush
from torchinstruments.rundir.state import LAST_PARTS, RunState, write_state
from torchinstruments.rundir.summary import write_catalog
from torchinstruments.rundir.write_trouble import WriteTrouble, finish_trouble, parts_trouble
from torchinstruments.rundir.writer import HistoryWriter
from torchinstruments.sinks.given_up import (
    MERGE_ROWS_PER_S,
    finish_bound,
    finish_work,
    give_up_writes,
    said_of_finish,
)
from torchinstruments.sinks.missing import MissingCount

__all__ = ["DirectorySink"]

# The least time removal waits for a part write that does not return (module `removal_wait_s`),
# and the time a training step waits for the run's first rows (`_write_first_rows`).
MIN_REMOVAL_WAIT_S = 10.0
# The temporary-name tag of the flush thread's saves of the state file and index.md.
SAVE_TAG = "flush"
# How long inject waits for the parent page a rank's run rewrites at its start
# (`parent_rewrite.rewrite_parent_soon`): as long as a training step waits for the run's first rows.
PAGE_WAIT_S = MIN_REMOVAL_WAIT_S


def removal_wait_s(config: HistoryConfig) -> float:
    """How long removal waits for the flush thread's last part write before it gives it up: a
    flush interval, at least `MIN_REMOVAL_WAIT_S`. Removal runs once, so a slow but working
    disk gets time to finish (a part of the default 65,536 rows takes well under a second on
    a local one) even where `flush_seconds` is short; one that stopped answering costs that
    long, not the process (`rundir.flush_timer`)."""
    return max(config.flush_seconds, MIN_REMOVAL_WAIT_S)


class DirectorySink:
    """Owns the run directory: history parts and merge, result.json, index.md, TensorBoard events.

    Holds `RunLock` on the directory for the life of the run, which is how
    `torchinstruments finalize` tells a live run from an interrupted one.

    Crash safety: a `FlushTimer` thread writes each full `buffer_rows` chunk as a part, and the
    buffered rows with the TensorBoard events once the oldest of them is half a flush interval old
    (see `rundir.writer`), so a crash loses at most `HistoryConfig.flush_seconds` of history and the
    events agree with the history to the same bound. A SIGTERM handler (`rundir.signals`, when
    inject runs in the main thread) has that thread write everything first, then chains.

    A failing TensorBoard step (creating, writing, flushing or closing the event file) is warned
    once and given up; the history goes on, and index.md lists the failure. At removal the
    flush thread writes the last rows, and a part write that has not returned after
    `removal_wait_s` is given up (`sinks.given_up`): removal never waits on a stalled disk.
    """

    def __init__(self, directory: Path, history_config: HistoryConfig) -> None:
        self.directory = directory
        self._config = history_config
        self._lock = RunLock(directory)
        # The ids after every sample taken, in the lock file (`rundir.id_mark`): the observer's
        # counter advances it (`ids_taken`), so a resume=True after a kill never reuses them.
        self._ids = IdMark(self._say_problem)
        self.ids_taken = self._ids.advance
        self._trouble = WriteTrouble()  # why nothing reaches the directory, told in `.lock`
        self._run: RunInfo | None = None
        self._history: HistoryWriter | None = None
        self._events: EventFile | None = None
        self._events_problem: str | None = None
        self._timer: FlushTimer | None = None
        self._term: TermFlush | None = None
        # Notes and loss scales, kept in the state file as they arise (`rundir.live_notes`,
        # `rundir.live_scales`: the run has it follow `LossScales.spans`).
        self._notes = LiveNotes(history_config.flush_seconds / 2)
        self.live_scales = LiveScales()  # with the earlier attempts' from `open_run` on
        self._in_flight: list[int] = []  # samples in flight at removal (`removed_in_flight`)
        self._focus: frozenset[str] = frozenset()
        self._missing = MissingCount()  # focus tensors without a histogram
        self._flush_warned = False
        # The door between the flush thread's saves of the ledger and the state file: closed at
        # removal, so a save that returns after it never replaces the final state.
        self._saves = PartLanding()
        self._saved_losses: tuple[LostRows, ...] = ()  # the ledger and live problems the
        self._saved_problems: tuple[str, ...] = ()  # state file holds (`_save_state`)
        self._saved_step: str | None = None  # and the removal step it holds (`LAST_PARTS`)
        self._first_written: set[str] = set()  # signals whose first record was written at once
        self._first_stalled = False  # a write of first rows was not waited for to the end
        self._handed_over = False  # removal's finish (and the lock) went to its own thread
        # A continued run's plan and earlier state (`start` with resume); None for a new run.
        self._continuation: Continuation | None = None
        self._previous: RunState | None = None
        self._base: RunState | None = None  # the state written at start; finishes build on it
        self._page: Finishing[None] | None = None  # a rank's parent page rewritten at its start

    def start(self, run: RunInfo) -> None:
        """The Sink call: `open_run` for a new run."""
        self.open_run(run)

    def open_run(
        self, run: RunInfo, *, resume: bool = False, continued_by: str = BY_RESUME
    ) -> Continuation | None:
        """Refuse a directory that already holds a run (unless `resume`: then finalize its
        earlier attempt and continue it, `rundir.resume`; the state records `continued_by`,
        who asked), then lock it and write the catalog, each write waited for only so long
        (`_open_files`).

        Returns:
            Where this attempt's ids start when it continues a run, else None.
        """
        continuation, previous = None, None
        if resume and holds_run(self.directory):
            forks.opened_a_run()  # finalizing the earlier attempt uses Polars, which a fork breaks
            wait_s = removal_wait_s(self._config)
            continuation, previous = open_continuation_within(
                self.directory, run, wait_s, MERGE_ROWS_PER_S
            )
        self._run = run
        self._focus = frozenset(run.focus_layers)
        self._continuation, self._previous = continuation, previous
        self._base = state = start_state(run, continuation, previous, continued_by)
        self.live_scales = LiveScales(state.loss_scales)
        forks.track(self)  # from here until the lock is released
        self._open_files(run, state, continuation)
        c = continuation
        self._ids.open(
            self.directory,
            0 if c is None else c.first_sample_id,
            0 if c is None else c.first_forward_index,
        )
        self._trouble.open(self.directory)
        self._saved_problems = state.live_problems
        history = self._history
        assert history is not None  # the opening's first write
        self._events = self._open_events()
        self._timer = FlushTimer(
            functools.partial(
                earliest_due, history.seconds_until_due, self._notes.seconds_until_due
            ),
            self._flush,
            name=f"torchinstruments flush {self.directory}",
        )
        history.wake_writer = self._timer.poke  # a full buffer has it write at once
        self._term = TermFlush(self._timer.flush_now)
        self._term.install()
        return continuation

    def _open_files(self, run: RunInfo, state: RunState, continuation: Continuation | None) -> None:
        """Check the directory (a new run's), take its lock, make the history writer (its parts
        folder, the run's first file), write the catalog (a new run's), the state file, index.md
        and the reserve, each waited for `removal_wait_s` (`rundir.opening`): a directory that fails
        or does not answer is refused, naming output_dir, with nothing of this run left there
        but the lock file."""
        directory, fresh = self.directory, continuation is None

        def check() -> None:
            if not fresh:
                return
            try:
                check_output_dir(directory)
            except FileExistsError as refused:
                refuse_a_live_run(directory, run, refused)
                raise
            forks.opened_a_run()  # from here on the run uses Polars, whose pool a fork breaks

        refused: list[OSError] = []  # said here, on the caller's thread, at the user's line

        def hold_reserve() -> None:
            files = (directory / STATE_FILE, directory / INDEX_FILE)
            error = reserve.hold(directory, reserve.reserve_bytes(*files))
            refused.extend(() if error is None else (error,))

        # The parts folder first: a kill anywhere in the rest of inject leaves a run that
        # `finalize` completes and resume=True continues, never files that both refuse.
        writes: list[tuple[str, Callable[[], None]]] = [
            (f"{PARTS_DIR}/", functools.partial(self._make_history, state, continuation)),
            (STATE_FILE, lambda: write_state(directory, state)),
            (INDEX_FILE, lambda: write_index(directory, state)),
            (RESERVE_FILE, hold_reserve),
        ]
        if fresh:
            writes.insert(1, (RESULT_FILE, lambda: write_catalog(directory, run.layers)))
        open_within(
            directory,
            self._lock,
            check,
            writes,
            removal_wait_s(self._config),
            fresh=fresh,
            released=lambda: forks.untrack(self),
            restore=None
            if self._previous is None
            else functools.partial(_put_back, directory, self._previous),
        )
        if is_rank_run(directory, state):
            self._page = rewrite_parent_soon(directory, continued=not fresh, wait_s=PAGE_WAIT_S)
        for error in refused:
            self._say_problem(
                f"the disk reserve ({RESERVE_FILE}) could not be written at injection "
                f"({error_said(error)}): on a disk that fills up during the run, the "
                f"final {STATE_FILE} and {INDEX_FILE} may not fit, and the rows they would list "
                "as lost are then said only in warnings"
            )

    def _say_problem(self, note: str) -> None:
        """A problem of the run itself, said once by its caller: a note in index.md (saved by
        the flush thread as it arises) and a warning."""
        self.add_note(note[0].upper() + note[1:] + ".")
        warn(f"torchinstruments: {note}")

    def _make_history(self, state: RunState, continuation: Continuation | None) -> None:
        """This attempt's history writer (it makes the parts folder)."""
        self._history = HistoryWriter(
            self.directory,
            self._config,
            attempt=state.attempts[-1].attempt,
            first_part=0 if continuation is None else continuation.first_part,
            chunks_elsewhere=True,  # the flush thread writes them: the step never waits for a disk
        )

    def after_fork_in_child(self) -> None:
        """In a forked child: drop the child's copy of the lock descriptor; nothing else of this
        sink is used there (its threads do not exist in the child; see forks.py)."""
        self._ids.close(in_child=True)
        self._trouble.close(in_child=True)
        self._lock.forget()

    def _open_events(self) -> EventFile | None:
        """This directory's event writer; None (warned) when it cannot be created."""
        try:
            run = self._run
            types = {layer.name: layer.module_type for layer in run.layers} if run else {}
            return EventFile(
                str(self.directory / TENSORBOARD_DIR), self._config.flush_seconds / 2, types
            )
        except Exception as error:
            self._give_up_events("could not be created", error)
            return None

    def add_note(self, note: str) -> None:
        """Add a note to the run's state, e.g. how a fit ended: index.md shows it, and the flush
        thread saves it in the state file at once, so a run killed later keeps it."""
        timer = self._timer
        if self._notes.add(note) and timer is not None:
            timer.poke()

    def save_now(self) -> bool:
        """Have the flush thread write the buffered rows and the notes said so far now (a note
        first known mid-run, as a trainer callback's on a batch whose backward was skipped),
        waited for as the first rows are (`_flush_waited`); True when it was done."""
        return self._flush_waited("rows and notes")

    def follow_notes(self, notes: Callable[[], tuple[str, ...]]) -> None:
        """The run's notes kept elsewhere (the observer's, other sinks'), as they stand: each
        round of the flush thread reads them and saves them in the state file when they
        changed, so a run killed before removal keeps what they said by then."""
        self._notes.follow(notes)

    def removed_in_flight(self, sample_ids: list[int]) -> None:
        """The samples whose forward or backward ran when the run was removed: the run state
        records them, and index.md's state line says so from them."""
        self._in_flight += sample_ids

    def write_forward(self, record: SampleRecord) -> None:
        self._write(record)

    def write_backward(self, record: SampleRecord) -> None:
        self._write(record)

    def _write(self, record: SampleRecord) -> None:
        """Append the rows; histograms go to this directory's own event file.

        Never raises, so the group never detaches the directory: the history writer keeps rows it
        could not write, and a failing event file is reported once and given up.
        """
        if self._history is not None:
            self._history.append(record.measurements)
            if record.signal not in self._first_written:
                self._first_written.add(record.signal)
                self._write_first_rows(record.signal)
            if self._timer is not None:
                self._timer.poke()
        events = self._events
        if events is not None:
            missing = missing_histograms(record, self._focus)
            try:
                events.add_histograms(record.histograms, record.forward_index, record.measurements)
                events.add_missing(missing, record.forward_index)
            except Exception as error:
                self._give_up_events("could not be written", error)
            if missing:
                self._missing.add(missing, record.forward_index)

    def _write_first_rows(self, signal: str) -> None:
        """The run's first forward rows (and first backward rows) go to disk at once, so a run
        killed right after its first sample has its rows; later ones wait for a part's triggers
        (buffer_rows, half the flush interval). The flush thread writes them, and this one (the
        training step) waits at most `MIN_REMOVAL_WAIT_S`: a write of its own would block the
        step for good on a file system that stopped answering. Not `removal_wait_s`, which
        grows with `flush_seconds` (60 s by default) because removal runs once and a slow disk
        must not cost the run its last rows there: here a write not waited for to its end
        costs nothing but the warning (its rows land when it returns), while each second
        waited is the user's training step standing still. A write that has not returned by
        then is left to go on (warned once, never waited for again): the rows stay in memory,
        and those still there at removal are counted as not written, with why, in index.md."""
        self._flush_waited(f"first {signal} rows")

    def _flush_waited(self, what: str) -> bool:
        """Have the flush thread write everything now and wait for it at most
        `MIN_REMOVAL_WAIT_S` (`_write_first_rows` says why no longer); True when it was done.
        After one such write stalled, the thread is only woken: the step never waits twice."""
        timer = self._timer
        if timer is None:
            return False
        if self._first_stalled:
            timer.poke()
            return False
        wait_s = MIN_REMOVAL_WAIT_S
        if timer.flush_now(wait_s):
            return True
        self._first_stalled = True
        warn(
            f"torchinstruments: the run's {what} were not on disk after {wait_s:g} s "
            "(a history part write under "
            f"{literal_if_unclear(str(self.directory))} has not returned: a file system that "
            "stopped answering?); training goes on without waiting for it, and the rows stay in "
            "memory until a write succeeds (those still there at removal are counted as not "
            "written, with why, in index.md)"
        )
        return False

    def _flush(self, everything: bool) -> None:
        """Write the buffered rows that are due (`everything`: all of them), then new losses
        into the state file and index.md, then, unless only full chunks were due, flush the
        events (the flush thread's one job): they keep to the time bound, not to each part."""
        aged = True
        history = self._history
        try:
            if history is not None:
                if everything:
                    # The small state file first: on a nearly full disk the backlog may take
                    # the last bytes, and the ledger of the rows already dropped is then on disk.
                    self._save_state(history, now=True)
                    history.flush()
                else:
                    aged = history.write_due()
                self._save_state(history)
                self._trouble.update(parts_trouble(history, self._config))
        except BaseException as error:  # never let the flush thread die (see FlushTimer)
            if not self._flush_warned:
                self._flush_warned = True
                warn(
                    "torchinstruments: flushing history under "
                    f"{literal_if_unclear(str(self.directory))} failed "
                    f"({error_said(error)}); buffered rows stay in memory and are "
                    "retried. (Reported once.)"
                )
        events = self._events
        if events is not None and aged:
            try:
                events.flush()
            except BaseException as error:
                self._give_up_events("could not be flushed", error)

    def _save_state(self, history: HistoryWriter, *, now: bool = False) -> None:
        """Write the loss ledger into the state file (and index.md) as soon as parts can be
        written again (`now`: at once, even while they cannot), and the notes said so far and a
        TensorBoard failure whenever they changed; a failure is retried after half a flush
        interval. What a killed run said is then in the state `finalize` finishes it from."""
        base = self._base
        if base is None:
            return
        pending = history.unsaved_losses(now=now)
        notes, own = self._notes.now()
        notes = self._labelled(tuple(dict.fromkeys((*notes, *self._missing.note()))))
        problems = tuple(p for p in (*base.live_problems, self._events_problem) if p)
        scales, saved = self.live_scales.now(), (self._saved_problems, self._saved_step)
        fresh = self._notes.changed(notes) or (problems, base.removal_step) != saved
        fresh = fresh or self.live_scales.changed(scales)
        if pending is None and not fresh:
            self._notes.saved(notes, own)  # a note said again: nothing new to write
            return
        version, losses = (None, self._saved_losses) if pending is None else pending
        state = dataclasses.replace(
            base,
            losses=(*base.losses, *losses),
            notes=(*base.notes, *notes),
            live_problems=problems,
            loss_scales=scales,
        )
        door = functools.partial(self._saves.rename, written=_nothing)
        try:  # temporaries of their own: removal's finish may write these files beside a stuck save
            write_state(self.directory, state, door, SAVE_TAG)
            write_index(self.directory, state, door, SAVE_TAG)
        except GivenUpError:  # removal finished the run meanwhile: its state stands
            return
        except OSError:
            if version is not None:
                history.losses_not_saved()
            self._notes.not_saved()
            return
        if version is not None:
            history.losses_saved(version)
        self._saved_losses, self._saved_problems = losses, problems
        self._saved_step = base.removal_step
        self._notes.saved(notes, own)
        self.live_scales.saved(scales)

    def _labelled(self, notes: tuple[str, ...]) -> tuple[str, ...]:
        """`notes` (this attempt's), each naming the attempt when the run has several, and
        each as UTF-8 files hold it (a note quoting an error may carry lone surrogates)."""
        notes = tuple(utf8_text(note) for note in notes)
        if self._continuation is None:
            return notes
        return attempt_notes(self._continuation.attempt, notes)

    def _final_state(self, counts: RunCounts, history: HistoryWriter) -> RunState:
        """The state `close` finishes the run with (`counts`: this attempt's)."""
        assert self._base is not None  # started
        state = job_state(
            self._base, self._previous, self._continuation, counts, history.rows_produced
        )
        known = (self._events_problem,) if self._events_problem else ()
        added = (*counts.notes, *self._notes.own(), *self._missing.note())
        added = self._labelled(tuple(dict.fromkeys(added)))  # a note said twice is one note
        return dataclasses.replace(
            state,
            live_problems=(*state.live_problems, *known),
            losses=(*state.losses, *history.losses),
            notes=(*state.notes, *added),
            removed_in_flight=tuple(sorted({*state.removed_in_flight, *self._in_flight})),
            removal_step=HISTORY_FILE,  # the finish writes it as removal's first step begins
        )

    def _give_up_events(self, what: str, error: BaseException) -> None:
        """Warn once, remember the failure for index.md, and close the event writer."""
        if self._events_problem is None:
            self._events_problem = (
                f"TensorBoard events under {TENSORBOARD_DIR}/ {what} ({error_said(error)}); "
                "histograms after that point are missing (the history is not affected)"
            )
            warn(
                f"torchinstruments: TensorBoard events under "
                f"{literal_if_unclear(str(self.directory / TENSORBOARD_DIR))} "
                f"{what} ({error_said(error)}); histograms are no longer written "
                "there, the history goes on"
            )
        events, self._events = self._events, None
        # A writer thread stuck in a write (`TimeoutError`: events.WriterStalledError) is left as it
        # is: closing waits for it. Its queue no longer grows, and its daemon thread ends with
        # the process.
        if events is not None and not isinstance(error, TimeoutError):
            with contextlib.suppress(Exception):
                events.close()

    def _close_events(self) -> None:
        """Close the event writer (and its flush thread); a failure is given up like any other."""
        events, self._events = self._events, None
        if events is not None:
            try:
                events.close()
            except Exception as error:
                self._give_up_events("could not be closed", error)

    def close(self, counts: RunCounts) -> None:
        """Finish the run with `rundir.finish.finish_run`; each problem is one warning.

        The history comes first: a failing TensorBoard or result.json step never prevents it.
        The finish runs on a thread of its own, each step waited for only so long
        (`_finish_within`); that thread releases the run's lock when it ends.
        """
        self._handed_over = False
        self._ids.close()  # no sample is taken from here on
        try:
            if self._term is not None:
                self._term.uninstall()
            history, run, timer = self._history, self._run, self._timer
            written = True
            if history is not None and timer is not None:  # both or neither (`open_run`)
                wait_s = removal_wait_s(self._config)
                if self._base is not None:  # its last save says removal began: a kill is one in it
                    self._base = dataclasses.replace(self._base, removal_step=LAST_PARTS)
                # The last rows are the flush thread's to write; each part landing is progress.
                if not timer.finish(wait_s, lambda: history.rows_written):
                    give_up_writes(self.directory, history, wait_s)
                written = history.close(write=False)  # the rest is in its loss ledger
                self._trouble.update(parts_trouble(history, self._config))
                self._saves.give_up("removal finishes the run", wait_s)
            self._close_events()
            if history is not None and run is not None:
                state = self._final_state(counts, history)
                if is_gone(self.directory):  # rm -rf mid-run: nothing to finish, nor finalize
                    warn(gone_warning(self.directory, state))
                else:
                    self._page_rendered()
                    self._finish_within(state, written)
        finally:
            self._events = None
            self._history = None
            self._timer = None
            self._term = None
            self._trouble.close()
            if not self._handed_over:  # else the finishing thread's (`_end_of_finish`)
                reserve.release(self.directory)
                self._lock.release()
                forks.untrack(self)

    def _page_rendered(self) -> None:
        """Wait (a flush interval at most) for the parent page's render this rank began at its
        start, should it still run: the finish's own ask would find its lock held and count on
        that thread to render again, which the process's exit may end first."""
        page, self._page = self._page, None
        if page is not None and not page.done:
            with contextlib.suppress(Exception):  # said at its start
                page.wait(lambda step: removal_wait_s(self._config))

    def _finish_within(self, state: RunState, written: bool) -> None:
        """Finish the run from `state` on a thread of its own (`rundir.finishing`), each step
        waited for only so long; a step given up is said (`sinks.given_up`)."""
        bound = finish_bound(removal_wait_s(self._config), state.rows_recorded)
        work = finish_work(self.directory, state, written)
        name = f"torchinstruments finish {self.directory}"
        finishing = Finishing(work, self._end_of_finish, name)
        self._handed_over = True  # the lock is the finishing thread's from here on
        report = finishing.wait(bound)
        if report is not None and (trouble := finish_trouble(report.state.problems)):
            self._trouble.update(trouble)  # readers see "in progress": its lock file says why
        said_of_finish(self.directory, finishing, report, bound, state, self._events_problem)

    def _end_of_finish(self) -> None:
        """The finishing thread's last act: the run's lock goes, and only then may a forked
        child keep its copy of the lock's descriptor (until then one is closed in the child,
        `after_fork_in_child`, or the child would hold the lock after this process ended)."""
        try:
            self._lock.release()
        finally:
            forks.untrack(self)


def _put_back(directory: Path, state: RunState) -> None:
    """A refused continuation's undo: the state file and index.md as the earlier attempts left
    them (`state`)."""
    write_state(directory, state)
    write_index(directory, state)


def _nothing() -> None:
    """A save's `written`: nothing leaves a buffer when the state file is in place."""
