"""Disk space held back for the run's own record, so the final state lands on a full disk.

Design decision: a disk that fills up is full for every writer: TensorBoard's event file
appends up to the last byte, a part write fails half way, another process takes the rest. The
state file, which says what the run lost, would then fail at removal too, leaving a run that
looks "in progress" and a loss ledger that died with the process. So at injection the run writes
a reserve file (twice the size of the state file and index.md as first written, plus 64 KiB) and
deletes it at removal right before the final state file and index.md are written: whatever the
disk did meanwhile, those two fit. The cost: that much disk per live run (about 100 KiB for
ordinary models), written once. The reserve holds random bytes, not zeros, so a compressing
file system cannot shrink it. Its name ends in `TMP_SUFFIX`: `finalize` deletes it after a crash
like any other temporary of the library. A disk that refuses the reserve at injection is said
(a warning, a note in index.md, `sinks.directory`): the promise above is then not kept.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from torchinstruments.rundir.layout import TMP_SUFFIX

RESERVE_FILE = ".reserve" + TMP_SUFFIX
SLACK_BYTES = 64 * 1024


def reserve_bytes(*files: Path) -> int:
    """Twice the size of `files` (those that exist) plus `SLACK_BYTES`."""
    total = 0
    for path in files:
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return 2 * total + SLACK_BYTES


def hold(directory: Path, size: int) -> OSError | None:
    """Write the reserve file of `size` bytes; where the disk refuses, no file, and the error
    (the caller says so: the final state is then not sure to fit)."""
    path = directory / RESERVE_FILE
    try:
        with open(path, "wb") as f:
            for start in range(0, size, 1 << 16):
                f.write(os.urandom(min(1 << 16, size - start)))
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        with contextlib.suppress(OSError):
            path.unlink()
        return error
    return None


def release(directory: Path) -> None:
    """Delete the reserve file (if any), giving its space to the writes that follow.

    A directory that refuses the deletion (made read-only, its permissions taken away) refuses
    the writes that follow as well, and each of those is reported where it fails; raising here
    instead would stop the run's close before it says what it could not write."""
    with contextlib.suppress(OSError):
        (directory / RESERVE_FILE).unlink()


__all__ = ["RESERVE_FILE", "hold", "release", "reserve_bytes"]
