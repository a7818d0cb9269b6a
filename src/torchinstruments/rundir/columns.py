"""The live history's columnar buffer: one Python list per column, turned into a DataFrame.

Design decision: a sample's measurements are appended with one `extend` per column, so the cost
per sample does not depend on how much history was already written, and the rows leave as one
DataFrame with the exact history schema when a part is written (`rundir.writer`). A cell that
does not fit its column (a custom record's value that is not a number) is replaced by null with
a reason, never lost with the rows around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat

import polars as pl

from torchinstruments import reasons
from torchinstruments.records import Measurement
from torchinstruments.rundir.layout import HISTORY_SCHEMA

__all__ = ["ColumnBuffer"]


@dataclass
class ColumnBuffer:
    """One list per history column; `frame` turns the first n rows into a DataFrame.

    `shape` and `mesh_coordinate` are kept as indices into `shapes` and `coordinates` (distinct
    ones are few), because building a List column from one Python list per row costs ~50x more
    than a gather.
    """

    columns: dict[str, list] = field(default_factory=lambda: {name: [] for name in HISTORY_SCHEMA})
    shapes: dict[tuple[int, ...] | None, int] = field(default_factory=dict)
    coordinates: dict[tuple[int, ...] | None, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.columns["metric"])

    def extend(self, m: Measurement) -> int:
        """Add one row per metric of `m`; returns the number of rows added."""
        k = len(m.metrics)
        if len(m.values) != k:
            raise ValueError(
                f"Measurement of {m.layer!r} has {k} metrics but {len(m.values)} values"
            )
        shape = _valid_shape(m.shape)
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
        c["placement"].extend(repeat(m.placement, k))
        coordinate = _valid_shape(m.mesh_coordinate)
        coordinate_id = self.coordinates.setdefault(coordinate, len(self.coordinates))
        c["mesh_coordinate"].extend(repeat(coordinate_id, k))
        c["mode"].extend(repeat(m.mode, k))
        c["grad_enabled"].extend(repeat(m.grad_enabled, k))
        c["metric"].extend(m.metrics)
        c["value"].extend(v.value for v in m.values)
        c["unavailable_reason"].extend(v.reason for v in m.values)
        return k

    def frame(self, n: int) -> pl.DataFrame:
        """The first `n` rows as a DataFrame with the exact history schema.

        A cell that does not fit its column (a custom record with a value that is not a number,
        say) is replaced by null, with a reason for `value`, and the frame is built again: one
        bad record never blocks the rows around it.
        """
        try:
            return self._frame(n)
        except Exception:  # a cell of the wrong type: repair the cells, keep every row
            self._repair(n)
            return self._frame(n)

    def _frame(self, n: int) -> pl.DataFrame:
        data = {}
        for name, dtype in HISTORY_SCHEMA.items():
            values = self.columns[name][:n]
            if name == "timestamp":
                data[name] = pl.Series(name, values, dtype=pl.Int64).cast(dtype)
            elif name in ("shape", "mesh_coordinate"):
                table = self.shapes if name == "shape" else self.coordinates
                distinct = pl.Series(
                    name, [None if s is None else list(s) for s in table], dtype=dtype
                )
                data[name] = distinct.gather(pl.Series(values, dtype=pl.UInt32))
            else:
                data[name] = pl.Series(name, values, dtype=dtype, strict=True)
        return pl.DataFrame(data)

    def _repair(self, n: int) -> None:
        """Null every cell of the first `n` rows that does not fit its column's type."""
        c = self.columns
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

    def drop(self, n: int) -> None:
        """Forget the first `n` rows (and the shape table once the buffer is empty)."""
        for values in self.columns.values():
            del values[:n]
        if not any(self.columns.values()):
            self.shapes.clear()
            self.coordinates.clear()


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
    "mode": str,
    "grad_enabled": bool,
    "metric": str,
    "value": (float, int),
    "unavailable_reason": str,
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
