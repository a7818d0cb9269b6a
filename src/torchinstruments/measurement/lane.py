"""The small-tensor lane: a sample's small float32 CPU tensors, measured together as arrays.

Design decision: on a model of thousands of small layers the fixed cost per tensor is what a
sampled step pays: the objects of a reduction and its record (about fifteen per tensor, which
the garbage collector scans until the sample is written) and deriving nine metrics one tensor at
a time. The lane takes the common case: a plain strided float32 CPU tensor of 1 to
`BATCH_MAX` entries (`order.SMALL`: the host path would sort it too), outside torch.func
transforms, when the default profile is the only reducer. At the layer's return (or as its
gradient arrives) it copies the values into a NumPy array (a later in-place op cannot change
them; the collector does not track arrays) and keeps nothing else; at the end of the pass,
`measure` reduces the copies together into flat lists for a `records.MeasurementBlock`, and a
focus layer's histograms from the same sorted copies: each copy is sorted in place by one
NumPy sort, as the host path sorts a tensor alone (on the spare core while the pass goes on,
when there is one and the copy has `SORT_EACH_FROM` entries: `spare_core.SpareCore.later`),
then all are measured in one vectorised pass (`sorted_profiles`): the host path's numbers bit
for bit (`numerics.measure_sorted`: the same arithmetic on the same sorted entries, the moments'
chunks cut where they would cut a tensor alone). Fewer copies than `BATCH_FROM`, or a failing
batch, are measured one by one by that function. Copies of `HELD_FROM` entries or more count
against the observer's bound on kept copies (`spare_core.MAX_BYTES_HELD`): beyond it a tensor
is measured at once by the host path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from torchinstruments import reasons
from torchinstruments._torch_internals import functorch_active, is_functorch_wrapped
from torchinstruments.measurement import numerics, order
from torchinstruments.spare_core import Buffers

__all__ = [
    "BATCH_FROM",
    "BATCH_MAX",
    "HELD_FROM",
    "SORT_EACH_FROM",
    "copy_values",
    "measure",
    "sort_in_place",
    "sorted_profiles",
    "takes",
]

# The metrics the lane computes, in the order of `numerics.PROFILE`.
_COLUMN = {name: index for index, name in enumerate(numerics.PROFILE)}
_FINITE_COLUMNS = frozenset(_COLUMN[name] for name in numerics.FINITE_METRICS)
# The lane takes float32 tensors of at most BATCH_MAX entries (those the host path sorts too); a
# batch's fixed cost is that of measuring about BATCH_FROM copies alone.
BATCH_MAX, BATCH_FROM = order.SMALL, 4
# Copies of this many entries are sorted on the spare core, if there is one (a job each), and
# copies this long on average have their finite parts found by bisection (`sorted_profiles`).
SORT_EACH_FROM = 512
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


def sort_in_place(copy: np.ndarray) -> np.ndarray:
    """A copy sorted in place (the spare core's job: `measure` then reads it as ascending)."""
    copy.sort()
    return copy


def copy_values(tensor: torch.Tensor) -> np.ndarray:
    """A flat copy of the values as they are now (C order, whatever the tensor's strides).

    `numpy(force=True)` detaches a tensor that requires grad; on a plain CPU float32 tensor it
    is a view (the four dispatcher calls it makes return the tensor itself), `flatten` the copy.
    """
    return tensor.numpy(force=True).flatten()


def measure(
    copies: Sequence[np.ndarray],
    metrics: tuple[str, ...],
    focus: Sequence[bool],
    bins: int,
    ascending: Sequence[bool] | None = None,
    buffers: Buffers | None = None,
) -> tuple[list[float | None], list[str | None], list[list[float] | None]]:
    """The `metrics` of every copy: `len(metrics)` values per copy, row-major, and their reasons;
    and per copy its `bins` histogram vector where `focus` (`numerics.histogram_vector`'s
    layout), else (and where it has no finite entry or fails) None. Never raises.

    Each copy not already `ascending` is sorted in place (they are the lane's own), as the host
    path sorts a tensor alone; `BATCH_FROM` copies or more are then measured together
    (`sorted_profiles`). Fewer, and those of a batch that fails, are measured each alone by the
    host path (`numerics.measure_sorted`: the same numbers); a copy that fails alone is null
    with the error as the reason, no histogram."""
    ascending = ascending or [False] * len(copies)
    if len(copies) >= BATCH_FROM:
        with contextlib.suppress(Exception):  # each copy on its own: a failure stays in its rows
            for copy, ordered in zip(copies, ascending, strict=True):
                if not ordered:
                    copy.sort()
            return _measure_batch(copies, metrics, focus, bins, buffers)
    out: tuple[list[float | None], list[str | None], list[list[float] | None]] = [], [], []
    wanted = frozenset(metrics)
    for copy, one, ordered in zip(copies, focus, ascending, strict=True):
        values, why, vector = _alone(copy, metrics, wanted, bins if one else None, ordered)
        out[0].extend(values)
        out[1].extend(why)
        out[2].append(vector)
    return out


def _alone(
    copy: np.ndarray,
    metrics: tuple[str, ...],
    wanted: frozenset[str],
    bins: int | None,
    ascending: bool,
) -> tuple[list[float | None], list[str | None], list[float] | None]:
    """One copy's values, reasons and histogram, measured as the host path measures a tensor
    (sorted in place unless `ascending`; sorting a sorted copy again changes nothing)."""
    try:
        if not ascending:
            copy.sort()
        result = numerics.measure_sorted(copy, wanted, bins)
        got = numerics.DefaultDeriver(copy.size, wanted)(result.raw)
        vector = result.histogram if result.raw["finite"] else None
        return [got[m].value for m in metrics], [got[m].reason for m in metrics], vector
    except Exception as error:
        reason = reasons.error("statistics", error)
        return [None] * len(metrics), [reason] * len(metrics), None


def _measure_batch(
    copies: Sequence[np.ndarray],
    metrics: tuple[str, ...],
    focus: Sequence[bool],
    bins: int,
    buffers: Buffers | None,
) -> tuple[list[float | None], list[str | None], list[list[float] | None]]:
    """`measure` of ascending copies together."""
    wanted = [index for index, one in enumerate(focus) if one]
    profile, finite, vectors = sorted_profiles(copies, wanted, bins, buffers)
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


def sorted_profiles(
    copies: Sequence[np.ndarray],
    focus: Sequence[int] = (),
    bins: int = 1,
    buffers: Buffers | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[int, list[float] | None]]:
    """The default profile of every ascending float32 copy (as `np.sort` leaves them: NaN
    last) as a (copies, 9) float64 array in `PROFILE` order (NaN: null; "no finite entries"
    where the returned finite count is 0, else "non-finite result"), the finite counts, and the
    `bins` histogram vectors of the `focus` copies (None: no finite entry, or a failure):
    `measure_sorted`'s numbers, bit for bit (`_segment_arrays`: the same arithmetic on the same
    sorted finite entries), in one pass over them all. Long copies' finite parts and zeros are
    found by bisection (`numerics.finite_part`), short ones' by a mask over them all."""
    lengths = np.fromiter((copy.size for copy in copies), dtype=np.int64, count=len(copies))
    starts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    buffers = buffers or Buffers()
    ordered = copies[0]
    if len(copies) > 1:
        ordered = np.concatenate(
            copies, out=buffers.array("ordered", int(lengths.sum()), np.float32)
        )
    finite = lengths
    if ordered.size >= SORT_EACH_FROM * len(copies):  # a few long copies: a bisection each
        parts = [numerics.finite_part(copy) for copy in copies]
        zeros = np.fromiter((zeros for _, zeros in parts), dtype=np.float64, count=len(parts))
        if any(part.size != copy.size for (part, _), copy in zip(parts, copies, strict=True)):
            finite = np.fromiter((part.size for part, _ in parts), dtype=np.int64, count=len(parts))
            ordered = np.concatenate([part for part, _ in parts])
    else:  # many short ones: zeros and non-finite entries (sorted at the ends) by masks
        zeros = np.add.reduceat(ordered == 0, starts, dtype=np.float64)
        ends = starts + lengths - 1
        if not (np.isfinite(ordered[starts]).all() and np.isfinite(ordered[ends]).all()):
            kept = np.isfinite(ordered)
            finite = np.add.reduceat(kept, starts, dtype=np.int64)
            ordered = ordered[kept]
    return _profiles(ordered, finite, zeros, lengths, focus, bins, buffers)


def _profiles(
    ordered: np.ndarray,
    finite: np.ndarray,
    zeros: np.ndarray,
    lengths: np.ndarray,
    focus: Sequence[int],
    bins: int,
    buffers: Buffers | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[int, list[float] | None]]:
    """`sorted_profiles` from each copy's sorted finite entries (`ordered`, one after the
    other), their counts, the copies' zeros and lengths."""
    histograms: dict[int, list[float] | None] = dict.fromkeys(focus)
    profile = np.full((lengths.size, len(numerics.PROFILE)), np.nan)
    numel = lengths.astype(np.float64)
    profile[:, 7] = zeros / numel
    profile[:, 8] = (lengths - finite).astype(np.float64) / numel
    present = np.flatnonzero(finite)
    if present.size:
        counts = finite[present]
        starts = np.zeros(counts.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        deviations = (buffers or Buffers()).array("deviations", numerics.CHUNK, np.float64)
        mean, std, total, squares, low, high, *quartiles = _segment_arrays(
            ordered, starts, counts, deviations
        )
        profile[present, :7] = np.stack([mean, std, low, high, *quartiles], axis=1)
        shown = [segment for segment in focus if finite[segment]]
        with contextlib.suppress(Exception):  # a failure: no histogram, nothing else
            at = np.searchsorted(present, shown)
            first, count = starts[at].tolist(), counts[at].tolist()
            parts = [
                ordered[begin : begin + size] for begin, size in zip(first, count, strict=True)
            ]
            heads = np.stack([counts[at], low[at], high[at], total[at], squares[at]], axis=1)
            vectors = numerics.sorted_histograms(parts, heads.tolist(), bins) if parts else []
            histograms.update(zip(shown, vectors, strict=True))
    profile[~np.isfinite(profile)] = np.nan  # metric_value: a non-finite result is a null
    profile += 0.0  # -0.0 becomes 0.0, as metric_value does
    return profile, finite, histograms


def _segment_arrays(
    ordered: np.ndarray, starts: np.ndarray, counts: np.ndarray, scratch: np.ndarray | None = None
) -> list[np.ndarray]:
    """Mean, std, sum, sum of squares, min, max and the quartiles of each ascending segment of
    finite `ordered` (each at least one entry), float64 arrays: `numerics.measure_sorted`'s
    steps for many segments at once."""
    ends = starts + counts - 1
    steps = np.array([[q] for q in numerics.QUARTILES.values()])
    low, weight = numerics.quartile_positions((counts - 1).astype(np.float64), steps)
    at = starts + low.astype(np.int64)  # one row per quartile, one column per segment
    positions = np.concatenate([starts, ends, at.reshape(-1), np.minimum(at + 1, ends).reshape(-1)])
    shifts = ordered.take(starts + counts // 2).astype(np.float64)  # the middle entries
    sums = numerics.segment_sums(ordered, starts, counts, shifts, None, scratch)
    picked = ordered.take(positions).astype(np.float64).reshape(-1, counts.size)
    quartiles = numerics.lerp(picked[2:5], picked[5:], weight)
    return [*numerics.finish_moments(*sums[:3], counts, sums[3]), picked[0], picked[1], *quartiles]
