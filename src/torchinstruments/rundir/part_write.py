"""How a history part write ends: put in place (until the run gives part writes up), or raised.

Design decision: a part write that never returns (a network file system that stopped answering)
cannot be interrupted, so removal stops waiting for it (`rundir.flush_timer.FlushTimer.finish`)
and counts its rows as not written. If that write returned later and its part appeared in
`history.parts/`, the rows would be in the ledger and in a part both, and a later `finalize`
would merge them: the run's counts would no longer add up. So a part's rename and its rows
leaving the buffer happen under one lock, and `give_up` takes that lock to close the door: a
write that returns afterwards finds it closed and deletes its temporary (`replace_atomically`
removes it when the rename raises). Exact unless the rename itself is what stalls: `give_up`
waits for it only so long, and such a part may still appear. The run directory's flush thread
saves the loss ledger into the state file and index.md through a door of its own
(`sinks.directory`), closed at removal, so a save that returns later never replaces the final
state.

What a part write raises stays in the writer (`rundir.writer`), except a KeyboardInterrupt or
SystemExit on the main thread (`ours_to_raise`): Polars raises a KeyboardInterrupt in every
thread inside a Polars call when SIGINT arrives, so one off the main thread is not the user's
Ctrl-C, and the write is tried again (`INTERRUPTED_TRIES`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import polars as pl

__all__ = [
    "INTERRUPTED_TRIES",
    "GivenUpError",
    "PartLanding",
    "ours_to_raise",
    "write_until_it_ends",
]

# How often a part write interrupted by a KeyboardInterrupt off the main thread is tried at once.
INTERRUPTED_TRIES = 5


class GivenUpError(Exception):
    """A part write returned after its run gave it up: the part was not put in place."""


class PartLanding:
    """The door between a written part's temporary and `history.parts/` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a rename and its rows leaving the buffer; before theirs
        self.given_up: str | None = None  # why no part is put in place any more

    def rename(self, tmp: Path, final: Path, written: Callable[[], None]) -> None:
        """Put `tmp` in place as `final` and call `written` (the rows leave the buffer), both
        under the lock.

        Raises:
            GivenUpError: the run gave part writes up; nothing was renamed.
        """
        with self._lock:
            if self.given_up is not None:
                raise GivenUpError(self.given_up)
            os.replace(tmp, final)
            written()

    def give_up(self, why: str, wait_s: float) -> bool:
        """Put no part in place from now on, for the reason `why`.

        Returns:
            False when a rename in progress had not returned after `wait_s` (its part may still
            appear); True when no part can appear any more.
        """
        closed = self._lock.acquire(timeout=wait_s)
        self.given_up = why
        if closed:
            self._lock.release()
        return closed


def ours_to_raise(exc: BaseException) -> bool:
    """Whether `exc` must reach the caller: a KeyboardInterrupt or SystemExit on the main
    thread (the user's Ctrl-C, or an exit), never one on a library thread."""
    if isinstance(exc, Exception):
        return False
    return threading.current_thread() is threading.main_thread()


def write_until_it_ends(
    path: Path,
    write: Callable[[], None],
    written: Callable[[], None],
    failed: Callable[[BaseException], None],
) -> bool:
    """Run `write` (a part's write to `path`, whose rename calls `written`) until it ends.

    Returns:
        True when the part is in place (`written` called, here where the write skipped it);
        False when it was given up (counted lost at removal) or failed (`failed` told).

    Raises:
        KeyboardInterrupt, SystemExit: on the main thread (`ours_to_raise`), after `written`
            where the part was already in place. One off the main thread is tried again, up to
            `INTERRUPTED_TRIES` times; any other exception is a failed write.
    """
    tries = 0
    while True:
        try:
            write()
        except GivenUpError:  # returned after removal gave it up: counted lost there
            return False
        except (OSError, pl.exceptions.PolarsError) as exc:
            # Polars reports a full disk as ComputeError ("No space left on device").
            failed(exc)
            return False
        except BaseException as exc:
            if path.is_file():  # in place before it was raised: written
                written()
                if ours_to_raise(exc):
                    raise
                return True
            if ours_to_raise(exc):
                raise
            tries += 1
            if isinstance(exc, KeyboardInterrupt) and tries < INTERRUPTED_TRIES:
                continue
            failed(exc)
            return False
        written()  # once: a write function that skipped `rename` left it to here
        return True
