"""The small-tensor lane: a sample's small float32 CPU tensors, measured together as arrays.

Design decision: on a model of thousands of small layers the fixed cost per tensor is what a
sampled step pays: the objects of a reduction and its record (about fifteen per tensor, which
the garbage collector scans until the sample is written) and deriving nine metrics one tensor at
a time. The lane takes the common case: a plain strided float32 CPU tensor of 1 to
`numerics.BATCH_MAX` entries, outside torch.func transforms, when the default profile is the
only reducer. At the layer's return (or as its gradient arrives) it copies the values into a
NumPy array (a later in-place op cannot change them; the collector does not track arrays) and
keeps nothing else; at the end of the pass, `measure` reduces every copy in one segmented pass
(`numerics.segment_profiles`: the host path's numbers, bit for bit) into flat lists for a
`records.MeasurementBlock`, and a focus layer's histograms from the same sorted copies. A
failing batch measures each copy on its own: a failure stays in its own tensor's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from torchinstruments import reasons
from torchinstruments._torch_internals import functorch_active, is_functorch_wrapped
from torchinstruments.measurement import numerics

__all__ = ["copy_values", "measure", "takes"]

# The metrics the lane computes, in the order of `numerics.PROFILE`.
_COLUMN = {name: index for index, name in enumerate(numerics.PROFILE)}
_FINITE_COLUMNS = frozenset(_COLUMN[name] for name in numerics.FINITE_METRICS)


def takes(tensor: torch.Tensor) -> bool:
    """Whether the lane measures `tensor` (the caller checked the reducers)."""
    return (
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and tensor.dtype == torch.float32
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and 0 < tensor.numel() <= numerics.BATCH_MAX
        and not functorch_active()
        and not is_functorch_wrapped(tensor)
    )


def copy_values(tensor: torch.Tensor) -> np.ndarray:
    """A flat copy of the values as they are now (C order, whatever the tensor's strides).

    `numpy(force=True)` detaches a tensor that requires grad; on a plain CPU float32 tensor it
    is a view (the four dispatcher calls it makes return the tensor itself), `flatten` the copy.
    """
    return tensor.numpy(force=True).flatten()


def measure(
    copies: Sequence[np.ndarray], metrics: tuple[str, ...], focus: Sequence[bool], bins: int
) -> tuple[list[float | None], list[str | None], list[list[float] | None]]:
    """The `metrics` of every copy: `len(metrics)` values per copy, row-major, and their reasons;
    and per copy its `bins` histogram vector where `focus` (`numerics.histogram_vector`'s
    layout), else (and where it has no finite entry or fails) None.

    Never raises: when the batch fails, each copy is measured on its own, and a copy that fails
    alone gets null values with the error as their reason, and no histogram.
    """
    if not copies:
        return [], [], []
    try:
        return _measure_batch(copies, metrics, focus, bins)
    except Exception:  # each copy on its own: a failure stays in its own rows
        out: tuple[list[float | None], list[str | None], list[list[float] | None]] = [], [], []
        for copy, one in zip(copies, focus, strict=True):
            try:
                row = _measure_batch([copy], metrics, [one], bins)
            except Exception as error:
                reason = reasons.error("statistics", error)
                row = [None] * len(metrics), [reason] * len(metrics), [None]
            for whole, part in zip(out, row, strict=True):
                whole += part
        return out


def _measure_batch(
    copies: Sequence[np.ndarray], metrics: tuple[str, ...], focus: Sequence[bool], bins: int
) -> tuple[list[float | None], list[str | None], list[list[float] | None]]:
    """`measure` in one segmented pass."""
    lengths = np.fromiter((copy.size for copy in copies), dtype=np.int64, count=len(copies))
    values = np.concatenate(copies) if len(copies) > 1 else copies[0]
    wanted = [index for index, one in enumerate(focus) if one]
    profile, finite, vectors = numerics.segment_profiles(values, lengths, wanted, bins)
    columns = [_COLUMN[name] for name in metrics]
    chosen = profile[:, columns] if columns != list(range(len(numerics.PROFILE))) else profile
    flat = chosen.reshape(-1)
    out: list[float | None] = flat.tolist()
    why: list[str | None] = [None] * flat.size
    for position in np.flatnonzero(np.isnan(flat)).tolist():  # the nulls only
        row, column = divmod(position, len(columns))
        out[position] = None
        no_finite = finite[row] == 0 and columns[column] in _FINITE_COLUMNS
        why[position] = reasons.NO_FINITE if no_finite else reasons.NON_FINITE_RESULT
    return out, why, [vectors.get(index) for index in range(len(copies))]
