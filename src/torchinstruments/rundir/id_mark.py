"""The run's id mark: the sample_id and forward_index after every sample begun, kept in `.lock`.

Design decision: a continued run (resume=True) numbers its samples after everything the earlier
attempts left (`rundir.attempts.plan_continuation`), but a sample whose process was killed
(SIGKILL) before any of its rows, TensorBoard events or loss-ledger entries reached the disk
leaves no trace there, and its ids would be handed out again. So as each sample is taken, the
observer writes the ids after it into the run's lock file, which the run holds anyway: one
`os.pwrite` of `MARK_BYTES` at `MARK_OFFSET` (after the holder line, which `rundir.lock` pads to
that length and never truncates) on a descriptor opened once per run, no fsync
(`rundir.lock_line`). The write is in
the page cache before the sample's forward runs, and the page cache outlives a killed process,
so after any kill of the process the mark covers every sample it began. A power loss or a
kernel crash can lose unsynced pages: that is out of scope (the mark is then older, and the
earlier evidence alone decides, as before it). The cost per sample: one formatted line and one
system call into the page cache (a microsecond or two), nothing per unsampled forward, layer or
tensor. A write that fails never reaches the user's step: it is said once (`said`: a note in
index.md and a warning), and later samples try again.

The mark is ASCII, `<next sample_id> <next forward_index>\\n` with fixed-width numbers, so a
person can read it; a lock file without one (a version before it, a run that never began) or
with one that does not parse has none (`read_mark`). Where `os.pwrite` does not exist (Windows)
no mark is kept, and the run says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from torchinstruments.rundir.layout import LOCK_FILE
from torchinstruments.rundir.lock_line import LockLine, read_line
from torchinstruments.rundir.shell import error_said

__all__ = ["MARK_BYTES", "MARK_OFFSET", "IdMark", "read_mark"]

# Where the mark starts in the lock file: the holder line (`rundir.lock`) is padded to this.
MARK_OFFSET = 64
_WIDTH = 20  # digits of each number: any int64
MARK_BYTES = 2 * _WIDTH + 2


def _line(next_sample: int, next_forward: int) -> bytes:
    """The mark's bytes."""
    return f"{next_sample:0{_WIDTH}d} {next_forward:0{_WIDTH}d}\n".encode()


def read_mark(directory: Path) -> tuple[int, int] | None:
    """The mark in `directory`'s lock file: (next sample_id, next forward_index), the ids after
    every sample the run began; None where there is none (or it cannot be read)."""
    data = read_line(directory, MARK_OFFSET, MARK_BYTES)
    if data is None or len(data) != MARK_BYTES:
        return None
    fields = data.split()
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        return None
    return int(fields[0]), int(fields[1])


class IdMark:
    """The mark a live run advances as each sample is taken (its own descriptor of `.lock`).

    Args:
        said: called once, with a sentence, when a write of the mark fails (or cannot be made):
            the run's note and warning.
    """

    def __init__(self, said: Callable[[str], None]) -> None:
        self._said = said
        self._line = LockLine(MARK_OFFSET)
        self._failed = False

    def open(self, directory: Path, next_sample: int, next_forward: int) -> None:
        """Open the lock file (the run holds its lock) and write the mark the run starts from,
        so the mark's bytes exist before the first sample (a sample's write never grows the
        file); a failure is said (`said`), never raised."""
        try:
            self._line.open(directory)
        except OSError as error:
            self._fail(error_said(error))
            return
        self.advance(next_sample, next_forward)

    def advance(self, next_sample: int, next_forward: int) -> None:
        """Write the ids after the sample just taken (called under the counter's lock, so marks
        land in the order the ids were handed out). Never raises."""
        try:
            self._line.write(_line(next_sample, next_forward))
        except Exception as error:
            self._fail(error_said(error))

    def close(self, *, in_child: bool = False) -> None:
        """Close the descriptor: at removal (no sample is taken after it), or in a forked child
        its copy (`LockLine.close`)."""
        self._line.close(in_child=in_child)

    def _fail(self, why: str) -> None:
        """Say once that the mark could not be written."""
        if self._failed:
            return
        self._failed = True
        with contextlib.suppress(Exception):
            self._said(
                f"the run's id mark in {LOCK_FILE} could not be written ({why}): should this "
                "process be killed, a resume=True continuing the run knows the samples it "
                "took only from what reached the disk (rows, TensorBoard events, the loss "
                "ledger), so a sample of which nothing did may have its sample_id and "
                "forward_index used again"
            )
