"""Marked samples: history rows that say a sample is not an ordinary, complete one.

Design decision: a mark is a row of the history itself, not a column and not a side file, so it
is queryable with the same Polars query as any value, travels with the rows through parts and
the merge, and costs nothing for samples that are not marked. A marker row has the reserved
metric `interrupted` (`records.INTERRUPTED`), a null value and a reason (`reasons`) saying why:

- the sampled root forward raised: the row names the exception and the innermost selected layer
  it was raised in (its `layer` and `call_index`; layer `""` with the root's class when it was
  raised outside the selected layers). The observer writes it with the sample's other rows.
- `remove_observer` was called during the sample's forward (signal `output`) or backward
  (signal `output_gradient`), from inside it or from another thread: the observer writes it with
  what the sample measured before, naming the root (layer `""`).
- the process died while part of the sample's rows were still in memory: `finalize` finds the
  sample in the metadata of the last part (`writer.SPLIT_RECORD_KEY`) and writes the mark in a
  part of its own before merging, so the mark survives like any row. The same at removal when
  the last part writes failed (a full disk) after part of a sample's rows.
- rows of the sample were dropped at the memory cap while others were kept (`rundir.writer`).

Readers (index.md through the run state, `show`, `compare`) list the marks and keep marker rows
out of the value tables; `summary` leaves them out of result.json's series.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from torchinstruments import reasons
from torchinstruments.records import INTERRUPTED
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    HISTORY_SCHEMA,
    constant_metadata,
    list_parts,
    part_number,
    part_path,
    scan_history,
    write_parquet_atomic,
)
from torchinstruments.rundir.merge import merged_part_numbers
from torchinstruments.rundir.writer import SPLIT_RECORD_KEY

# index.md lists at most this many marks (the first ones); the state counts every marked sample.
MAX_LISTED = 20


@dataclass(frozen=True)
class SampleMark:
    """One marked sample, as the run state and index.md list it.

    Attributes:
        sample_id: the marked sample.
        layer: the layer the marker row names (the raising layer; "" for the root or outside).
        call_index: that layer's call.
        reason: the marker row's reason (which exception, or how much was written).
    """

    sample_id: int
    layer: str
    call_index: int
    reason: str

    def describe(self) -> str:
        """`"sample 12: <reason>"`."""
        return f"sample {self.sample_id}: {self.reason}"


def is_mark() -> pl.Expr:
    """True on marker rows."""
    return pl.col("metric") == INTERRUPTED


def read_marks(history: Path) -> tuple[tuple[SampleMark, ...], int]:
    """The first `MAX_LISTED` marks of a history file (by sample), and how many samples are
    marked: each once, however many marker rows it has (a sample can be marked for two causes).

    Raises:
        OSError, polars.exceptions.PolarsError: if the file cannot be read.
    """
    lf = scan_history(history).filter(is_mark())
    total = int(lf.select(pl.col("sample_id").n_unique()).collect(engine="streaming").item())
    first = (
        lf.sort("sample_id", "layer", "call_index")
        .head(MAX_LISTED)
        .select("sample_id", "layer", "call_index", "unavailable_reason")
        .collect(engine="streaming")
    )
    marks = tuple(
        SampleMark(r["sample_id"], r["layer"], r["call_index"], r["unavailable_reason"] or "")
        for r in first.iter_rows(named=True)
    )
    return marks, total


def _merged_after(directory: Path, last: Path) -> bool:
    """Whether history.parquet holds a part written after `last`: then `last` is one an earlier
    merge left in place (unreadable), not the run's last, which that merge's finish checked."""
    history = directory / HISTORY_FILE
    if not history.is_file():
        return False
    number = part_number(last)
    return number is not None and any(n > number for n in merged_part_numbers(history))


def mark_partly_written(
    directory: Path, why: Callable[[str, int, int], str] = reasons.partly_written
) -> int | None:
    """After a crash, or a removal whose last part writes failed: mark the sample whose rows
    the last part split, if its rest never came.

    The writer writes parts in buffer order, so only the last part's split can be unfinished: a
    later part would have started with the rest. Writes the marker row as a part of its own
    (atomically, like every part), with the reason `why(signal, rows on disk, rows)`, and
    returns the sample id, or None when nothing is partial (a second call finds the marker's
    part last: it marks once).

    Raises:
        OSError, polars.exceptions.PolarsError: if the last part or the new one fails.
    """
    parts = list_parts(directory)
    if not parts or _merged_after(directory, parts[-1]):
        return None
    last = parts[-1]
    entry = pl.read_parquet_metadata(last).get(SPLIT_RECORD_KEY)
    if entry is None:
        return None
    split = json.loads(entry)
    sample_id, signal = int(split["sample_id"]), str(split["signal"])
    ordinary = scan_history(last).filter(pl.col("sample_id") == sample_id, ~is_mark())
    found = ordinary.select("forward_index", "rank", "mode", "step", "attempt").head(1).collect()
    forward_index, rank, mode, step, attempt = (
        found.row(0) if found.height else (None, None, "", None, None)
    )
    reason = why(signal, int(split["rows_in_parts"]), int(split["rows"]))
    row: dict[str, object] = dict.fromkeys(HISTORY_SCHEMA)  # null unless said below
    row.update(
        sample_id=sample_id,
        forward_index=forward_index,
        timestamp=time.time_ns() // 1000,
        rank=rank,
        layer="",
        module_type="",
        call_index=0,
        signal=signal,
        tensor_path="",
        dtype="",
        step=step,
        attempt=attempt,
        mode=mode,
        metric=INTERRUPTED,
        unavailable_reason=reason,
    )
    schema = {**HISTORY_SCHEMA, "timestamp": pl.Int64()}
    marker = pl.DataFrame({name: [value] for name, value in row.items()}, schema=schema)
    marker = marker.with_columns(pl.col("timestamp").cast(HISTORY_SCHEMA["timestamp"]))
    number = part_number(last)
    assert number is not None  # list_parts lists only part files
    # Its one row's columns are all constant: those the other parts share stay literals.
    write_parquet_atomic(marker, part_path(directory, number + 1), constant_metadata(marker))
    return sample_id


__all__ = ["MAX_LISTED", "SampleMark", "is_mark", "mark_partly_written", "read_marks"]
