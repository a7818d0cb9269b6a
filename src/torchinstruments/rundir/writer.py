"""The live history writer: a columnar buffer and atomic Parquet parts.

Design decision: during training, measurements go into a columnar buffer (one Python list per
column) and leave it as one Parquet part per `buffer_rows` rows, written under a temporary name in
`history.parts/` and renamed into place. Per-sample work is an `extend` per column, independent of
how much history was already written, and a reader (or a crash) never sees a half-written part.
The cost: rows not yet in a part live in memory and are lost if the process dies.

Merging the parts into history.parquet is not this module's job: see `rundir.merge`, called by
the one end-of-run routine in `rundir.finish`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path

import polars as pl

from torchinstruments.records import Measurement
from torchinstruments.rundir.layout import (
    HISTORY_SCHEMA,
    PARTS_DIR,
    list_parts,
    part_number,
    part_path,
    write_parquet_atomic,
)


@dataclass(frozen=True)
class HistoryConfig:
    """How the history table is buffered and summarised.

    Args:
        buffer_rows: rows kept in memory before they are written as one Parquet part (>= 1).
        window: samples in each of the `previous` and `recent` windows of result.json (>= 1).
    """

    buffer_rows: int = 8192
    window: int = 10

    def __post_init__(self) -> None:
        for name in ("buffer_rows", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: expected an int >= 1")


@dataclass
class _ColumnBuffer:
    """One list per history column; `frame` turns the first n rows into a DataFrame.

    `shape` is kept as an index into `shapes` (distinct shapes are few), because building a
    List column from one Python list per row costs ~50x more than a gather.
    """

    columns: dict[str, list] = field(default_factory=lambda: {name: [] for name in HISTORY_SCHEMA})
    shapes: dict[tuple[int, ...] | None, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.columns["metric"])

    def extend(self, m: Measurement) -> int:
        """Add one row per metric of `m`; returns the number of rows added."""
        k = len(m.metrics)
        if len(m.values) != k:
            raise ValueError(
                f"Measurement of {m.layer!r} has {k} metrics but {len(m.values)} values"
            )
        shape = None if m.shape is None else tuple(m.shape)
        shape_id = self.shapes.setdefault(shape, len(self.shapes))
        c = self.columns
        c["sample_id"].extend(repeat(m.sample_id, k))
        c["forward_index"].extend(repeat(m.forward_index, k))
        c["timestamp"].extend(repeat(m.timestamp_us, k))
        c["rank"].extend(repeat(m.rank, k))
        c["layer"].extend(repeat(m.layer, k))
        c["module_type"].extend(repeat(m.module_type, k))
        c["call_index"].extend(repeat(m.call_index, k))
        c["signal"].extend(repeat(m.signal, k))
        c["tensor_path"].extend(repeat(m.tensor_path, k))
        c["shape"].extend(repeat(shape_id, k))
        c["dtype"].extend(repeat(m.dtype, k))
        c["mode"].extend(repeat(m.mode, k))
        c["grad_enabled"].extend(repeat(m.grad_enabled, k))
        c["metric"].extend(m.metrics)
        c["value"].extend(v.value for v in m.values)
        c["unavailable_reason"].extend(v.reason for v in m.values)
        return k

    def frame(self, n: int) -> pl.DataFrame:
        """The first `n` rows as a DataFrame with the exact history schema."""
        data = {}
        for name, dtype in HISTORY_SCHEMA.items():
            values = self.columns[name][:n]
            if name == "timestamp":
                data[name] = pl.Series(name, values, dtype=pl.Int64).cast(dtype)
            elif name == "shape":
                distinct = pl.Series(
                    name, [None if s is None else list(s) for s in self.shapes], dtype=dtype
                )
                data[name] = distinct.gather(pl.Series(values, dtype=pl.UInt32))
            else:
                data[name] = pl.Series(name, values, dtype=dtype)
        return pl.DataFrame(data)

    def drop(self, n: int) -> None:
        """Forget the first `n` rows (and the shape table once the buffer is empty)."""
        for values in self.columns.values():
            del values[:n]
        if not self.columns["metric"]:
            self.shapes.clear()


class HistoryWriter:
    """Appends measurements to the columnar buffer and writes full chunks as Parquet parts.

    Nothing raised while writing a part reaches the caller: an `OSError` or a Polars error (disk
    full, permission) is reported once as a `RuntimeWarning`, the rows stay in the buffer and are retried at the next
    chunk boundary, at `flush()` and at `close()`.

    Args:
        directory: the run's output directory; `history.parts/` is created inside it.
        config: buffer size and summary window.

    Example:
        >>> writer = HistoryWriter(Path("stats"), HistoryConfig(buffer_rows=8192))
        >>> writer.append(sample_record.measurements)  # doctest: +SKIP
        >>> writer.close()  # doctest: +SKIP
        True
    """

    def __init__(self, directory: Path, config: HistoryConfig) -> None:
        self._directory = directory
        self._config = config
        (self._directory / PARTS_DIR).mkdir(parents=True, exist_ok=True)
        existing = [part_number(p) for p in list_parts(self._directory)]
        self._next_part = max((n for n in existing if n is not None), default=-1) + 1
        self._buffer = _ColumnBuffer()
        self._rows_produced = 0
        self._rows_written = 0
        self._retry_at = config.buffer_rows
        self._warned = False
        self._closed = False

    @property
    def directory(self) -> Path:
        """The run's output directory."""
        return self._directory

    @property
    def rows_produced(self) -> int:
        """Rows appended so far (one per metric of each measurement)."""
        return self._rows_produced

    @property
    def rows_written(self) -> int:
        """Rows that are in completed parts on disk."""
        return self._rows_written

    @property
    def rows_buffered(self) -> int:
        """Rows in memory, not yet in a part."""
        return len(self._buffer)

    def append(self, measurements: Sequence[Measurement]) -> None:
        """Buffer one row per metric of each measurement; write full chunks as parts.

        Args:
            measurements: the measurements of one sample (or any batch of them).

        Raises:
            RuntimeError: if the writer was closed.
        """
        if self._closed:
            raise RuntimeError("HistoryWriter.append() after close(); create a new writer")
        for m in measurements:
            self._rows_produced += self._buffer.extend(m)
        if len(self._buffer) >= self._retry_at:
            self._write_chunks(partial=False)

    def flush(self) -> None:
        """Write every buffered row (the last part may be short); failures warn, never raise."""
        self._write_chunks(partial=True)

    def close(self) -> bool:
        """Write every buffered row; the writer takes no rows afterwards.

        Returns:
            True when every row produced is in a part on disk. False when some could not be
            written (already warned); they are counted in `rows_buffered`.
        """
        if not self._closed:
            self._closed = True
            self.flush()
        return len(self._buffer) == 0

    def _write_chunks(self, *, partial: bool) -> None:
        """Write full chunks (and, if `partial`, the remainder); stop at the first failure."""
        size = self._config.buffer_rows
        while len(self._buffer) >= size or (partial and len(self._buffer) > 0):
            n = min(size, len(self._buffer))
            path = part_path(self._directory, self._next_part)
            try:
                write_parquet_atomic(self._buffer.frame(n), path)
            except (OSError, pl.exceptions.PolarsError) as exc:
                # Polars reports a full disk as ComputeError ("No space left on device").
                self._report(path, exc)
                self._retry_at = len(self._buffer) + size
                return
            self._buffer.drop(n)
            self._next_part += 1
            self._rows_written += n
        self._retry_at = size

    def _report(self, path: Path, exc: Exception) -> None:
        """Warn once per writer about a failed part write."""
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"torchinstruments could not write history part {path} ({exc}); the rows stay in "
            "memory and are retried at the next chunk and at removal. Training goes on. "
            "(Reported once.)",
            RuntimeWarning,
            stacklevel=4,
        )
