"""The Sink protocol: what an extension point receives, in four lifecycle calls, and its check.

A sink receives plain records (`records.SampleRecord`), never tensors. `check_sinks` runs at
`inject_observer`, so an object that lacks a method fails there, naming the argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torchinstruments.records import RunCounts, RunInfo, SampleRecord

__all__ = ["SINK_METHODS", "NoteKeeper", "Sink", "check_sinks"]


@runtime_checkable
class Sink(Protocol):
    """Receives what the observer records, in order: start, samples..., close.

    Each call runs on the thread that runs the step (a sample's records as its forward or
    backward ends): one that raises is detached, one that blocks blocks the step, so slow work
    (a network call) belongs on a thread of the sink's own, behind a bounded queue."""

    def start(self, run: RunInfo) -> None:
        """Called once at `inject_observer`, before any sample."""
        ...

    def write_forward(self, record: SampleRecord) -> None:
        """Called once per sampled root forward, after its one host transfer."""
        ...

    def write_backward(self, record: SampleRecord) -> None:
        """Called once per sample whose output gradients arrived in a backward pass."""
        ...

    def close(self, counts: RunCounts) -> None:
        """Called once at `remove_observer`; the last call a sink receives."""
        ...


@runtime_checkable
class NoteKeeper(Protocol):
    """A sink that says something of the run while it goes on (a trainer callback's sink, on
    what it learns from the samples): the run directory's flush thread reads the note at each
    of its rounds and keeps it in the run state, so a run killed before removal still says it
    (`rundir.live_notes`). Its final word, if any, is the owner's to give at removal; a run
    closed without it (a fit that ended unseen by its callback, finished by the observer's
    finalizer) keeps the note as of its close (`SinkGroup.close`)."""

    def note_so_far(self) -> str | None:
        """The note as of now, or None while there is nothing to say, or once the owner gave
        its final word; must not block."""
        ...


SINK_METHODS = ("start", "write_forward", "write_backward", "close")


def check_sinks(sinks: object) -> tuple[Sink, ...]:
    """Check `sinks` at inject time: a sequence of objects with the four Sink methods.

    A class is refused, as `sampler=` and `reducers=` refuse one: its methods are callable
    too, so `sinks=[MySink]` passed this check and was detached with a warning at the run's
    start (`start()` missing its argument), a run without the sink the user asked for. One
    sink not in a sequence is refused saying to put it in a list, and one listed twice (it
    received every record, its start and its close twice) is refused naming both places."""
    if isinstance(sinks, str | bytes) or not isinstance(sinks, Sequence):
        hint = ""
        if all(callable(getattr(sinks, name, None)) for name in SINK_METHODS):
            hint = ": pass one sink in a list, sinks=[sink]"
        raise TypeError(f"sinks must be a sequence of Sink objects, got {sinks!r}{hint}")
    for index, sink in enumerate(sinks):
        first = next(i for i, other in enumerate(sinks) if other is sink)
        if first != index:  # it would receive each record twice, and start and close twice
            raise TypeError(
                f"sinks[{index}] is sinks[{first}] again ({sink!r}): a sink listed twice would "
                "receive every record twice; list each sink once"
            )
        if isinstance(sink, type):
            raise TypeError(
                f"sinks[{index}] is the class {sink.__name__}, not a Sink: instantiate it, e.g. "
                f"sinks=[{sink.__name__}(...)]"
            )
        missing = [name for name in SINK_METHODS if not callable(getattr(sink, name, None))]
        if missing:
            raise TypeError(
                f"sinks: {sink!r} is not a Sink; it lacks {', '.join(missing)} "
                f"(a Sink has {', '.join(SINK_METHODS)})"
            )
    return tuple(sinks)
