"""`HistoryConfig` (public): how the history table is buffered, flushed and summarised.

Design decision: the one option of `inject_observer` that is itself a record of options lives in
a module of its own, below everything that reads it: the live writer (`rundir.writer`) applies
it, `ObserverConfig` holds it, and a run's `RunInfo` records it, so none of them has to import
another to know its fields, defaults and checks. It holds plain numbers and imports nothing of
the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_BUFFERED_ROWS", "HistoryConfig"]

DEFAULT_MAX_BUFFERED_ROWS = 131_072


class _DefaultRows(int):
    """`buffer_rows`' default, told apart from the same number passed on purpose: it yields to a
    smaller `max_buffered_rows` (a part must fit in the buffer), which a passed value does not."""


_DEFAULT_BUFFER_ROWS = _DefaultRows(65_536)


@dataclass(frozen=True)
class HistoryConfig:
    """How the history table is buffered and summarised.

    Args:
        buffer_rows: rows kept in memory before they are written as one Parquet part (>= 1).
            65,536 by default (or `max_buffered_rows`, if that is given and smaller): a part's
            fixed cost (its file, fsyncs, metadata and Polars' set-up) is paid per part, so a
            run that records many rows a step (54,000 for a 3,000-layer model sampled every
            step) spent about a tenth of its sampled step's CPU on it with parts of 8,192 rows,
            the default before (docs/benchmarks.md); crash loss is bounded by `flush_seconds`,
            whatever the size.
        window: samples in each of the `previous` and `recent` windows of result.json (>= 1).
        flush_seconds: the most history a crash can lose, in seconds (> 0): every row measured
            more than `flush_seconds` before the process dies is in a part on disk, and so are
            the TensorBoard events of its sample. Smaller means more, smaller parts.
        max_buffered_rows: the most rows held in memory while parts cannot be written (a full
            disk), >= buffer_rows; None (the default) means `max(131072, buffer_rows)`. About
            57 bytes a row as the observer records them (at most ~175 for other measurements):
            the default bounds the buffer to about 7 MiB (22 MiB) for as long as writes fail.
            Rows recorded beyond it are dropped (the newest) and counted, with their samples
            and the write error, in the loss ledger.
    """

    buffer_rows: int = _DEFAULT_BUFFER_ROWS
    window: int = 10
    flush_seconds: float = 60.0
    max_buffered_rows: int | None = None

    @property
    def buffered_rows_cap(self) -> int:
        """`max_buffered_rows`, or its default for this `buffer_rows`."""
        if self.max_buffered_rows is None:
            return max(DEFAULT_MAX_BUFFERED_ROWS, self.buffer_rows)
        return self.max_buffered_rows

    def __post_init__(self) -> None:
        names = ["buffer_rows", "window"]
        if self.max_buffered_rows is not None:
            names.append("max_buffered_rows")
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if type(self.buffer_rows) is _DefaultRows:  # a plain int from here on, as if passed
            rows = min(self.buffer_rows, self.max_buffered_rows or self.buffer_rows)
            object.__setattr__(self, "buffer_rows", int(rows))
        if self.buffered_rows_cap < self.buffer_rows:
            raise ValueError(
                f"max_buffered_rows must be None or an int >= buffer_rows ({self.buffer_rows!r}; "
                f"the buffer must hold at least one part), got {self.max_buffered_rows!r}"
            )
        seconds = self.flush_seconds
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ValueError(
                f"flush_seconds must be a finite number of seconds > 0, got {seconds!r}"
            )
