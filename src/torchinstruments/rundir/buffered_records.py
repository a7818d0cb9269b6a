"""Which samples the history buffer's rows belong to: a part's split record, the oldest row's age.

Design decision: the history buffer (`rundir.writer`) holds rows, not samples; this keeps, next
to it, one small record per run of rows of one sample and signal, in append order, with how
many of its rows are still buffered and when its first row was measured. That is all the
writer needs to say, in a part's Parquet metadata, which sample its last rows cut in two
(`SPLIT_RECORD_KEY`, read by `finalize` after a kill), and how old the oldest buffered row is
(the time bound on crash loss). The cost: one object per sample and signal while its rows wait.
"""

from __future__ import annotations

import json
import time
from collections import deque

__all__ = ["SPLIT_RECORD_KEY", "BufferedRecords"]

SPLIT_RECORD_KEY = "torchinstruments.split_record"


class _BufferedRecord:
    """The rows of one sample and signal, in append order, that are still (partly) buffered."""

    __slots__ = ("left", "rows", "sample_id", "signal", "since")

    def __init__(self, sample_id: int, signal: str, rows: int, since: float) -> None:
        self.sample_id = sample_id
        self.signal = signal
        self.rows = rows  # rows it had in the buffer
        self.left = rows  # of them, rows not yet in a part
        self.since = since  # monotonic time its first row was measured: none of it is older


class BufferedRecords:
    """The records of the buffered rows, oldest first (the writer holds its lock around each
    call)."""

    def __init__(self) -> None:
        self._records: deque[_BufferedRecord] = deque()

    def note(self, sample_id: int, signal: str, rows: int, first_us: int) -> None:
        """`rows` more buffered rows of this sample and signal, the first measured at wall
        time `first_us`."""
        records = self._records
        last = records[-1] if records else None
        if last is not None and last.sample_id == sample_id and last.signal == signal:
            last.rows += rows
            last.left += rows
        else:
            records.append(_BufferedRecord(sample_id, signal, rows, _monotonic_of(first_us)))

    def oldest(self) -> float | None:
        """The monotonic time the oldest buffered row was measured, or None when none is."""
        return self._records[0].since if self._records else None

    def split_metadata(self, n: int) -> dict[str, str]:
        """A part's metadata when its `n` rows (the first buffered ones) end inside a record
        whose rest stays buffered; empty otherwise."""
        left = n
        for record in self._records:
            if left < record.left:
                if left == 0:
                    return {}
                on_disk = record.rows - record.left + left
                split = {
                    "sample_id": record.sample_id,
                    "signal": record.signal,
                    "rows_in_parts": on_disk,
                    "rows": record.rows,
                }
                return {SPLIT_RECORD_KEY: json.dumps(split)}
            left -= record.left
        return {}

    def consume(self, n: int) -> None:
        """Forget the records (or the parts of one) that the last part wrote: its `n` rows."""
        records = self._records
        while n and records:
            record = records[0]
            if record.left <= n:
                n -= record.left
                records.popleft()
            else:
                record.left -= n
                n = 0


def _monotonic_of(timestamp_us: int) -> float:
    """The `time.monotonic()` reading at wall-clock `timestamp_us` (never in the future)."""
    age = max(0.0, time.time() - timestamp_us / 1e6)
    return time.monotonic() - age
