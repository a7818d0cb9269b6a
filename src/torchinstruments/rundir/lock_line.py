"""A line of the run's lock file at a fixed place, rewritten in place while the run lives.

Design decision: the run holds `.lock` for its whole life, so what must outlive a killed process
or a directory that takes no more writes is kept there (`rundir.id_mark`, `rundir.write_trouble`):
one `os.pwrite` at a fixed offset through a descriptor opened once per run, no fsync (the page
cache outlives a killed process), and no room needed once the line's bytes exist. Writes and the
close share one guard, so a write on another thread never lands in a file that reused the
descriptor's number. Where `os.pwrite` does not exist (Windows) no line is kept (`open` raises).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from torchinstruments.rundir.layout import LOCK_FILE

__all__ = ["LockLine", "read_line"]


class LockLine:
    """One line of `.lock`, `offset` bytes in, written through a descriptor of its own."""

    def __init__(self, offset: int) -> None:
        self._offset = offset
        self._fd: int | None = None
        self._guard = threading.Lock()

    def open(self, directory: Path) -> None:
        """Open the lock file of `directory` (the run holds its lock).

        Raises:
            OSError: where it cannot be opened, or `os.pwrite` does not exist.
        """
        if not hasattr(os, "pwrite"):
            raise OSError("os.pwrite does not exist on this platform")
        self._fd = os.open(directory / LOCK_FILE, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))

    def write(self, data: bytes) -> bool:
        """Write `data` at the line's place; False where no descriptor is open (never opened,
        or closed).

        Raises:
            OSError: as `os.pwrite`.
        """
        with self._guard:
            if self._fd is None:
                return False
            os.pwrite(self._fd, data, self._offset)
            return True

    def close(self, *, in_child: bool = False) -> None:
        """Close the descriptor (the line stays as it is): under the guard, so no write overlaps
        it; in a forked child (`in_child`), the child's copy, without the guard (a parent's
        thread may have held it at the fork, and none releases it there)."""
        if in_child:
            fd, self._fd = self._fd, None
        else:
            with self._guard:
                fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def read_line(directory: Path, offset: int, size: int) -> bytes | None:
    """The `size` bytes at `offset` of `directory`'s lock file (fewer where it ends before);
    None where it cannot be read."""
    try:
        with open(directory / LOCK_FILE, "rb") as lock:
            lock.seek(offset)
            return lock.read(size)
    except OSError:
        return None
