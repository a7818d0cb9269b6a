"""What the history writer says when parts cannot be written: its warnings and its loss reasons.

Design decision: the words live apart from the writer (`rundir.writer`), which keeps the
buffer's bookkeeping; each is one function of the facts it names, so a reason the writer
changes later (rows kept to be retried, then not written at removal) is made from the same
words it was first made from, and says what happened to them in the end.
"""

from __future__ import annotations

from pathlib import Path

from torchinstruments.rundir.shell import error_said, literal_if_unclear

__all__ = [
    "cap_drop_reason",
    "cap_drop_warning",
    "kept_rows_given_up",
    "part_failed_warning",
]

# How a cap drop's reason ends while the rows kept in memory may still be written.
_KEPT = "the buffered ones are kept and retried"


def cap_drop_reason(cap: int, error: str | None) -> str:
    """The loss reason of rows dropped at the memory cap (`cap` rows were waiting), while the
    part writes fail with `error` (None: they had not caught up)."""
    return (
        f"dropped at the memory cap: max_buffered_rows={cap} rows were already waiting in "
        f"memory because history parts could not be written ({error or 'writes had not caught up'}"
        f"); the newest rows are dropped, {_KEPT}"
    )


def kept_rows_given_up(reason: str) -> str:
    """`reason` (a `cap_drop_reason`) once the rows it kept were not written at removal either:
    it no longer says they are retried."""
    return reason.replace(
        _KEPT,
        "the buffered ones were kept and retried but not written at removal either (the loss "
        "of them follows)",
        1,
    )


def cap_drop_warning(cap: int, error: str | None) -> str:
    """The warning (once per writer) at the first row dropped at the memory cap."""
    return (
        f"torchinstruments: {cap} history rows are waiting in memory for a part write that keeps "
        f"failing ({error}); newer rows are dropped and counted (sample ranges and reasons in the "
        "run state and index.md) until a write succeeds. Training goes on. (Reported once.)"
    )


def part_failed_warning(path: Path, exc: BaseException, cap: int) -> str:
    """The warning (once per writer) at the first part write that failed: the path and the
    error by index.md's rule (`literal_if_unclear`; a run directory named with an escape, an
    error that quotes it raw)."""
    return (
        f"torchinstruments could not write history part {literal_if_unclear(str(path))} "
        f"({error_said(exc)}); the rows stay in "
        f"memory (at most max_buffered_rows={cap}; newer ones are dropped and counted) and are "
        "retried at the next chunk, after half a flush interval and at removal. Training goes "
        "on. (Reported once.)"
    )
