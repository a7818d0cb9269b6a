"""The run lock: how `finalize` tells a live run from an interrupted one.

Design decision: a live run holds an exclusive, non-blocking OS lock on `<dir>/.lock` for its
whole life (`fcntl.flock` on POSIX, `msvcrt.locking` on Windows). The kernel drops the lock when
the process dies, even on SIGKILL, so "lock free" means exactly "no live writer": no PID files, no
staleness heuristics. Readers tell a live run from a dead one by taking the lock and dropping it
at once (`writer_ended`), so a run taking its lock retries for a moment (`PROBE_TRIES`) before it
calls the directory in use. The lock file also carries the run's id mark after its holder
line (`rundir.id_mark`), so taking the lock pads that line and keeps the rest. The cost:
advisory locks are unreliable on some network file systems, and the `.lock` file stays in the
directory (deleting a lock file races with a process that just opened it). The platform module is imported when a lock is taken, not when the package is imported, so
`import torchinstruments` works everywhere; where neither exists, the run is not locked and a
warning says so.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from pathlib import Path
from types import ModuleType, TracebackType

from torchinstruments.notices import warn
from torchinstruments.rundir.id_mark import MARK_OFFSET
from torchinstruments.rundir.layout import LOCK_FILE
from torchinstruments.rundir.shell import literal_if_unclear
from torchinstruments.rundir.stuck_writes import stuck_in

__all__ = [
    "FINALIZE",
    "RunLock",
    "RunLockedError",
    "live_writer",
    "writer_ended",
    "writer_ended_text",
]

# The holder a finalize writes into the lock file after its pid (a live run writes none).
FINALIZE = "torchinstruments finalize"


class RunLockedError(RuntimeError):
    """The run directory is locked by a live process."""


def _platform_locker() -> tuple[str, ModuleType] | None:
    """`("fcntl", module)`, `("msvcrt", module)`, or None where neither can be imported."""
    for name in ("fcntl", "msvcrt"):
        try:
            return name, importlib.import_module(name)
        except ImportError:
            continue
    return None


def _try_lock(fd: int, locker: tuple[str, ModuleType]) -> bool:
    """Take an exclusive lock without blocking; False if another process holds it."""
    name, module = locker
    try:
        if name == "fcntl":
            module.flock(fd, module.LOCK_EX | module.LOCK_NB)
        else:
            module.locking(fd, module.LK_NBLCK, 1)
    except (BlockingIOError, PermissionError):
        return False
    except OSError as error:  # msvcrt reports a held lock as EACCES / EDEADLK
        if name == "msvcrt":
            return False
        raise error
    return True


# A reader that tells a live run from a dead one (`writer_ended`: `show`, a parent's index.md)
# holds the lock between two system calls; a run or finalize taking it at that moment tries
# again this many times, PROBE_WAIT seconds apart, before it calls the directory in use.
PROBE_TRIES = 5
PROBE_WAIT = 0.02


def _taken(fd: int, locker: tuple[str, ModuleType]) -> bool:
    """`_try_lock`, tried again briefly: a reader's probe never makes a run refuse itself."""
    for attempt in range(PROBE_TRIES):
        if _try_lock(fd, locker):
            return True
        if attempt + 1 < PROBE_TRIES:
            time.sleep(PROBE_WAIT)
    return False


def _unlock(fd: int, locker: tuple[str, ModuleType]) -> None:
    """Release a lock taken by `_try_lock`."""
    name, module = locker
    with contextlib.suppress(OSError):
        if name == "fcntl":
            module.flock(fd, module.LOCK_UN)
        else:
            os.lseek(fd, 0, os.SEEK_SET)
            module.locking(fd, module.LK_UNLCK, 1)


class RunLock:
    """An exclusive, non-blocking lock on `directory/.lock`, held for the life of a run.

    Args:
        directory: the run's output directory (created by `acquire` if missing).
        holder: who takes it, written into the lock file after the pid so that a refusal can
            say who holds it: "" (a live run), or `FINALIZE` (a finalize completing it).

    Example:
        >>> with RunLock(Path("stats")):  # doctest: +SKIP
        ...     ...
    """

    def __init__(self, directory: Path, holder: str = "") -> None:
        self.path = directory / LOCK_FILE
        self._holder = holder
        self._fd: int | None = None
        self._locker: tuple[str, ModuleType] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock; idempotent for the holder.

        Raises:
            RunLockedError: if another process holds it.
        """
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        locker = _platform_locker()
        try:
            if locker is None:
                warn(
                    "torchinstruments: this platform has neither fcntl nor msvcrt, so the run "
                    f"directory {literal_if_unclear(str(self.path.parent))} is not locked; do not run finalize on it while "
                    "the run is live"
                )
            elif not _taken(fd, locker):
                raise RunLockedError(_refusal(self.path.parent, _read_holder(fd)))
            # Padded, never truncated: the run's id mark follows it (`rundir.id_mark`).
            line = f"{os.getpid()} {self._holder}".strip().encode()
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, line.ljust(MARK_OFFSET - 1)[: MARK_OFFSET - 1] + b"\n")
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._locker = fd, locker

    def release(self) -> None:
        """Drop the lock (no-op if not held)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            if self._locker is not None:
                _unlock(fd, self._locker)
            os.close(fd)

    def forget(self) -> None:
        """Close this process's descriptor without unlocking: in a forked child, whose copy of
        the descriptor shares the parent's lock (an unlock here would release it there)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _probe(directory: Path) -> str | bool | None:
    """Take `directory`'s run lock and drop it at once: False when it was free, the holder
    (`_read_holder`: " (pid N)" or "") when a live process holds it, None where it cannot be
    told (no lock file, no platform lock, a lock file this process cannot open, a lock call
    that fails: a file system without locks answers ENOLCK, which says nothing of the writer).
    """
    path = directory / LOCK_FILE
    locker = _platform_locker()
    if locker is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if _try_lock(fd, locker):
            _unlock(fd, locker)
            return False
        return _read_holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def live_writer(directory: Path) -> str | None:
    """` (pid N)` (or "" when unknown) if a live process holds `directory`'s run lock, else None.

    It takes the lock and drops it at once, so call it only on a directory that already holds a
    run: its writer took the lock before writing anything, so the probe cannot race its start.
    """
    held = _probe(directory)
    return held if isinstance(held, str) else None


def writer_ended(directory: Path) -> bool | None:
    """Whether the process that writes `directory`'s run has ended: True when no process holds
    its run lock (as `finalize` tells), False when one does, None where it cannot be told
    (`_probe`). Same caveat as `live_writer`: call it only on a directory that already holds a
    run."""
    held = _probe(directory)
    return None if held is None else held is False


def writer_ended_text() -> str:
    """`writer_ended` as plain Python, for index.md's queries (which run without the library;
    `Path` imported): the same probe, so a query tells a dead run's writer as every reader
    does, never "in progress" for a process that died. Where `fcntl` is missing it answers
    None, as `_probe` does without a platform lock."""
    return f'''def writer_ended(directory: Path) -> bool | None:
    """Whether the process writing a run has ended, as finalize tells it: True when no process
    holds its run lock (taken and dropped at once), False when one does, None where it cannot
    be told (no fcntl, no lock file, a file system without locks)."""
    try:
        import fcntl

        with open(directory / "{LOCK_FILE}", "r+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(lock, fcntl.LOCK_UN)
    except BlockingIOError:
        return False
    except (ImportError, OSError):
        return None
    return True'''


def _refusal(directory: Path, holder: str) -> str:
    """Why `directory`'s lock is refused: a write this process gave up still holds it
    (`rundir.stuck_writes`), or a live run, `holder` (its pid), writes there. The directory
    by index.md's rule (`literal_if_unclear`): the refusal reaches the user's traceback, where
    a line break in the name forged a line and an escape rewrote the terminal."""
    stuck, named = stuck_in(directory), literal_if_unclear(str(directory))
    if stuck is not None:
        return f"{named} is in use: {stuck.describe(directory)}"
    if holder.endswith(f", {FINALIZE})"):
        return (
            f"{named} is in use by a live process{holder}: a finalize is completing the run "
            "there. Wait for it to end."
        )
    return (
        f"{named} is in use by a live process{holder}: a run is still writing there. Wait "
        "for it to end (remove_observer) or stop it first."
    )


def _read_holder(fd: int) -> str:
    """` (pid N)` from the lock file, ` (pid N, torchinstruments finalize)` when a finalize
    holds it, or "" if unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        os.lseek(fd, 0, os.SEEK_SET)
        pid, *who = os.read(fd, 64).decode().split()
        return f" (pid {int(pid)}{f', {FINALIZE}' if who == FINALIZE.split() else ''})"
    return ""
