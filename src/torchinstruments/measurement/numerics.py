"""The exact numerics of the default profile: one arithmetic per metric family, on every path.

Each family is written once, generic over NumPy arrays and torch tensors, so every path runs the
same IEEE operations in the same order:

* Quantiles (`profile_ranks`, `lerp`): NumPy's "linear" interpolation between the two order
  statistics around each quartile, read from a sorted copy up to `order.SMALL` entries (where
  this CPU sorts slowly, `order.select`), from `order.HostSelection` above, or `order.on_device`.
* Moments (`finish_moments` over `segment_sums` on the host, `device_sums` on the device): the
  shifted-data algorithm in float64, shifted by an entry near the median on the host (one pass)
  and by the mean on the device (two); float64 inputs scaled by a power of two (exact), so no
  variance or sum of huge values overflows into a null.
* Histogram counts: `histograms.histogram_vector`, over the statistics' own min, max and sums.

Reads of a float32 CPU tensor above `order.SMALL` entries (`tests/test_reads.py` counts them):
once if finite (the moments' pass also counts zeros and feeds the selection's brackets, min and
max) plus a random sample (`order.sample_positions`), a focus tensor's histogram once more; with
non-finite entries three times (that pass, finiteness, a copy of the finite entries). Up to
`order.SMALL` entries a sorted copy is read instead, or where the CPU sorts slowly the tensor
itself. A non-finite result is null; -0.0 is reported as 0.0.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchinstruments import reasons
from torchinstruments.measurement import histograms, order, tensors
from torchinstruments.records import MetricValue
from torchinstruments.spare_core import Buffers

__all__ = [
    "CHUNK",
    "PROFILE",
    "QUARTILES",
    "RAW",
    "CpuResult",
    "derived",
    "device_sums",
    "finish_moments",
    "finish_profiles",
    "lerp",
    "measure_array",
    "measure_on_cpu",
    "metric_value",
    "profile_metrics",
    "profile_ranks",
    "quartile_positions",
    "raw_on_device",
    "segment_sums",
    "sorted_profiles",
]

QUARTILES: dict[str, float] = {"p25": 0.25, "p50": 0.5, "p75": 0.75}
# The nine default metrics, in the order rows list them, and the raw profile's columns (every
# path's): the seven metrics of the finite entries, then how many entries are zeros and finite.
PROFILE = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")
RAW = (*PROFILE[:7], "zeros", "finite")
_Array = Any  # a NumPy array or a torch tensor: what the generic functions take

# Power-of-two scaling exponents stay in this range so that the scale and its inverse are normal.
_MAX_SCALE_EXPONENT = 1000


def _xp(array: _Array) -> Any:
    """The module whose functions apply to `array`: torch for tensors, else NumPy."""
    return torch if isinstance(array, torch.Tensor) else np


def profile_metrics(
    raw: np.ndarray, numel: np.ndarray, metrics: Sequence[str]
) -> tuple[list[float | None], list[str | None]]:
    """The `metrics` of tensors of `numel` entries from their raw profiles (a row each, `RAW`
    columns), row-major, and their reasons: the one derivation of every path. The fractions
    come from the counts; a std is capped at the largest magnitude, which bounds the exact one
    (rounding took entries at +-float64 max to an inf std); a non-finite result is null
    (`reasons.NO_FINITE` where the tensor has no finite entry), -0.0 is 0.0."""
    profile = np.empty((len(raw), len(PROFILE)))
    profile[:, :7] = raw[:, :7]
    if not raw[:, 8].all():  # no finite entry: nothing to order or average
        profile[raw[:, 8] == 0, :7] = np.nan
    np.minimum(profile[:, 1], np.abs(profile[:, 2:4]).max(1), out=profile[:, 1])
    np.divide(raw[:, 7], numel, out=profile[:, 7])
    np.divide(numel - raw[:, 8], numel, out=profile[:, 8])
    finite = np.isfinite(profile)
    if not (every := bool(finite.all())):  # the common case skips three calls (one tensor: 40%)
        np.copyto(profile, np.nan, where=~finite)
    profile += 0.0  # -0.0 becomes 0.0, as metric_value does
    columns = _columns(tuple(metrics))
    flat = (profile if columns is None else profile[:, columns]).reshape(-1)
    out: list[float | None] = flat.tolist()
    why: list[str | None] = [None] * flat.size
    for position in [] if every else np.flatnonzero(np.isnan(flat)).tolist():  # the nulls only
        row, column = divmod(position, len(metrics))
        out[position] = None
        no_finite = raw[row, 8] == 0 and PROFILE.index(metrics[column]) < 7  # of finite entries
        why[position] = reasons.NO_FINITE if no_finite else reasons.NON_FINITE_RESULT
    return out, why


@functools.lru_cache(maxsize=16)
def _columns(metrics: tuple[str, ...]) -> list[int] | None:
    """The `PROFILE` columns of `metrics`, None when they are all of them in order."""
    columns = [PROFILE.index(name) for name in metrics]
    return None if columns == list(range(len(PROFILE))) else columns


def derived(raw: Mapping[str, float], numel: int, metrics: Sequence[str]) -> dict[str, MetricValue]:
    """`profile_metrics` of one tensor's raw values (`RAW` names), by name."""
    row = np.array([[raw[name] for name in RAW]], dtype=np.float64)
    values, why = profile_metrics(row, np.array([numel]), metrics)
    return {m: MetricValue(v, r) for m, v, r in zip(metrics, values, why, strict=True)}


def metric_value(value: float) -> MetricValue:
    """A stored value, or null with a reason when it is not finite."""
    if not math.isfinite(value):
        return MetricValue(None, reasons.NON_FINITE_RESULT)
    return MetricValue(value + 0.0)  # + 0.0 turns -0.0 into 0.0


# --- quantiles: positions and interpolation (generic) -------------------------------------------


def quartile_positions(last: _Array, q: _Array) -> tuple[_Array, _Array]:
    """The lower neighbour's 0-based position (integral) of quantile
    `q` among `last + 1` sorted entries, and the interpolation weight towards the next one."""
    rank = last * q
    low = _xp(rank).floor(rank)
    return low, rank - low


def lerp(a: _Array, b: _Array, t: _Array) -> _Array:
    """Linear interpolation exactly as `numpy.percentile(method="linear")` rounds it, float64."""
    xp, diff = _xp(a), b - a
    with np.errstate(over="ignore", invalid="ignore"):
        result = xp.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
        if xp is not np or not np.isfinite(result).all():  # on a device: no sync to ask
            result = xp.where(xp.isfinite(result), result, a * (1 - t) + b * t)  # b - a overflowed
    return xp.where(a == b, a, result)


# --- moments ------------------------------------------------------------------------------------

# Entries per chunk of the float64 moments on the host: bounds their temporaries.
CHUNK = 1 << 16


def finish_moments(
    shift: _Array, squares: _Array, residual: _Array, counts: _Array, scale: _Array | float
) -> tuple[_Array, _Array, _Array, _Array]:
    """Mean, population std, sum and sum of squares from the scaled sums (generic).

    `residual` and `squares` are the sums of the deviations of the values (scaled by 1 /
    `scale`) from `shift` and of their squares: the shifted-data algorithm, accurate when the
    shift is near the mean (within a standard deviation, as any median is, it loses at most a bit).
    """
    xp = _xp(squares)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        mean = shift + residual / counts
        variance = (squares - residual * residual / counts) / counts  # rounding's negatives: 0
        std = xp.sqrt(np.maximum(0.0, variance) if xp is np else variance.clip(min=0.0))
        # sum(x**2) = sum(d**2) + 2 shift sum(d) + count shift**2, with d = x - shift
        sum_squares = squares + 2.0 * shift * residual + counts * shift * shift
        total = shift * counts + residual
        if isinstance(scale, float) and scale == 1.0:  # the common case: x * 1.0 is x, bit for bit
            return mean, std, total, sum_squares
        return mean * scale, std * scale, total * scale, sum_squares * scale * scale


_FIRST = np.zeros(1, dtype=np.intp)  # reduceat's start of a chunk's only segment
_FEW_SEGMENTS = 8  # a chunk of at most this many segments subtracts each one's shift in place


def segment_sums(
    values: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    shifts: np.ndarray,
    visit: Any = None,
    scratch: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """What `finish_moments` takes per segment of finite float32/float64 `values` (`starts`
    ascending, `counts` >= 1, `shifts` float64 near each one's median): the shifts scaled, the
    deviations' squares and sums, and the scale (a power of two, for float64 values whose squares
    could overflow or underflow). One pass, at most `CHUNK` entries at a time, each segment cut
    where it would be alone (`_chunk_end`: the same bits alone and in a batch); `visit` sees each
    chunk while it is in the cache; `scratch` is float64 room for a chunk's deviations."""
    scale = 1.0
    if values.dtype == np.float64:
        max_abs = float(np.max(np.abs(values)))
        if max_abs > 2.0**400 or max_abs < 2.0**-400:
            exponent = math.frexp(max_abs)[1] if max_abs else 0
            scale = math.ldexp(1.0, max(-_MAX_SCALE_EXPONENT, min(_MAX_SCALE_EXPONENT, exponent)))
    inverse = 1.0 / scale
    shifts = shifts * inverse if scale != 1.0 else shifts
    ends = starts + counts
    squares, residual = np.zeros(counts.size), np.zeros(counts.size)
    end = int(ends[-1])
    lo = int(starts[0])
    while lo < end:
        hi = _chunk_end(starts, lo, end)
        chunk = values[lo:hi]
        if visit is not None:
            visit(chunk)
        piece = chunk if scale == 1.0 else chunk * inverse
        if counts.size == 1:  # one tensor: every chunk is its only segment's
            first, last, local = 0, 1, _FIRST
        else:
            first = int(np.searchsorted(ends, lo, side="right"))
            last = int(np.searchsorted(starts, hi, side="left"))
            local = np.maximum(starts[first:last] - lo, 0)
        if scratch is None:  # one array for every chunk: fresh pages cost a fault each
            scratch = np.empty(min(CHUNK, end - lo))
        deviations = scratch[: piece.size]
        np.copyto(deviations, piece)
        if last - first == 1:
            deviations -= shifts[first]
        elif last - first <= _FEW_SEGMENTS:  # a slice each: no repeated shifts to allocate
            bounds = [*local.tolist(), hi - lo]
            for segment in range(first, last):
                deviations[bounds[segment - first] : bounds[segment - first + 1]] -= shifts[segment]
        else:
            deviations -= np.repeat(shifts[first:last], np.diff(local, append=hi - lo))
        residual[first:last] += np.add.reduceat(deviations, local)
        squares[first:last] += np.add.reduceat(np.square(deviations, out=deviations), local)
        lo = hi
    return shifts, squares, residual, scale


def _chunk_end(starts: np.ndarray, lo: int, end: int) -> int:
    """Where the chunk from `lo` ends: each segment is cut where it would be alone."""
    if lo + CHUNK >= end or starts.size == 1:
        return min(lo + CHUNK, end)
    start = int(starts[np.searchsorted(starts, lo + CHUNK, side="right") - 1])
    return start if start > lo else lo + CHUNK


def device_sums(
    values: torch.Tensor, finite: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | float]:
    """`segment_sums` of the finite entries (`finite`: their mask, `count`: how many, at least
    1) of one tensor, as 0-d float64 tensors on its device, without a host synchronisation: the
    shift is their mean, from a first pass. The deviations' sum is that pass's sum less `count`
    shifts: a sum of deviations of entries near +-3.4e38 would round to their precision."""
    wide = torch.where(finite, values.to(torch.float64), 0.0)
    scale: torch.Tensor | float = 1.0
    if values.dtype == torch.float64:
        max_abs = wide.abs().amax()
        exponent = torch.frexp(max_abs).exponent.to(torch.int64)
        exponent = exponent.clamp(-_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
        scale = _power_of_two(exponent)
        big_or_tiny = (max_abs > 2.0**400) | (max_abs < 2.0**-400)
        scale = torch.where(big_or_tiny, scale, 1.0)
        wide = wide / scale
    total = wide.sum()
    shift = total / count
    wide = torch.where(finite, wide.sub_(shift), 0.0)
    return shift, torch.dot(wide, wide), total - shift * count, scale


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as an exact float64 built from its bit pattern (exponent within ±1000)."""
    return ((exponent + 1023) << 52).reshape(1).view(torch.float64).reshape(())


# --- the host paths: one tensor, or many small ones -----------------------------------------------

# Copies this long on average have their finite parts and zeros found by bisection, a call each;
# shorter ones by masks over them all (`sorted_profiles`).
_BISECT_FROM = 512
_QUARTILE_STEPS = np.array([[q] for q in QUARTILES.values()])
# Per dtype, 0 and the least positive value: the entries below them are the negative ones and
# those at most 0 (-0.0 is not below 0.0), so the zeros lie between.
_ZERO_BOUNDS = {
    np.dtype(t): np.array([0, np.nextafter(t(0), t(1))], dtype=t) for t in (np.float32, np.float64)
}


@dataclass
class CpuResult:
    """Raw values of the default profile (`RAW` names, as `derived` reads them) and the histogram."""

    raw: dict[str, float]
    histogram: list[float] | None


def measure_on_cpu(tensor: torch.Tensor, bins: int | None, select: bool | None = None) -> CpuResult:
    """Default-profile raw values of a plain CPU tensor and, if `bins`, its histogram vector
    (`measure_array`); never written."""
    if tensor.dtype in _IN_PLACE:  # read as it is: one torch call (each costs about 8 us
        flat = tensor.numpy().reshape(-1)  # between NumPy's passes, its code out of the caches)
    else:
        flat = tensor.reshape(-1).to(tensors.working_dtype(tensor.dtype)).numpy()
    return measure_array(flat, bins, select)


_IN_PLACE = (torch.float32, torch.float64)  # the working dtypes (`tensors.working_dtype`)


def measure_array(array: np.ndarray, bins: int | None, select: bool | None = None) -> CpuResult:
    """`measure_on_cpu` of a flat float32/float64 array: up to `order.SMALL` entries
    `sorted_profiles` of a sorted copy (with `select`, by default where this CPU sorts slowly,
    none above `order.SORTED_UP_TO`), above them `_measure_selected`, of the array if it is
    finite (presumed for float32, as its moments' pass shows), else of its finite copy."""
    select = order.selection_is_quicker() if select is None else select
    if array.size > order.SMALL:
        if array.dtype == np.float32:
            with contextlib.suppress(FloatingPointError):
                return _measure_selected(array, bins, select)
        finite = np.isfinite(array)
        array = array if finite.all() else array[finite]
        if array.size > order.SMALL:
            return _measure_selected(array, bins, select)
    ascending = not select or array.size <= order.SORTED_UP_TO
    copy = np.sort(array) if ascending else array
    raw, vectors = sorted_profiles([copy], [0] if bins else (), bins or 1, None, ascending)
    return CpuResult(dict(zip(RAW, raw[0].tolist(), strict=True)), vectors.get(0))


def _finite_part(ordered: np.ndarray) -> tuple[np.ndarray, int]:
    """An ascending array's finite entries (a view) and how many are zeros, by bisection."""
    first, end = 0, ordered.size
    if end and not (math.isfinite(ordered[0]) and math.isfinite(ordered[-1])):
        first = int(ordered.searchsorted(ordered.dtype.type(-math.inf), "right"))
        end = int(ordered.searchsorted(ordered.dtype.type(math.inf), "left"))
    values = ordered[first:end]
    negative, not_positive = values.searchsorted(_ZERO_BOUNDS[values.dtype]).tolist()
    return values, not_positive - negative


def sorted_profiles(
    copies: Sequence[np.ndarray],
    focus: Sequence[int] = (),
    bins: int = 1,
    buffers: Buffers | None = None,
    ascending: bool = True,
) -> tuple[np.ndarray, dict[int, list[float] | None]]:
    """The raw profile of every copy (float32/float64, of one dtype), a (copies, 9) float64
    array in `RAW` order (NaN where a copy has no finite entry), and the `bins` histogram vectors
    of the `focus` copies (None: no finite entry, or a failure), in one pass over them all, each
    copy's numbers the same bits alone and among others. `ascending` copies (as `np.sort` leaves
    them): finite parts and zeros by bisection where long (`_finite_part`), by masks where short,
    order statistics read at their ranks; else (where this CPU sorts slowly) the copies as they
    are: masks, and the order statistics selected (`order.select`)."""
    lengths = np.fromiter((copy.size for copy in copies), dtype=np.int64, count=len(copies))
    starts = _starts(lengths)
    buffers = buffers or Buffers()
    ordered = copies[0]
    if len(copies) > 1:
        room = buffers.array("ordered", int(lengths.sum()), ordered.dtype.type)
        ordered = np.concatenate(copies, out=room)
    finite = lengths
    if ascending and ordered.size >= _BISECT_FROM * len(copies):  # a few long: a bisection each
        parts = [_finite_part(copy) for copy in copies]
        zeros = np.fromiter((zeros for _, zeros in parts), dtype=np.float64, count=len(parts))
        if any(part.size != copy.size for (part, _), copy in zip(parts, copies, strict=True)):
            finite = np.fromiter((part.size for part, _ in parts), dtype=np.int64, count=len(parts))
            ordered = np.concatenate([part for part, _ in parts])
    else:  # many short sorted ones (any NaN or inf at an end), or unsorted ones: by masks
        zero = (ordered == 0).view(np.int8)  # int8 summed into int32: half a bool's cost
        zeros = np.add.reduceat(zero, starts, dtype=np.int32)
        sorted_finite = (  # sorted copies with finite ends are finite: no mask to make
            ascending
            and np.isfinite(ordered[starts]).all()
            and np.isfinite(ordered[starts + lengths - 1]).all()
        )
        if not sorted_finite and not (kept := np.isfinite(ordered)).all():
            finite = np.add.reduceat(kept.view(np.int8), starts, dtype=np.int64)
            ordered = ordered[kept]
    raw = np.empty((lengths.size, len(RAW)))
    raw[:, :7], raw[:, 7], raw[:, 8] = np.nan, zeros, finite
    shown_vectors: dict[int, list[float] | None] = dict.fromkeys(focus)
    present = finite.nonzero()[0]
    if present.size:
        counts = finite[present]
        at = _starts(counts)
        ranks, weight = _ranks_of(int(counts[0])) if counts.size == 1 else profile_ranks(counts - 1)
        if ascending:
            picked = ordered.take(ranks + at).astype(np.float64)
        else:
            segments = zip(at.tolist(), counts.tolist(), ranks.T, strict=True)
            picked = np.stack([order.select(ordered[a : a + c], r) for a, c, r in segments], 1)
        shifts = np.where(counts % 2 == 1, picked[3], picked[6])  # the middle entries
        scratch = buffers.array("deviations", min(CHUNK, ordered.size), np.float64)
        sums = segment_sums(ordered, at, counts, shifts, None, scratch)
        raw[present, :7], total, squares = finish_profiles(picked, weight, sums, counts)
        if shown := [copy for copy in focus if finite[copy]]:
            with contextlib.suppress(Exception):  # a failure: no histograms, nothing else
                rows = present.searchsorted(shown)
                parts = [ordered[at[row] : at[row] + counts[row]] for row in rows.tolist()]
                head, low, high = (counts[rows], total[rows], squares[rows]), *picked[:2, rows]
                if ascending:
                    vectors = histograms.histogram_vector(parts, low, high, head, bins, None, True)
                else:  # each part counted alone
                    each = zip(parts, low, high, zip(*head, strict=True), strict=True)
                    vectors = [histograms.histogram_vector(*one, bins) for one in each]
                shown_vectors.update(zip(shown, vectors, strict=True))
    return raw, shown_vectors


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive segments of `lengths` (int64) starts: 0, then the running sum."""
    starts = np.zeros_like(lengths)
    lengths[:-1].cumsum(out=starts[1:])
    return starts


def profile_ranks(last: _Array) -> tuple[_Array, _Array]:
    """Per entry of `last` (int64, the position of a tensor's last sorted finite entry) the
    sorted positions to read, a row each (min, max, each quartile's lower then upper neighbour),
    and the quartiles' interpolation weights (generic): the one quantile routine of every path."""
    xp = _xp(last)
    if xp is torch:
        steps = torch.tensor(_QUARTILE_STEPS, device=last.device)
        low, weight = quartile_positions(last.to(torch.float64), steps)
        low = low.to(torch.int64)
    else:
        low, weight = quartile_positions(last.astype(np.float64), _QUARTILE_STEPS)
        low = low.astype(np.int64)
    first = last[None] * 0
    return xp.concatenate([first, last[None], low, xp.minimum(low + 1, last)]), weight


@functools.lru_cache(maxsize=64)
def _ranks_of(size: int) -> tuple[np.ndarray, np.ndarray]:
    """`profile_ranks` of one tensor of `size` finite entries (cached: a layer's sizes repeat)."""
    ranks, weight = profile_ranks(np.array([size - 1]))
    ranks.flags.writeable = weight.flags.writeable = False  # shared by every call
    return ranks, weight


def finish_profiles(
    picked: _Array, weight: _Array, sums: tuple[Any, Any, Any, Any], counts: _Array
) -> tuple[_Array, _Array, _Array]:
    """The first seven `RAW` columns of tensors with `counts` finite entries from the entries
    at `profile_ranks` (`picked`, float64, a row each) and their `segment_sums` or
    `device_sums`; also their sums and sums of squares, a histogram's head (generic)."""
    mean, std, total, squares = finish_moments(*sums[:3], counts, sums[3])
    quartiles = lerp(picked[2:5], picked[5:], weight)
    columns = [mean[None], std[None], picked[:2], quartiles]  # rows, one a metric
    return _xp(picked).concatenate(columns).T, total, squares


@np.errstate(invalid="ignore", over="ignore")  # a float32 tensor is presumed finite
def _measure_selected(values: np.ndarray, bins: int | None, select: bool) -> CpuResult:
    """`measure_array` above `order.SMALL` entries by `HostSelection`, or FloatingPointError."""
    selection = order.HostSelection(values, select)
    counts = np.array([values.size])
    ranks, weight = _ranks_of(values.size)
    selection.want(ranks[:, 0].tolist())
    sums = segment_sums(values, _FIRST, counts, np.array([selection.pivot]), selection.visit)
    if not math.isfinite(sums[1][0]):
        raise FloatingPointError
    picked = np.array(selection.selected(), dtype=np.float64)[:, None]
    profile, total, squares = finish_profiles(picked, weight, sums, counts)
    zeros = float(selection.zeros)
    raw = dict(zip(RAW, [*profile[0].tolist(), zeros, values.size], strict=True))
    histogram = None
    if bins:
        head = (values.size, float(total[0]), float(squares[0]))
        with contextlib.suppress(Exception):  # a failure: no histogram, as in `sorted_profiles`
            histogram = histograms.histogram_vector(values, raw["min"], raw["max"], head, bins)
    return CpuResult(raw, histogram)


# --- the general path: torch ops on the tensor's device, no host sync ---------------------------


def raw_on_device(
    values: torch.Tensor, bins: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The raw profile (`RAW`) as one float64 device vector, without a host synchronisation
    (order statistics by `order.on_device`), and with `bins` the histogram vector."""
    finite_mask = torch.isfinite(values)
    finite = finite_mask.sum()
    count, counted = finite.to(torch.float64), finite.to(torch.float64).clamp(min=1.0)
    ranks, weight = profile_ranks((finite - 1).clamp(min=0).reshape(1))
    picked = order.on_device(values, finite_mask, ranks.reshape(-1)).to(torch.float64)
    sums = device_sums(values, finite_mask, counted)
    profile, total, squares = finish_profiles(picked[:, None], weight, sums, counted.reshape(1))
    zeros = (values.numel() - torch.count_nonzero(values)).to(torch.float64)
    block = torch.cat([profile[0], torch.stack([zeros, count])])
    if bins is None:
        return block, None
    low, high = (torch.where(count > 0, v, 0.0) for v in (picked[0], picked[1]))
    head = (count, total[0], squares[0])
    return block, histograms.histogram_vector(values, low, high, head, bins, finite_mask)
