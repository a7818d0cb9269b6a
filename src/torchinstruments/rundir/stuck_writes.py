"""Writes this process gave up while their thread still holds a run's lock: what a refusal says.

Design decision: a write that never returns (a file system that stopped answering) cannot be
interrupted. Removal's finish gives such a write up and returns (`rundir.finishing`), and so
does `inject_observer` for its own first writes, while the thread writing it keeps the run's
lock until the write returns, so that nothing else writes the directory beside it. The same
process asking for that directory again (a notebook cell run again, a job step retried) then
finds the lock held by its own pid; without this record it was told that a model observed here
was not removed, or to wait for remove_observer, which the user had already called. So each
give-up is recorded here, by directory, for as long as its thread has not ended, and the lock's
refusals (`rundir.lock`, `rundir.live_refusal`) read it to say which write is stuck, that it
was given up, and what to do.

The one piece of process-wide state in this module mirrors a process-wide fact: the threads it
describes are this process's. A forked child starts with an empty record, since those threads
do not exist there.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torchinstruments.rundir.shell import literal_if_unclear

__all__ = ["Progress", "StuckWrite", "record", "stuck_in"]


class Progress(Protocol):
    """The thread of a given-up write, as the record reads it (`rundir.finishing.Finishing`)."""

    @property
    def step(self) -> str:
        """The file (or step) it is writing now."""
        ...

    @property
    def done(self) -> bool:
        """Whether it has ended (and released the lock)."""
        ...


@dataclass(frozen=True)
class StuckWrite:
    """One write given up while its thread holds the run's lock.

    Attributes:
        what: whose writes they are, e.g. "remove_observer's finish of the run".
        progress: the thread writing them.
        waited_s: how long the write was waited for before it was given up.
        not_written: the files not written when it was given up.
        advice: what to do once the lock is released (a command, resume=True).
        given_up_at: when it was given up (UTC, to the second).
    """

    what: str
    progress: Progress
    waited_s: float
    not_written: tuple[str, ...]
    advice: str
    given_up_at: str = ""

    def describe(self, directory: Path) -> str:
        """Why this process holds `directory`'s lock, and what to do: a refusal's reason."""
        return (
            f"{self.what} in this process (pid {os.getpid()}) was given up at "
            f"{self.given_up_at} UTC, after a write had not returned in {self.waited_s:g} s (a "
            "file system that stopped answering?), and its thread still waits on "
            f"{self.progress.step}: it holds the run's lock until that returns. Not "
            f"written: {', '.join(self.not_written)}. Wait for the write to return (check the "
            f"disk or file system under {literal_if_unclear(str(directory))}), or pass another "
            "output_dir; "
            f"{self.advice}"
        )


_STUCK: dict[Path, StuckWrite] = {}
_GUARD = threading.Lock()  # the record is read and written from any thread


def _key(directory: Path) -> Path:
    """One key per directory however it was spelled (both are absolute in the library)."""
    return Path(os.path.abspath(directory))


def record(directory: Path, stuck: StuckWrite) -> None:
    """Record that `stuck` was given up in `directory` (it drops out once its thread ended)."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    stuck = stuck if stuck.given_up_at else dataclasses.replace(stuck, given_up_at=now)
    with _GUARD:
        _STUCK[_key(directory)] = stuck


def stuck_in(directory: Path) -> StuckWrite | None:
    """The given-up write of this process that still holds `directory`'s lock, if any."""
    key = _key(directory)
    with _GUARD:
        stuck = _STUCK.get(key)
        if stuck is not None and stuck.progress.done:
            del _STUCK[key]
            return None
        return stuck


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: none of their writes holds a lock here."""
    _STUCK.clear()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
