"""Dispatch: records fanned out to every sink, a sink that raises reported once and detached.

Telemetry must never break the training step, and one broken sink must not silence the others.
A detached sink's records stop, so the run says which sink, when and why: a warning at once and a
note in index.md (the run directory's notes, the one way notes reach it). A sink that raises in
`close` is only warned about: every record reached it, and the run directory, closed before it,
is complete by then (a sink may read it at close).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchinstruments.notices import repr_of, warn
from torchinstruments.reasons import cut_message
from torchinstruments.records import RunCounts, RunInfo, SampleRecord
from torchinstruments.rundir.shell import error_said, literal_if_unclear
from torchinstruments.sinks.directory import DirectorySink
from torchinstruments.sinks.protocol import NoteKeeper, Sink
from torchinstruments.sinks.tensorboard import TensorBoardSink

__all__ = ["SinkGroup", "detached_note"]

# A sink's repr in index.md is cut to this many characters (index.md has a size budget).
_REPR_CHARS = 120
# The characters of a caller's sink's note kept on the page (index.md stays within 64 KiB; the
# library's own note keepers bound theirs far below this).
_NOTE_KEPT = 4000


class SinkGroup:
    """Fans records out to sinks, detaching any sink that raises after one warning."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._sinks: list[Sink] = list(sinks)
        # Notes said before the run directory joins the group (a sink that raised in `start`).
        self._pending_notes: list[str] = []
        # What each sink whose note could not be read said instead, by id (warned once, noted
        # at close: the flush thread reads notes too, and notes are added on the caller's).
        self._unread_notes: dict[int, str] = {}

    def holds(self, sink: object) -> bool:
        """Whether `sink` is one of the group's (attached, not detached)."""
        return any(held is sink for held in self._sinks)

    def insert_started(self, sink: Sink) -> None:
        """Put an already started sink first (the directory, whose start must raise, not warn)."""
        self._sinks.insert(0, sink)
        if isinstance(sink, DirectorySink):
            for note in self._pending_notes:
                sink.add_note(note)
            self._pending_notes.clear()

    def _call(self, method: str, argument: Any) -> None:
        """Call `method(argument)` on every attached sink, isolating failures."""
        for sink in list(self._sinks):
            try:
                getattr(sink, method)(argument)
            except Exception as error:
                self._sinks.remove(sink)
                warn(
                    f"torchinstruments: sink {repr_of(sink)} raised {error_said(error)} in "
                    f"{method}(); it is detached and the other sinks go on"
                )
                if method != "close":  # see the module docstring
                    self.add_note(detached_note(sink, method, argument, error))

    def start(self, run: RunInfo) -> None:
        self._call("start", run)

    def add_note(self, note: str) -> None:
        """Hand a note to the sinks that keep notes (the run directory), or keep it for the
        directory until it joins the group."""
        keepers = [sink for sink in self._sinks if isinstance(sink, DirectorySink)]
        if not keepers:
            self._pending_notes.append(note)
        for sink in keepers:
            sink.add_note(note)

    def removed_in_flight(self, sample_ids: list[int]) -> None:
        """Hand the samples in flight at removal to the sinks that keep the run state."""
        for sink in self._sinks:
            if isinstance(sink, DirectorySink):
                sink.removed_in_flight(sample_ids)

    def write_forward(self, record: SampleRecord) -> None:
        self._call("write_forward", record)

    def write_backward(self, record: SampleRecord) -> None:
        self._call("write_backward", record)

    def shared_step_notes(self) -> tuple[str, ...]:
        """The notes of the caller's TensorBoard sinks that left samples out so far
        (`TensorBoardSink.shared_step_note`): the run directory's flush thread reads them too,
        so a run killed before removal keeps them."""
        sinks = list(self._sinks)
        notes = (s.shared_step_note() for s in sinks if isinstance(s, TensorBoardSink))
        return tuple(note for note in notes if note)

    def live_notes(self) -> tuple[str, ...]:
        """What the caller's sinks said of the run so far, read by the run directory's flush
        thread for the run state (`rundir.live_notes`): the TensorBoard sinks' notes on the
        samples they left out, and each `NoteKeeper`'s note."""
        sinks = list(self._sinks)
        kept = (self._note_of(s) for s in sinks if isinstance(s, NoteKeeper))
        return (*self.shared_step_notes(), *(note for note in kept if note))

    def _note_of(self, sink: NoteKeeper) -> str | None:
        """`sink.note_so_far()`, or None where it raised or gave no str (warned once per sink):
        any sink of the caller's with such a method is a note keeper, and read unguarded, one
        that raised made remove_observer raise, and a number failed the run directory's close,
        each leaving the run "in progress"."""
        try:
            note = sink.note_so_far()
        except Exception as error:
            return self._unread(sink, f"raised {error_said(error)}")
        if note is None or isinstance(note, str):
            return None if note is None else cut_message(note, _NOTE_KEPT)
        return self._unread(
            sink, f"returned {_one_line(repr_of(note))} ({type(note).__name__}), not a str or None"
        )

    def _unread(self, sink: NoteKeeper, said: str) -> None:
        """Warn, once per sink, that its note could not be read; index.md says it at close."""
        if id(sink) not in self._unread_notes:
            note = f"sink {_one_line(repr_of(sink))} {said} in note_so_far(); its note is left out"
            self._unread_notes[id(sink)] = note
            warn(f"torchinstruments: {note}")

    def save_now(self) -> bool:
        """Have the run directory write its rows and the notes said so far now (a note first
        known mid-run); False when it did not within its wait (`DirectorySink.save_now`)."""
        sinks = list(self._sinks)
        return all(s.save_now() for s in sinks if isinstance(s, DirectorySink))

    def close(self, counts: RunCounts) -> None:
        """Close every sink, the run directory first, after the notes of the caller's
        TensorBoard sinks that left samples out (`TensorBoardSink.shared_step_note`) and those
        of its `NoteKeeper`s whose owner gave no final word (a run finished without its
        owner's end: what the run state said live is not dropped from the final one)."""
        kept = [self._note_of(s) for s in list(self._sinks) if isinstance(s, NoteKeeper)]
        unread = list(self._unread_notes.values())
        for note in (*self.shared_step_notes(), *(note for note in kept if note), *unread):
            self.add_note(note)
        self._call("close", counts)
        self._sinks.clear()


def _one_line(text: str) -> str:
    """A repr as a note quotes it: cut to `_REPR_CHARS`, as its literal where it holds a line
    break or an escape (a note is one line of index.md, of a bounded length)."""
    if len(text) > _REPR_CHARS:
        text = text[: _REPR_CHARS - 3] + "..."
    return literal_if_unclear(text)


def detached_note(sink: Sink, method: str, argument: object, error: Exception) -> str:
    """index.md's note on a sink detached after it raised: which sink, at which record, why.

    `argument` is what `method` was called with: a record names its sample and forward_index,
    the run's start comes before any sample.
    """
    shown = _one_line(repr_of(sink))
    if isinstance(argument, SampleRecord):
        when = (
            f"on the {argument.signal} record of sample {argument.sample_id} (forward_index "
            f"{argument.forward_index})"
        )
    else:
        when = "at the start of the run, before any sample"
    # One line (a note is one line of index.md), of a bounded length (the page too).
    return (
        f"sink {shown} raised {error_said(error)} in {method}() {when}; it was "
        "detached and received no later record (the run directory and the other sinks "
        "are not affected)."
    )
