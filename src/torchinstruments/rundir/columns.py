"""The live history's buffer: the rows waiting for a part, as DataFrame chunks in append order.

Design decision: what a sample recorded becomes one DataFrame chunk with the exact history
schema when it is appended, and a part is the first `n` rows of the chunks, so the cost per
sample does not depend on how much history was already written. The observer's records are
`MeasurementBlock`s, whose columns become a chunk without a Python object per row or per tensor
(`block_frame`: one gather of a frame of the per-tensor columns); any other sequence of
`Measurement`s (a marker row, a custom sink's records) goes through one Python list per column
(`_RowLists`). A cell that does not fit its column (a custom record's value that is not a
number) is replaced by null with a reason, never lost with the rows around it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat

import polars as pl

from torchinstruments import reasons
from torchinstruments.records import Measurement, MeasurementBlock
from torchinstruments.rundir.layout import RECORDED_SCHEMA, empty_history

__all__ = ["ColumnBuffer", "block_frame", "blocks_frame"]


class _BlockRange:
    """Tensors `start` to `stop` of a block, waiting in the buffer as they were recorded."""

    __slots__ = ("block", "start", "stop")

    def __init__(self, block: MeasurementBlock, start: int, stop: int) -> None:
        self.block, self.start, self.stop = block, start, stop

    @property
    def height(self) -> int:
        return (self.stop - self.start) * len(self.block.metrics)


class ColumnBuffer:
    """The rows not yet in a part, in append order; `frame(n)` is the first `n` of them.

    Blocks wait as they are (no Polars work per sample on the training thread) and become
    DataFrame rows when a part takes them: all the blocks a part covers in one `blocks_frame`
    call. Plain measurements become a DataFrame chunk at once.
    """

    def __init__(self) -> None:
        self._items: deque[pl.DataFrame | _BlockRange] = deque()
        self._rows = 0
        # what `frame(n)` left for `drop(n)`: n and the rows after them (None: no rows after)
        self._after: tuple[int, pl.DataFrame | None] | None = None

    def __len__(self) -> int:
        return self._rows

    def add_block(self, block: MeasurementBlock, start: int, stop: int) -> int:
        """Add the rows of the block's tensors `start` to `stop`; returns how many."""
        item = _BlockRange(block, start, stop)
        if item.height:
            self._items.append(item)
            self._rows += item.height
        return item.height

    def add_measurements(self, measurements: Sequence[Measurement]) -> int:
        """Add one row per metric of each measurement; returns how many."""
        if not measurements:
            return 0
        lists = _RowLists()
        for m in measurements:
            lists.extend(m)
        chunk = lists.frame()
        if chunk.height:
            self._items.append(chunk)
            self._rows += chunk.height
        return chunk.height

    def frame(self, n: int) -> pl.DataFrame:
        """The first `n` rows as one DataFrame with the exact history schema.

        The items these rows come from are replaced by that DataFrame (all of their rows), so a
        part that fails to be written is not converted again when it is retried. Every Polars
        call comes before the buffer changes, so an exception raised in one (a write failure,
        or a KeyboardInterrupt that Polars raises in whichever thread it runs when SIGINT
        arrives) leaves the buffer as it was; and the rows after the first `n` are cut off here
        too, so the `drop(n)` that follows a written part is plain Python that cannot fail
        half-way.
        """
        self._after = None
        covered = 0
        count = 0
        for item in self._items:
            if covered >= n:
                break
            covered += item.height
            count += 1
        if not count:
            return empty_history(RECORDED_SCHEMA)
        frames: list[pl.DataFrame] = []
        ranges: list[_BlockRange] = []
        for item in islice(self._items, count):
            if isinstance(item, _BlockRange):
                ranges.append(item)
                continue
            if ranges:
                frames.append(blocks_frame(ranges))
                ranges = []
            frames.append(item)
        if ranges:
            frames.append(blocks_frame(ranges))
        whole = frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical")
        head, rest = (whole, None) if whole.height <= n else (whole.head(n), whole.slice(n))
        # from here on plain Python: the buffer changes completely or not at all
        for _ in range(count):
            self._items.popleft()
        self._items.appendleft(whole)
        self._after = (n, rest)
        return head

    def drop(self, n: int) -> None:
        """Forget the first `n` rows (after `frame(n)`: without a Polars call, so it cannot
        fail half-way)."""
        n = min(n, self._rows)
        after, self._after = self._after, None
        if after is not None and after[0] == n and self._items:
            self._items.popleft()
            if after[1] is not None:
                self._items.appendleft(after[1])
            self._rows -= n
            return
        while n:
            item = self._items[0]
            if item.height <= n:
                self._items.popleft()
                self._rows -= item.height
                n -= item.height
            elif isinstance(item, _BlockRange):  # whole tensors only: a part ends on a frame
                self.frame(n)  # converts it; the next round drops from the frame
                self._after = None
            else:
                self._items[0] = item.slice(n)
                self._rows -= n
                n = 0

    def sample_range(self) -> tuple[int, int] | None:
        """The smallest and largest sample_id of the buffered rows; None when there are none."""
        ids: list[int] = []
        for item in self._items:
            if isinstance(item, _BlockRange):
                ids.append(item.block.sample_id)
            elif item.height:
                ids += [int(item["sample_id"].min()), int(item["sample_id"].max())]  # type: ignore[arg-type]
        return (min(ids), max(ids)) if ids else None


def blocks_frame(ranges: Sequence[_BlockRange]) -> pl.DataFrame:
    """The rows of several block ranges, in order, as one DataFrame: one conversion for all of
    them when they share their metrics, as an observer's blocks do.

    A cell that does not fit its column sends each block through `block_frame`, which repairs
    it.
    """
    metrics = ranges[0].block.metrics
    if len(ranges) > 1 and all(r.block.metrics == metrics for r in ranges):
        try:
            return _columns_frame(_fields(ranges), metrics)
        except Exception:  # a cell of the wrong type somewhere: block by block
            pass
    frames = [block_frame(r.block, r.start, r.stop) for r in ranges]
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical")


def block_frame(block: MeasurementBlock, start: int = 0, stop: int | None = None) -> pl.DataFrame:
    """The rows of the block's tensors `start` to `stop` (all by default), history schema.

    A cell that does not fit its column sends the block through `_RowLists`, which repairs it.
    """
    stop = len(block) if stop is None else stop
    try:
        return _columns_frame(_fields([_BlockRange(block, start, stop)]), block.metrics)
    except Exception:  # a cell of the wrong type: row by row, which repairs the cells
        lists = _RowLists()
        for i in range(start, stop):
            lists.extend(block[i])
        return lists.frame()


# The fields of a MeasurementBlock by how many entries they have: one for the whole block, one
# per tensor, one per row (`len(metrics)` per tensor).
_PER_BLOCK = ("sample_id", "forward_index", "signal", "rank", "step")
_PER_TENSOR = (
    "timestamps_us",
    "layers",
    "module_types",
    "call_indices",
    "tensor_paths",
    "shapes",
    "dtypes",
    "modes",
    "grad_enabled",
    "placements",
    "mesh_coordinates",
)
_PER_ROW = ("values", "reasons")
# The history's per-tensor columns, in schema order, and the field each comes from.
_TENSOR_COLUMNS = {
    "sample_id": "sample_id",
    "forward_index": "forward_index",
    "timestamp": "timestamps_us",
    "rank": "rank",
    "layer": "layers",
    "module_type": "module_types",
    "call_index": "call_indices",
    "signal": "signal",
    "tensor_path": "tensor_paths",
    "shape": "shapes",
    "dtype": "dtypes",
    "placement": "placements",
    "mesh_coordinate": "mesh_coordinates",
    "step": "step",
    "mode": "modes",
    "grad_enabled": "grad_enabled",
}


def _fields(ranges: Sequence[_BlockRange]) -> dict[str, list]:
    """Every field of the ranges' tensors as one list: one entry per tensor (a block's own
    fields repeated for each of its tensors) or, for the values and reasons, per row."""
    fields: dict[str, list] = {name: [] for name in (*_PER_BLOCK, *_PER_TENSOR, *_PER_ROW)}
    for r in ranges:
        block, k = r.block, len(r.block.metrics)
        for name in _PER_BLOCK:
            fields[name] += [getattr(block, name)] * (r.stop - r.start)
        for name in _PER_TENSOR:
            fields[name] += getattr(block, name)[r.start : r.stop]
        for name in _PER_ROW:
            fields[name] += getattr(block, name)[r.start * k : r.stop * k]
    return fields


def _columns_frame(fields: dict[str, list], metrics: tuple[str, ...]) -> pl.DataFrame:
    """The rows of `_fields` as a DataFrame; raises on a cell that does not fit its column.

    The per-tensor fields become a frame of one row per tensor, whose rows are gathered
    `len(metrics)` times in one call; the values and reasons are already one per row. One
    gather for all columns, not one per column: each is a Polars query of about 0.1 ms, most of
    what a part of a few hundred rows (the run's first sample, written on the training thread)
    cost to build.
    """
    import numpy as np  # here: finalize and the CLI import this module and never need NumPy

    k = len(metrics)
    n = len(fields["layers"])
    per_tensor = []
    for column, name in _TENSOR_COLUMNS.items():
        if column in ("shape", "mesh_coordinate"):
            per_tensor.append(_distinct_lists(fields[name]).alias(column))
        else:
            dtype = RECORDED_SCHEMA[column]
            per_tensor.append(pl.Series(column, fields[name], dtype=dtype, strict=True))
    tensors = pl.DataFrame(per_tensor)
    rows = tensors if k == 1 else tensors[np.repeat(np.arange(n, dtype=np.uint32), k)]
    frame = rows.hstack(
        [
            pl.Series("metric", list(metrics) * n, dtype=pl.String()),
            pl.Series("value", fields["values"], dtype=pl.Float64(), strict=True),
            pl.Series("unavailable_reason", fields["reasons"], dtype=pl.String(), strict=True),
            pl.Series("population", [None], dtype=pl.String()).new_from_index(0, n * k),
        ]
    )
    if frame.schema != RECORDED_SCHEMA:
        raise TypeError(f"block frame schema {frame.schema} is not the history schema")
    return frame


def _distinct_lists(items: list) -> pl.Series:
    """A List(Int64) column from one tuple (or None) per entry, built from its distinct values
    and gathered: one Python list per row costs ~50x more than a gather."""
    table: dict[object, int] = {}
    ids = [table.setdefault(item, len(table)) for item in items]
    if len(table) == 1:
        only = _valid_shape(next(iter(table)))
        value = None if only is None else list(only)
        return pl.Series([value], dtype=pl.List(pl.Int64)).new_from_index(0, len(items))
    distinct = [_valid_shape(item) for item in table]
    column = pl.Series([None if s is None else list(s) for s in distinct], dtype=pl.List(pl.Int64))
    return column.gather(pl.Series(ids, dtype=pl.UInt32))


@dataclass
class _RowLists:
    """One list per history column; `frame` turns them into a DataFrame (`shape` and
    `mesh_coordinate` through `_distinct_lists`)."""

    columns: dict[str, list] = field(default_factory=lambda: {name: [] for name in RECORDED_SCHEMA})

    def __len__(self) -> int:
        return len(self.columns["metric"])

    def extend(self, m: Measurement) -> int:
        """Add one row per metric of `m`; returns the number of rows added."""
        k = len(m.metrics)
        if len(m.values) != k:
            raise ValueError(
                f"Measurement of {m.layer!r} has {k} metrics but {len(m.values)} values"
            )
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
        c["shape"].extend(repeat(_valid_shape(m.shape), k))
        c["dtype"].extend(repeat(m.dtype, k))
        c["placement"].extend(repeat(m.placement, k))
        c["mesh_coordinate"].extend(repeat(_valid_shape(m.mesh_coordinate), k))
        c["step"].extend(repeat(m.step, k))
        c["mode"].extend(repeat(m.mode, k))
        c["grad_enabled"].extend(repeat(m.grad_enabled, k))
        c["metric"].extend(m.metrics)
        c["value"].extend(v.value for v in m.values)
        c["unavailable_reason"].extend(v.reason for v in m.values)
        c["population"].extend(repeat(m.population, k))
        return k

    def frame(self) -> pl.DataFrame:
        """Every row as a DataFrame with the exact history schema.

        A cell that does not fit its column (a custom record with a value that is not a number,
        say) is replaced by null, with a reason for `value`, and the frame is built again: one
        bad record never blocks the rows around it.
        """
        try:
            return self._frame()
        except Exception:  # a cell of the wrong type: repair the cells, keep every row
            self._repair()
            return self._frame()

    def _frame(self) -> pl.DataFrame:
        data = {}
        for name, dtype in RECORDED_SCHEMA.items():
            values = self.columns[name]
            if name == "timestamp":
                data[name] = pl.Series(name, values, dtype=pl.Int64).cast(dtype)
            elif name in ("shape", "mesh_coordinate"):
                data[name] = _distinct_lists(values).alias(name)
            else:
                data[name] = pl.Series(name, values, dtype=dtype, strict=True)
        return pl.DataFrame(data)

    def _repair(self) -> None:
        """Null every cell that does not fit its column's type."""
        c = self.columns
        n = len(self)
        for name, kind in _CELL_TYPES.items():
            values = c[name]
            for i in range(n):
                cell = values[i]
                if cell is None or (isinstance(cell, kind) and not _is_bool_as_number(cell, kind)):
                    continue
                values[i] = None
                if name == "value" and c["unavailable_reason"][i] is None:
                    c["unavailable_reason"][i] = reasons.record_value(type(cell).__name__)
        why = c["unavailable_reason"]
        for i in range(n):  # a reason exactly when the value is null
            if c["value"][i] is None and why[i] is None:
                why[i] = reasons.RECORD_NO_VALUE
            elif c["value"][i] is not None:
                why[i] = None


_CELL_TYPES: dict[str, type | tuple[type, ...]] = {
    "sample_id": int,
    "forward_index": int,
    "timestamp": int,
    "rank": int,
    "layer": str,
    "module_type": str,
    "call_index": int,
    "signal": str,
    "tensor_path": str,
    "dtype": str,
    "placement": str,
    "step": int,
    "mode": str,
    "grad_enabled": bool,
    "metric": str,
    "value": (float, int),
    "unavailable_reason": str,
    "population": str,
}


def _is_bool_as_number(cell: object, kind: type | tuple[type, ...]) -> bool:
    """True for a bool in a numeric column (bool is an int subclass, but not a number here)."""
    return isinstance(cell, bool) and kind is not bool


def _valid_shape(shape: object) -> tuple[int, ...] | None:
    """`shape` as a tuple of ints, or None when it has none (a jagged nested tensor's symbolic
    sizes, or anything else that is not a sequence of ints)."""
    if shape is None:
        return None
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        return None
    if all(type(d) is int for d in dims):
        return dims
    return None
