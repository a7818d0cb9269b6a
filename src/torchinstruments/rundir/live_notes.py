"""The notes a live run has said so far, kept in its state file as they arise.

Design decision: notes reach index.md through the run state (`RunState.notes`). Those said
during a run (a trainer callback's at the fit's start, the fit's setup forwards, a measurement
note, a recording failure, a sink detached) lived in the process until removal, so a run killed
before it (SIGKILL) lost them, and `finalize` wrote an index.md that looked plainer than the run
was. The flush thread keeps them in the state file instead (`sinks.directory`): a note handed
to the run directory (`add`) makes a round due at once, and the notes kept elsewhere (the
observer's, another sink's: `follow`) are read at each round the rows make anyway; a round
writes the state only when the notes changed. The training step pays nothing for it (the flush
thread reads them), and a note's numbers are then as of its last round, as the rows are. A note
only removal knows (what was in flight then, the model changes) is removal's alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

__all__ = ["LiveNotes"]


def _none() -> tuple[str, ...]:
    return ()


class LiveNotes:
    """The run directory's own notes, the notes kept elsewhere, and which of them are saved.

    Args:
        retry_s: how long after a failed save of the state file the next one is due.
    """

    def __init__(self, retry_s: float) -> None:
        self._own: list[str] = []  # appended by any thread; read whole (a copy) by the flush's
        self._elsewhere: Callable[[], tuple[str, ...]] = _none
        self._read: tuple[str, ...] = ()  # the notes kept elsewhere, as last read
        self._saved: tuple[str, ...] = ()  # the notes the state file holds
        self._own_saved = 0  # how many of `_own` it holds
        self._retry_at = 0.0  # monotonic: a failed save is tried again from then on
        self._retry_s = retry_s

    def add(self, note: str) -> bool:
        """Keep `note` (once: the same sentence said twice is one note); True when new."""
        if note in self._own:
            return False
        self._own.append(note)
        return True

    def follow(self, elsewhere: Callable[[], tuple[str, ...]]) -> None:
        """Read the notes kept elsewhere with `elsewhere()` at each round from now on; a call
        that raises (read while another thread changes them) keeps the last ones read."""
        self._elsewhere = elsewhere

    def own(self) -> tuple[str, ...]:
        """The notes handed to the run directory, in the order said."""
        return tuple(self._own)

    def now(self) -> tuple[tuple[str, ...], int]:
        """The notes kept elsewhere as they stand, then the run directory's own; with how many
        of its own there are (for `saved`)."""
        # a dict that changed size as it was read raises: the next round reads it again
        with contextlib.suppress(Exception):
            self._read = tuple(self._elsewhere())
        own = self.own()
        return (*self._read, *own), len(own)

    def changed(self, notes: tuple[str, ...]) -> bool:
        """Whether `notes` differ from those the state file holds."""
        return notes != self._saved

    def saved(self, notes: tuple[str, ...], own: int) -> None:
        """The state file holds `notes`, `own` of them the run directory's own."""
        self._saved, self._own_saved = notes, own

    def not_saved(self) -> None:
        """Writing the state file failed: the next save is due after `retry_s`."""
        self._retry_at = time.monotonic() + self._retry_s

    def seconds_until_due(self) -> float | None:
        """0 (or until the retry) while a note of the run directory's own is not saved; None
        when nothing of its own waits (the notes kept elsewhere wait for the rows' rounds)."""
        if len(self._own) <= self._own_saved:
            return None
        return max(self._retry_at - time.monotonic(), 0.0)
