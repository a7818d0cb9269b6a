"""Dispatch: records fanned out to every sink, a sink that raises reported once and detached.

Telemetry must never break the training step, and one broken sink must not silence the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchinstruments.notices import warn
from torchinstruments.records import RunCounts, RunInfo, SampleRecord
from torchinstruments.sinks.directory import DirectorySink
from torchinstruments.sinks.protocol import Sink

__all__ = ["SinkGroup"]


class SinkGroup:
    """Fans records out to sinks, detaching any sink that raises after one warning."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._sinks: list[Sink] = list(sinks)

    def insert_started(self, sink: Sink) -> None:
        """Put an already started sink first (the directory, whose start must raise, not warn)."""
        self._sinks.insert(0, sink)

    def _call(self, method: str, argument: Any) -> None:
        """Call `method(argument)` on every attached sink, isolating failures."""
        for sink in list(self._sinks):
            try:
                getattr(sink, method)(argument)
            except Exception as error:
                self._sinks.remove(sink)
                warn(
                    f"torchinstruments: sink {sink!r} raised {type(error).__name__}: {error} in "
                    f"{method}(); it is detached and the other sinks go on"
                )

    def start(self, run: RunInfo) -> None:
        self._call("start", run)

    def add_note(self, note: str) -> None:
        """Hand a note to the sinks that keep notes (the run directory)."""
        for sink in self._sinks:
            if isinstance(sink, DirectorySink):
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

    def close(self, counts: RunCounts) -> None:
        self._call("close", counts)
        self._sinks.clear()
