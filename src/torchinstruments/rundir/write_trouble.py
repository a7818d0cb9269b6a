"""The run's write trouble: why a live run records nothing to its directory, kept in `.lock`.

Design decision: a run whose directory stops taking writes (made read-only, a full disk) keeps
going, its rows waiting in memory up to `max_buffered_rows` and the newer ones dropped and
counted, but its state file, written by a temporary renamed into place, can no longer say so:
it said "in progress" as it did before the trouble, and `show` and `compare` told the user the
run was going on, with the why only in the writer's warnings. So while its writes fail, the
run says it where it can still write: its lock file, through a descriptor opened once at the
start (as `rundir.id_mark` writes the ids there), one `os.pwrite` over bytes laid down at the
start (so it needs no room on a full disk, nor a writable folder). Readers read it beside the
state file's "in progress" (`read_trouble`): "in progress, but recording nothing to disk since
T (why)" while the writer lives, and why it stopped when its lock is free. A write that works
again blanks it (the state file then holds the ledger), a new attempt's start blanks it, and
it is read only while the state file says "in progress", so a run finished or finalized since
never shows it. The cost: one system call when the trouble begins or ends or its words change,
nothing per sample. The line is ASCII text, `TROUBLE_BYTES` long, blank when there is none.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from torchinstruments.rundir.id_mark import MARK_BYTES, MARK_OFFSET
from torchinstruments.rundir.layout import PARTS_DIR, STATE_FILE
from torchinstruments.rundir.lock_line import LockLine, read_line

if TYPE_CHECKING:
    from torchinstruments.history_config import HistoryConfig
    from torchinstruments.rundir.writer import HistoryWriter

__all__ = [
    "TROUBLE_BYTES",
    "TROUBLE_OFFSET",
    "WriteTrouble",
    "finish_trouble",
    "parts_trouble",
    "read_trouble",
]

# After the id mark (`rundir.id_mark`), which follows the holder line (`rundir.lock`).
TROUBLE_OFFSET = MARK_OFFSET + MARK_BYTES
TROUBLE_BYTES = 512
_BLANK = b" " * (TROUBLE_BYTES - 1) + b"\n"


def _line(text: str) -> bytes:
    """`text` as the line's bytes: ASCII (others escaped), cut to fit, padded."""
    data = " ".join(text.split()).encode("ascii", "backslashreplace")[: TROUBLE_BYTES - 1]
    return data.ljust(TROUBLE_BYTES - 1) + b"\n"


def parts_trouble(history: HistoryWriter, config: HistoryConfig) -> str | None:
    """The trouble of a run whose part writes fail now (None while they work)."""
    error = history.failing_error
    if error is None:
        return None
    return (
        f"no {PARTS_DIR}/ part could be written ({error}); its rows wait in memory (at most "
        f"max_buffered_rows={config.buffered_rows_cap}), newer ones are dropped and counted, and all of them are "
        "lost if the process ends before a write succeeds"
    )


def finish_trouble(problems: tuple[str, ...]) -> str | None:
    """The trouble of a run whose removal could not write its final state (`problems`: the
    finish's), None where it could."""
    failed = [p for p in problems if p.startswith(f"{STATE_FILE} could not be written")]
    if not failed:
        return None
    return (
        f"remove_observer ended the run, but its {failed[0]}: its counts and losses are only "
        "in the process's warnings"
    )


def read_trouble(directory: Path) -> str | None:
    """The write trouble in `directory`'s lock file, as its writer last said it; None where
    there is none (or it cannot be read)."""
    data = read_line(directory, TROUBLE_OFFSET, TROUBLE_BYTES)
    text = "" if data is None else data.decode("ascii", "replace").strip()
    return text or None


class WriteTrouble:
    """The line a live run keeps in its lock file while its directory takes no writes."""

    def __init__(self) -> None:
        self._line = LockLine(TROUBLE_OFFSET)
        self._said: str | None = None  # what the line holds now (None: blank)
        self._since: str | None = None  # when the trouble began (UTC, seconds)
        self._guard = threading.Lock()  # the flush thread's saves and removal's close

    def open(self, directory: Path) -> None:
        """Open the lock file (the run holds its lock) and blank the line, so its bytes exist
        before any trouble; a failure leaves the run without it (never raised), as does a
        platform without `os.pwrite` (Windows), where the id mark is missing too."""
        with contextlib.suppress(OSError):
            self._line.open(directory)
            self._line.write(_BLANK)

    def update(self, why: str | None) -> None:
        """Say `why` the run records nothing to disk (the first time with when that began), or
        blank the line (`why` None: its writes work again). Never raises."""
        with self._guard:
            if why is None:
                self._since = None
            elif self._since is None:
                now = datetime.datetime.now(datetime.UTC)
                self._since = now.isoformat(timespec="seconds")
            text = None if why is None else f"since {self._since}: {why}"
            if text == self._said:
                return
            with contextlib.suppress(OSError):
                if self._line.write(_BLANK if text is None else _line(text)):
                    self._said = text

    def close(self, *, in_child: bool = False) -> None:
        """Close the descriptor (the line stays as it is; `LockLine.close`)."""
        self._line.close(in_child=in_child)
