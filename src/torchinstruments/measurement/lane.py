"""The small-tensor lane: a sample's small float32 CPU tensors, measured together as arrays.

Design decision: on a model of thousands of small layers the fixed cost per tensor is what a
sampled step pays: the objects of a reduction and its record (about fifteen per tensor, which
the garbage collector scans until the sample is written) and deriving nine metrics one tensor at
a time. The lane takes the common case (`takes`) when the default profile is the only reducer:
at the layer's return (or as its gradient arrives) it copies the values into a NumPy array (a
later in-place op cannot change them; the collector does not track arrays), and at the end of
the pass `measure` reduces every copy in one vectorised pass, the host path's own arithmetic.
Copies of `HELD_FROM` entries or more count against the observer's bound on kept copies
(`spare_core.MAX_BYTES_HELD`): beyond it a tensor is measured at once by the host path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from torchinstruments import reasons
from torchinstruments._torch_internals import functorch_active, is_functorch_wrapped
from torchinstruments.measurement import numerics, order
from torchinstruments.spare_core import Buffers

__all__ = [
    "BATCH_MAX",
    "HELD_FROM",
    "copy_values",
    "measure",
    "takes",
]

# The lane takes float32 tensors of at most BATCH_MAX entries (those the host path sorts too).
BATCH_MAX = order.SMALL
# Copies of this many entries count against the copies an observer keeps at once (the caller
# checks: `spare_core.SpareCore.hold`); smaller ones are bounded by the count of layers.
HELD_FROM = 1 << 10


def takes(tensor: torch.Tensor) -> bool:
    """Whether the lane measures `tensor` (the caller checked the reducers)."""
    return (
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and tensor.dtype == torch.float32
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and 0 < tensor.numel() <= BATCH_MAX
        and not functorch_active()
        and not is_functorch_wrapped(tensor)
    )


def copy_values(tensor: torch.Tensor) -> np.ndarray:
    """A copy of the values as they are now, in the tensor's shape (C order whatever its strides).

    `numpy(force=True)` detaches a tensor that requires grad; on a plain CPU float32 tensor it
    is a view (the four dispatcher calls it makes return the tensor itself), `copy` the copy.
    """
    return tensor.numpy(force=True).copy()


def measure(
    copies: Sequence[np.ndarray],
    metrics: tuple[str, ...],
    focus: Sequence[bool],
    bins: int,
    buffers: Buffers | None = None,
    select: bool | None = None,
) -> tuple[list[float | None], list[str | None], list[list[float] | None]]:
    """The `metrics` of every copy: `len(metrics)` values per copy, row-major, and their reasons;
    and per copy its `bins` histogram vector where `focus` (`histograms.histogram_vector`'s
    layout), else (and where it has no finite entry or fails) None. Never raises.

    Each copy is sorted in place (they are the lane's own), as the host path sorts a tensor
    alone, then all are measured together (`numerics.sorted_profiles`: the host path's numbers,
    bit for bit); with `select` (by default where this CPU sorts slowly), copies of more than
    `order.SORTED_UP_TO` entries are selected instead, as the host path then selects them. If
    that fails, each copy is measured alone; one that fails alone is null with the error as the
    reason, no histogram."""
    select = order.selection_is_quicker() if select is None else select
    try:
        return _measure_together(copies, metrics, focus, bins, buffers, select)
    except Exception:  # each copy on its own: a failure stays in its rows
        pass
    out: tuple[list[float | None], list[str | None], list[list[float] | None]] = [], [], []
    for copy, one in zip(copies, focus, strict=True):
        try:
            values, why, vectors = _measure_together([copy], metrics, [one], bins, buffers, select)
        except Exception as error:
            why = [reasons.error("statistics", error)] * len(metrics)
            values, vectors = [None] * len(metrics), [None]
        out[0].extend(values)
        out[1].extend(why)
        out[2].extend(vectors)
    return out


def _measure_together(
    copies: Sequence[np.ndarray],
    metrics: tuple[str, ...],
    focus: Sequence[bool],
    bins: int,
    buffers: Buffers | None,
    select: bool,
) -> tuple[list[float | None], list[str | None], list[list[float] | None]]:
    """`measure` of all copies at once: the sorted and the selected ones, rows kept in order."""
    selected = [select and copy.size > order.SORTED_UP_TO for copy in copies]
    raw, vectors = np.empty((len(copies), len(numerics.RAW))), {}
    for ascending in (True, False):
        if rows := [row for row, chosen in enumerate(selected) if chosen != ascending]:
            batch = [copies[row] for row in rows]
            for copy in batch if ascending else ():
                copy.sort()  # sorting a sorted copy again changes nothing
            shown = [at for at, row in enumerate(rows) if focus[row]]
            raw[rows], found = numerics.sorted_profiles(batch, shown, bins, buffers, ascending)
            vectors.update((rows[at], vector) for at, vector in found.items())
    numel = np.fromiter((copy.size for copy in copies), dtype=np.float64, count=len(copies))
    out, why = numerics.profile_metrics(raw, numel, metrics)
    return out, why, [vectors.get(index) for index in range(len(copies))]
