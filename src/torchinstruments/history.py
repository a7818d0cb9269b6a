"""The history table: a columnar buffer, atomic Parquet parts, and a bounded-memory merge.

Design decision: during training, measurements go into a columnar buffer (one Python list per
column) and leave it as one Parquet part per `buffer_rows` rows, written under a temporary name in
`history.parts/` and renamed into place. Per-sample work is an `extend` per column, independent of
how much history was already written, and a reader (or a crash) never sees a half-written part.
The cost: up to `buffer_rows` rows live in memory and are lost if the process dies.

At removal the parts are merged into `history.parquet`, sorted by `MERGE_SORT_KEY`. Polars' sort
is not out-of-core (a plain `scan_parquet(...).sort(...).sink_parquet(...)` of an 18 M-row history
peaked at 4.7 GB for 134 MB on disk), so the merge sorts in sample_id ranges of about
`MERGE_BATCH_ROWS` rows: parts arrive in sample order, so each range touches only a few parts.
Each sorted range is streamed into a temporary file, and the ranges are then streamed, in order,
into one file. Peak memory follows the range size, not the history; the cost is writing the data
twice and twice the disk space while merging.

Crash recovery relies on two facts: (1) every file appears by `os.replace` of a complete temporary
file, and (2) the merged file's Parquet metadata lists the parts it holds
(`MERGED_PARTS_KEY`, ranges of part numbers). Parts are deleted only after the merged file is in
place, so a part that is still there after a crash is either listed (already merged: deleted) or
not (merged now, together with the existing history.parquet). No row is lost or duplicated, and
no heuristic key-based de-duplication is needed (a tensor may legitimately be measured twice in one
sample, e.g. two backward passes with `retain_graph=True`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise, repeat
from pathlib import Path

import polars as pl

from torchinstruments.records import Measurement

PARTS_DIR = "history.parts"
HISTORY_FILE = "history.parquet"
MERGE_TMP_DIR = "history.merge.tmp"
TMP_SUFFIX = ".tmp"
MERGED_PARTS_KEY = "torchinstruments.merged_parts"
MERGE_BATCH_ROWS = 400_000

HISTORY_SCHEMA = pl.Schema(
    {
        "sample_id": pl.Int64(),
        "forward_index": pl.Int64(),
        "timestamp": pl.Datetime("us", "UTC"),
        "rank": pl.Int32(),
        "layer": pl.String(),
        "module_type": pl.String(),
        "call_index": pl.Int32(),
        "signal": pl.String(),
        "tensor_path": pl.String(),
        "shape": pl.List(pl.Int64()),
        "dtype": pl.String(),
        "mode": pl.String(),
        "grad_enabled": pl.Boolean(),
        "metric": pl.String(),
        "value": pl.Float64(),
        "unavailable_reason": pl.String(),
    }
)

MERGE_SORT_KEY = ("sample_id", "signal", "layer", "call_index", "tensor_path", "metric")

_PART_RE = re.compile(r"^part-(\d+)\.parquet$")


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


def part_path(directory: Path, number: int) -> Path:
    """The path of part `number` under `directory/history.parts/`."""
    return Path(directory) / PARTS_DIR / f"part-{number:09d}.parquet"


def part_number(path: Path) -> int | None:
    """The number of a part file, or None when the name is not a part's."""
    match = _PART_RE.match(path.name)
    return int(match.group(1)) if match else None


def list_parts(directory: Path) -> list[Path]:
    """Completed parts under `directory/history.parts/`, in the order they were written."""
    parts_dir = Path(directory) / PARTS_DIR
    if not parts_dir.is_dir():
        return []
    found = [(part_number(p), p) for p in parts_dir.iterdir() if p.is_file()]
    return [p for n, p in sorted((n, p) for n, p in found if n is not None)]


def empty_history() -> pl.DataFrame:
    """A history table with no rows and the exact schema."""
    return pl.DataFrame(schema=HISTORY_SCHEMA)


def _fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage (best effort for directories)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _write_parquet_atomic(frame: pl.DataFrame, path: Path) -> None:
    """Write `frame` to `path` via a temporary file in the same directory and `os.replace`."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        frame.write_parquet(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@dataclass
class _ColumnBuffer:
    """One list per history column; `frame` turns the first n rows into a DataFrame.

    `shape` is kept as an index into `shapes` (distinct shapes are few), because building a
    List column from one Python list per row costs ~50x more than a gather.
    """

    columns: dict[str, list] = field(default_factory=lambda: {name: [] for name in HISTORY_SCHEMA})
    shapes: dict[tuple[int, ...], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.columns["metric"])

    def extend(self, m: Measurement) -> int:
        """Add one row per metric of `m`; returns the number of rows added."""
        k = len(m.metrics)
        if len(m.values) != k:
            raise ValueError(
                f"Measurement of {m.layer!r} has {k} metrics but {len(m.values)} values"
            )
        shape_id = self.shapes.setdefault(tuple(m.shape), len(self.shapes))
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
                distinct = pl.Series(name, [list(s) for s in self.shapes], dtype=dtype)
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
    """

    def __init__(self, directory: Path, config: HistoryConfig) -> None:
        self._directory = Path(directory)
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
        self._result: Path | None = None

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

    def close(self) -> Path | None:
        """Flush, then merge all parts into `history.parquet`.

        Returns:
            The path of history.parquet (written even when no row was produced), or None when
            buffered rows could not be written or the merge failed; then a `RuntimeWarning` says
            why, and the parts stay in place for `python -m torchinstruments finalize DIR`.
        """
        if self._closed:
            return self._result
        self._closed = True
        self.flush()
        if len(self._buffer):
            warnings.warn(
                f"torchinstruments: {len(self._buffer)} history rows could not be written to "
                f"{self._directory / PARTS_DIR}; history.parquet was not written. Free space, "
                f"then run `python -m torchinstruments finalize {self._directory}` to merge "
                "the parts that were written.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        try:
            self._result = merge_parts(self._directory)
        except (OSError, pl.exceptions.PolarsError) as exc:
            warnings.warn(
                f"torchinstruments: merging {self._directory / PARTS_DIR} into "
                f"{self._directory / HISTORY_FILE} failed ({type(exc).__name__}: {exc}); the "
                f"parts are kept. Run `python -m torchinstruments finalize {self._directory}`.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        return self._result

    def _write_chunks(self, *, partial: bool) -> None:
        """Write full chunks (and, if `partial`, the remainder); stop at the first failure."""
        size = self._config.buffer_rows
        while len(self._buffer) >= size or (partial and len(self._buffer) > 0):
            n = min(size, len(self._buffer))
            path = part_path(self._directory, self._next_part)
            try:
                _write_parquet_atomic(self._buffer.frame(n), path)
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


# --- merge -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeResult:
    """What a merge did: the merged file, its rows, and the parts it could not read."""

    path: Path
    rows: int
    merged_parts: tuple[Path, ...]
    unreadable_parts: tuple[tuple[Path, str], ...]


@dataclass(frozen=True)
class _Source:
    """A readable slice of sorted-by-nothing input: a part, or a slice of history.parquet."""

    path: Path
    lo: int
    hi: int
    rows: int
    offset: int | None = None

    def scan(self) -> pl.LazyFrame:
        lf = pl.scan_parquet(self.path, schema=HISTORY_SCHEMA)
        return lf if self.offset is None else lf.slice(self.offset, self.rows)


def _encode_ranges(numbers: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> `"0-2,5"`."""
    out: list[str] = []
    ordered = sorted(set(numbers))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def _decode_ranges(text: str) -> set[int]:
    """`"0-2,5"` -> `{0, 1, 2, 5}`."""
    numbers: set[int] = set()
    for item in filter(None, text.split(",")):
        lo, _, hi = item.partition("-")
        numbers.update(range(int(lo), int(hi or lo) + 1))
    return numbers


def merged_part_numbers(history: Path) -> set[int]:
    """Part numbers recorded as merged in an existing history.parquet's metadata."""
    return _decode_ranges(pl.read_parquet_metadata(history).get(MERGED_PARTS_KEY, ""))


def _check_part(path: Path, *, full: bool) -> str | None:
    """None if the part is readable with the history schema, else why not."""
    try:
        schema = pl.read_parquet_schema(path)
        if schema != HISTORY_SCHEMA:
            return f"schema differs from the history schema: {dict(schema)}"
        if full:
            pl.read_parquet(path)
    except (OSError, pl.exceptions.PolarsError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _part_sources(parts: Sequence[Path]) -> list[_Source]:
    """Sample-id range and row count of each part, from one streaming pass over sample_id."""
    if not parts:
        return []
    stats = (
        pl.scan_parquet(list(parts), schema=HISTORY_SCHEMA, include_file_paths="_path")
        .group_by("_path")
        .agg(lo=pl.col("sample_id").min(), hi=pl.col("sample_id").max(), n=pl.len())
        .collect(engine="streaming")
    )
    by_path = {row["_path"]: row for row in stats.iter_rows(named=True)}
    sources = []
    for p in parts:
        row = by_path.get(str(p))
        if row is not None and row["n"] > 0:
            sources.append(_Source(p, row["lo"], row["hi"], row["n"]))
    return sources


def _history_sources(history: Path) -> list[_Source]:
    """An existing (sorted) history.parquet as slices of about MERGE_BATCH_ROWS rows."""
    lf = pl.scan_parquet(history, schema=HISTORY_SCHEMA)
    total = lf.select(pl.len()).collect().item()
    sources = []
    for offset in range(0, total, MERGE_BATCH_ROWS):
        n = min(MERGE_BATCH_ROWS, total - offset)
        lo, hi = (
            lf.slice(offset, n)
            .select(lo=pl.col("sample_id").min(), hi=pl.col("sample_id").max())
            .collect()
            .row(0)
        )
        sources.append(_Source(history, lo, hi, n, offset))
    return sources


def _batch_cuts(sources: Sequence[_Source]) -> list[int]:
    """Sample-id cut points so that each range [cut_i, cut_i+1) holds about MERGE_BATCH_ROWS rows."""
    ordered = sorted(sources, key=lambda s: (s.lo, s.hi))
    cuts = [ordered[0].lo]
    rows = 0
    for s in ordered:
        if rows >= MERGE_BATCH_ROWS and s.lo > cuts[-1]:
            cuts.append(s.lo)
            rows = 0
        rows += s.rows
    cuts.append(max(s.hi for s in sources) + 1)
    return cuts


def _sorted_range(sources: Sequence[_Source], lo: int, hi: int) -> pl.LazyFrame:
    """Rows with lo <= sample_id < hi from the sources that overlap it, sorted."""
    frames = [s.scan() for s in sources if s.hi >= lo and s.lo < hi]
    return (
        pl.concat(frames, how="vertical")
        .filter((pl.col("sample_id") >= lo) & (pl.col("sample_id") < hi))
        .sort(list(MERGE_SORT_KEY), maintain_order=True)
    )


def _sink_sorted(sources: Sequence[_Source], target: Path, metadata: dict[str, str]) -> None:
    """Sort all sources into `target` in bounded memory (see the module docstring)."""
    if not sources:
        empty_history().lazy().sink_parquet(target, metadata=metadata)
        return
    cuts = _batch_cuts(sources)
    if len(cuts) == 2:
        _sorted_range(sources, cuts[0], cuts[1]).sink_parquet(target, metadata=metadata)
        return
    tmp_dir = target.parent / MERGE_TMP_DIR
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        pieces = []
        for i, (lo, hi) in enumerate(pairwise(cuts)):
            piece = tmp_dir / f"range-{i:09d}.parquet"
            _sorted_range(sources, lo, hi).sink_parquet(piece)
            pieces.append(piece)
        pl.scan_parquet(pieces, schema=HISTORY_SCHEMA).sink_parquet(target, metadata=metadata)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def merge_history(directory: Path) -> MergeResult:
    """Merge the parts (and an existing history.parquet) into one sorted history.parquet.

    Unreadable parts are skipped, left in place, and listed in the result; parts already recorded
    in an existing history.parquet are only deleted. The merged file is written under a temporary
    name, synced, and renamed; parts are deleted only after that.

    Args:
        directory: the run's output directory.

    Returns:
        A `MergeResult`.
    """
    directory = Path(directory)
    history = directory / HISTORY_FILE
    parts = list_parts(directory)
    done: set[int] = set()
    if history.exists():
        done = merged_part_numbers(history)
    already = [p for p in parts if part_number(p) in done]
    pending = [p for p in parts if part_number(p) not in done]
    bad: dict[Path, str] = {}
    for p in pending:
        reason = _check_part(p, full=False)
        if reason is not None:
            bad[p] = reason
    tmp = directory / (HISTORY_FILE + TMP_SUFFIX)
    while True:
        good = [p for p in pending if p not in bad]
        if not good and history.exists():
            break  # nothing new: the existing history.parquet stays as it is
        numbers = done | {n for p in good if (n := part_number(p)) is not None}
        metadata = {MERGED_PARTS_KEY: _encode_ranges(sorted(numbers))}
        try:
            sources = _part_sources(good)
            if history.exists():
                sources = _history_sources(history) + sources
            _sink_sorted(sources, tmp, metadata)
            break
        except pl.exceptions.PolarsError:
            tmp.unlink(missing_ok=True)
            newly_bad = {p: r for p in good if (r := _check_part(p, full=True)) is not None}
            if not newly_bad:
                raise
            bad.update(newly_bad)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if tmp.exists():
        _fsync_path(tmp)
        os.replace(tmp, history)
        _fsync_path(directory)
    merged = [p for p in pending if p not in bad]
    for p in already + merged:
        p.unlink(missing_ok=True)
    parts_dir = directory / PARTS_DIR
    if parts_dir.is_dir() and not bad:
        with contextlib.suppress(OSError):
            parts_dir.rmdir()
    rows = pl.scan_parquet(history).select(pl.len()).collect().item()
    return MergeResult(history, rows, tuple(merged), tuple(bad.items()))


def merge_parts(directory: Path) -> Path:
    """Merge all parts of a run into `directory/history.parquet`; return its path.

    Unreadable parts are left in place and reported with a `RuntimeWarning`.

    Args:
        directory: the run's output directory.

    Returns:
        The path of history.parquet.
    """
    result = merge_history(directory)
    for path, reason in result.unreadable_parts:
        warnings.warn(
            f"torchinstruments: history part {path} is unreadable and was left in place: {reason}",
            RuntimeWarning,
            stacklevel=2,
        )
    return result.path


def write_text_atomic(path: Path, text: str) -> None:
    """Write UTF-8 `text` to `path` via a temporary file in the same directory and `os.replace`."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


__all__ = [
    "HISTORY_FILE",
    "HISTORY_SCHEMA",
    "MERGE_SORT_KEY",
    "PARTS_DIR",
    "HistoryConfig",
    "HistoryWriter",
    "MergeResult",
    "empty_history",
    "list_parts",
    "merge_history",
    "merge_parts",
    "write_text_atomic",
]
