"""The loss ledger: every row a run recorded but did not write, with its samples and why.

Design decision: the ledger holds ranges, not rows. Losses for the same reason with no
successful part write between them are one episode and one entry (first and last sample, rows
summed), so a disk that stays full for a day costs one entry, not one per sample; a write that
succeeds ends the episode, and the next loss opens a new entry. The number of entries is bounded
(`MAX_ENTRIES`): beyond it, losses are merged into the last entry, whose reason then says so. The
ledger counts; it never guesses: a range is the samples whose rows were lost, and `rows` is
exact.

When no ledger survived (the process died before anything could be written after a loss),
`missing_samples` finds the gaps in the sample ids that are on disk: a sample with no row at
all is missing unless the run recorded nothing for it (a sampled forward whose layers returned
no tensor), which only the live run could tell, so callers say "missing", never "lost".

Like `layout`, this module imports neither torch nor Polars.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from torchinstruments.rundir.ranges import was_were

MAX_ENTRIES = 64


@dataclass(frozen=True)
class LostRows:
    """One entry of the loss ledger: rows the run recorded that are not in its history.

    Attributes:
        rows: how many rows.
        first_sample_id: the first sample they belong to, when known.
        last_sample_id: the last sample they belong to, when known.
        reason: why they were not written (one sentence, with the write error).
    """

    rows: int
    first_sample_id: int | None
    last_sample_id: int | None
    reason: str

    def describe(self) -> str:
        """`"1,234 rows of samples 10-99 were recorded but not written: <reason>"` (index.md,
        warnings and the command line say it in these words)."""
        where = sample_range(self.first_sample_id, self.last_sample_id)
        rows = f"{self.rows:,} row{'' if self.rows == 1 else 's'}"
        return f"{rows} of {where} {was_were(self.rows)} recorded but not written: {self.reason}"


def sample_range(first: int | None, last: int | None) -> str:
    """`"sample 7"`, `"samples 7-9"`, or `"unknown samples"`."""
    if first is None or last is None:
        return "unknown samples"
    return f"sample {first}" if first == last else f"samples {first}-{last}"


class LossLedger:
    """Collects losses as they happen (the history writer calls it under its own lock)."""

    def __init__(self) -> None:
        self._entries: list[LostRows] = []
        self._open = False  # True while the last entry's episode goes on
        self.version = 0  # counts changes, so a saved copy can tell it is behind

    @property
    def entries(self) -> tuple[LostRows, ...]:
        """Every entry, oldest first."""
        return tuple(self._entries)

    @property
    def rows(self) -> int:
        """Rows lost in all."""
        return sum(entry.rows for entry in self._entries)

    def add(self, rows: int, first_sample_id: int, last_sample_id: int, reason: str) -> None:
        """Count `rows` lost rows of samples `first_sample_id..last_sample_id`."""
        if rows <= 0:
            return
        last = self._entries[-1] if self._entries else None
        full = len(self._entries) >= MAX_ENTRIES
        if last is not None and ((self._open and last.reason == reason) or full):
            merged_reason = last.reason
            if last.reason != reason and not merged_reason.endswith(_MORE):
                merged_reason += _MORE
            self._entries[-1] = replace(
                last,
                rows=last.rows + rows,
                first_sample_id=_min(last.first_sample_id, first_sample_id),
                last_sample_id=_max(last.last_sample_id, last_sample_id),
                reason=merged_reason,
            )
        else:
            self._entries.append(LostRows(rows, first_sample_id, last_sample_id, reason))
        self._open = True
        self.version += 1

    def reword(self, old: str, new: str) -> None:
        """Give the entries whose reason is `old` (merged entries: begins with it) the reason
        `new`: what happened to rows after their loss was counted (`rundir.write_notices`)."""
        for index, entry in enumerate(self._entries):
            if entry.reason.startswith(old) and old != new:
                self._entries[index] = replace(entry, reason=new + entry.reason[len(old) :])
                self.version += 1

    def end_episode(self) -> None:
        """A part was written: the next loss opens a new entry."""
        self._open = False


_MORE = f" (and later losses for other reasons: the ledger keeps at most {MAX_ENTRIES} entries)"


def _min(a: int | None, b: int) -> int:
    return b if a is None else min(a, b)


def _max(a: int | None, b: int) -> int:
    return b if a is None else max(a, b)


def missing_samples(present: Iterable[int], samples: int | None) -> list[tuple[int, int]]:
    """Ranges `(first, last)` of sample ids in `0..samples-1` with no row in `present`.

    Args:
        present: the distinct sample ids that have rows, in any order.
        samples: how many samples the run took, when known; otherwise only the gaps below the
            largest present id are found (what came after it cannot be told from the rows).
    """
    ids = sorted(set(present))
    end = samples if samples is not None else (ids[-1] + 1 if ids else 0)
    gaps: list[tuple[int, int]] = []
    expected = 0
    for sample_id in ids:
        if sample_id >= end:
            break
        if sample_id > expected:
            gaps.append((expected, sample_id - 1))
        expected = sample_id + 1
    if expected < end:
        gaps.append((expected, end - 1))
    return gaps


def uncovered(gaps: Iterable[tuple[int, int]], losses: Iterable[LostRows]) -> list[tuple[int, int]]:
    """The parts of `gaps` (inclusive ranges) that no loss entry's sample range covers."""
    covered = sorted(
        (loss.first_sample_id, loss.last_sample_id)
        for loss in losses
        if loss.first_sample_id is not None and loss.last_sample_id is not None
    )
    left: list[tuple[int, int]] = []
    for first, last in gaps:
        start = first
        for lo, hi in covered:
            if hi < start or lo > last:
                continue
            if lo > start:
                left.append((start, lo - 1))
            start = max(start, hi + 1)
        if start <= last:
            left.append((start, last))
    return left


__all__ = [
    "MAX_ENTRIES",
    "LossLedger",
    "LostRows",
    "missing_samples",
    "sample_range",
    "uncovered",
]
