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
focus layer's histograms from the same sorted copies:

* copies of `SORT_EACH_FROM` entries or more are each sorted in place by one NumPy sort, as
  the host path sorts a tensor alone (on the spare core while the pass goes on, when there is
  one: `spare_core.SpareCore.later`), then measured in one vectorised pass (`sorted_profiles`);
* shorter ones, when there are `BATCH_FROM` of them, in one segmented pass with ONE sort of
  all of them (`segment_profiles`), which costs less than a call each.

Both give the host path's numbers bit for bit (`numerics.measure_sorted`: the same arithmetic on
the same sorted entries, the moments' chunks cut where they would cut a tensor alone); fewer
short copies than `BATCH_FROM`, or a failing batch, are measured one by one by that function.
Copies of `HELD_FROM` entries or more count against the observer's bound on kept copies
(`spare_core.MAX_BYTES_HELD`): beyond it a tensor is measured at once by the host path.
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
    "segment_profiles",
    "sort_in_place",
    "sorted_profiles",
    "sorted_segments",
    "takes",
]

# The metrics the lane computes, in the order of `numerics.PROFILE`.
_COLUMN = {name: index for index, name in enumerate(numerics.PROFILE)}
_FINITE_COLUMNS = frozenset(_COLUMN[name] for name in numerics.FINITE_METRICS)
# The lane takes float32 tensors of at most BATCH_MAX entries; a batch's fixed cost (about 0.2 ms
# in a training step) is that of measuring BATCH_FROM copies alone.
BATCH_MAX, BATCH_FROM = order.SMALL, 16
# Copies of this many entries are sorted one by one, not in the batch's one sort (`measure`).
SORT_EACH_FROM = 512
# Copies of this many entries count against the copies an observer keeps at once (the caller
# checks: `spare_core.SpareCore.hold`); smaller ones are bounded by the count of layers.
HELD_FROM = 1 << 10
_KEY_OFFSET = 1 << 31  # float32 keys shifted into [0, 2**32) below the segment index
_INF_KEY = 0x7F800000  # the key of +inf: non-finite entries sort after every finite one


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

    Copies of `SORT_EACH_FROM` entries or more are sorted in place (they are the lane's own),
    each by one NumPy sort as the host path sorts a tensor, then measured together
    (`sorted_profiles`); shorter ones in one segmented pass with one sort for all
    (`segment_profiles`) when there are `BATCH_FROM` of them. The others, and those of a batch
    that fails, are measured each alone by the host path (`numerics.measure_sorted`: the same
    numbers); a copy that fails alone is null with the error as the reason, no histogram."""
    k = len(metrics)
    ascending = ascending or [False] * len(copies)
    rows: list[_Row | None] = [None] * len(copies)
    long = [index for index, copy in enumerate(copies) if copy.size >= SORT_EACH_FROM]
    short = [index for index, copy in enumerate(copies) if copy.size < SORT_EACH_FROM]
    for chosen, presorted in ((long, True), (short, False)):
        if not chosen or (not presorted and len(chosen) < BATCH_FROM):
            continue
        with contextlib.suppress(Exception):  # each copy on its own: a failure stays in its rows
            picked = [copies[index] for index in chosen]
            chosen_focus = [focus[index] for index in chosen]
            if presorted:
                for index in chosen:
                    if not ascending[index]:
                        copies[index].sort()
            batch = _measure_batch(picked, metrics, chosen_focus, bins, presorted, buffers)
            if len(chosen) == len(copies):
                return batch
            for at, index in enumerate(chosen):
                part = slice(at * k, (at + 1) * k)
                rows[index] = (batch[0][part], batch[1][part], batch[2][at])
    out: tuple[list[float | None], list[str | None], list[list[float] | None]] = [], [], []
    wanted = frozenset(metrics)
    for copy, one, row, ordered in zip(copies, focus, rows, ascending, strict=True):
        values, why, vector = row or _alone(copy, metrics, wanted, bins if one else None, ordered)
        out[0].extend(values)
        out[1].extend(why)
        out[2].append(vector)
    return out


# One copy's values, reasons (one each per metric) and histogram vector.
_Row = tuple[list[float | None], list[str | None], list[float] | None]


def _alone(
    copy: np.ndarray,
    metrics: tuple[str, ...],
    wanted: frozenset[str],
    bins: int | None,
    ascending: bool,
) -> _Row:
    """One copy's row, measured as the host path measures a tensor (sorted in place)."""
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
    presorted: bool,
    buffers: Buffers | None,
) -> tuple[list[float | None], list[str | None], list[list[float] | None]]:
    """`measure` of copies together: each already ascending (`presorted`), or in one
    segmented pass with one sort of them all."""
    wanted = [index for index, one in enumerate(focus) if one]
    if presorted:
        profile, finite, vectors = sorted_profiles(copies, wanted, bins, buffers)
    else:
        lengths = np.fromiter((copy.size for copy in copies), dtype=np.int64, count=len(copies))
        values = np.concatenate(copies) if len(copies) > 1 else copies[0]
        profile, finite, vectors = segment_profiles(values, lengths, wanted, bins)
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


def sorted_segments(
    values: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The finite entries of each small float32 segment of `values`, ascending (ONE sort of
    int64 keys, the segment index above the float32 sortable key; non-finite entries get +inf's
    key and are dropped), each segment's finite count and its count of zeros (float64; -0.0 is
    a zero)."""
    count = lengths.size
    starts = np.zeros(count, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    zeros = np.add.reduceat(values == 0, starts, dtype=np.float64)
    finite = np.isfinite(values)
    all_finite = bool(finite.all())
    bits = values.view(np.int32)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)
    if not all_finite:
        keys[~finite] = _INF_KEY
    keys += np.repeat(np.arange(count, dtype=np.int64) << 32, lengths) + _KEY_OFFSET
    keys.sort()
    local = ((keys & 0xFFFFFFFF) - _KEY_OFFSET).astype(np.int32)
    ordered = (local ^ ((local >> 31) & 0x7FFFFFFF)).view(np.float32)
    counts = lengths
    if not all_finite:
        kept = local != _INF_KEY
        counts = np.add.reduceat(kept, starts, dtype=np.int64)
        ordered = ordered[kept]
    return ordered, counts, zeros


def segment_profiles(
    values: np.ndarray, lengths: np.ndarray, focus: Sequence[int] = (), bins: int = 1
) -> tuple[np.ndarray, np.ndarray, dict[int, list[float] | None]]:
    """The default profile of every float32 segment of `values` as a (segments, 9) float64
    array in `PROFILE` order (NaN: null; "no finite entries" where the returned finite count is
    0, else "non-finite result"), the finite counts, and the `bins` histogram vectors of the
    `focus` segments (None: no finite entry, or a failure): `measure_on_cpu`'s numbers, bit for
    bit (`_segment_arrays`: the same arithmetic on the same sorted finite entries), without
    Python work per segment but per focus segment."""
    ordered, finite, zeros = sorted_segments(values, lengths)
    return _profiles(ordered, finite, zeros, lengths, focus, bins)


def sorted_profiles(
    copies: Sequence[np.ndarray],
    focus: Sequence[int] = (),
    bins: int = 1,
    buffers: Buffers | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[int, list[float] | None]]:
    """`segment_profiles` of copies each already ascending (as `np.sort` leaves them): their
    finite entries and zeros found by bisection (`numerics.finite_part`), then the same."""
    parts = [numerics.finite_part(copy) for copy in copies]
    buffers = buffers or Buffers()
    ordered = parts[0][0]
    if len(parts) > 1:
        room = buffers.array("ordered", sum(part.size for part, _ in parts), np.float32)
        ordered = np.concatenate([part for part, _ in parts], out=room)
    finite = np.fromiter((part.size for part, _ in parts), dtype=np.int64, count=len(parts))
    zeros = np.fromiter((zeros for _, zeros in parts), dtype=np.float64, count=len(parts))
    lengths = np.fromiter((copy.size for copy in copies), dtype=np.int64, count=len(copies))
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
    """`segment_profiles` from each segment's sorted finite entries (`ordered`, one after the
    other), their counts, the segments' zeros and lengths."""
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
