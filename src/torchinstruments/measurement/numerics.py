"""The exact numerics of the default profile: order statistics, moments, quartiles, histograms.

One general exact path and two fast paths that hand over to it (`reducers` chooses):

* General path (`raw_on_device`): torch ops only, on the tensor's own device, without any host
  synchronisation, for any tensor torch can compute on (CUDA and other devices, tensor
  subclasses, whatever a fast path declines or fails on). Non-finite entries are replaced by +inf
  and the tensor is sorted once; min, max and the quartile neighbours are gathered at positions
  computed on the device from the finite count, and the interpolation is done on the host by
  `DefaultDeriver`. One sort is O(n log n), the cheapest sync-free exact selection on a GPU, with
  no size limit (unlike `torch.quantile`, which refuses inputs over 2**24 elements). A focus
  tensor's histogram is counted from the same sort (`histograms.vector_from_sort`).
* CPU fast path, one tensor (`measure_on_cpu`, plain strided CPU tensors of any size): NumPy's
  vectorised sort of a copy of the working values, then reads and binary searches only. NaN sorts
  last and -inf first, so the counts of -inf, finite and zero entries are insertion points, and
  the finite entries are one slice whose ends are min and max. Measured (`bench/statistics.py`,
  one thread): NumPy sorts 16k float32 in ~70 us where `torch.sort` takes ~1.3 ms. Its one
  temporary of the tensor's size is the sorted copy (the float64 moments go chunk by chunk); the
  chunked radix passes it replaced above 2**24 entries cost 10x to 14x more per element at 2e7
  (see docs/benchmarks.md, `bench/statistics.py --sizes 1e7,2e7`).
* CPU fast path, the small tensors of one sample (`measure_batch_on_cpu`: at least `BATCH_MIN`
  of at most `BATCH_MAX` entries each): one NumPy sort of int64 keys holding the tensor's index
  above the float32 sortable key, so that the whole batch becomes one array of sorted finite
  segments (a sort per tensor costs ~40 us of fixed NumPy calls, whatever its size).

Both CPU paths end in the same place: the finite entries of each tensor, ascending, one segment
after another (`_from_sorted`), whose moments are one segmented function (`host_moments`) and
whose histogram is one count (`host_histogram`). Bin counts are differences of exact edge counts,
so they agree with the reported edges as `numpy.histogram` bins them. Mean and std are always
accumulated in float64 with a corrected two-pass algorithm, float64 inputs on values scaled by a
power of two (exact), so neither a variance nor a sum of huge values overflows into a null.

Quartiles use NumPy's "linear" interpolation. A value that comes out non-finite is never stored:
it is null with the reason "non-finite result". Negative zero results are reported as 0.0.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from torchinstruments import reasons
from torchinstruments.measurement import tensors
from torchinstruments.records import MetricValue

QUARTILES: dict[str, float] = {"p25": 0.25, "p50": 0.5, "p75": 0.75}
FINITE_METRICS = frozenset({"mean", "std", "min", "max", "p25", "p50", "p75"})

# Power-of-two scaling exponents stay in this range so that the scale and its inverse are normal.
_MAX_SCALE_EXPONENT = 1000


@dataclass(frozen=True, slots=True)
class DefaultDeriver:
    """Turns the raw values (counts, moments, quartile neighbours) into the default metrics."""

    numel: int
    wanted: frozenset[str]

    def __call__(self, raw: dict[str, float]) -> dict[str, MetricValue]:
        """Computes fractions and interpolated quartiles on the host."""
        out: dict[str, MetricValue] = {}
        finite = round(raw["finite"])
        if "nonfinite_fraction" in self.wanted:
            out["nonfinite_fraction"] = metric_value((self.numel - finite) / self.numel)
        if "zero_fraction" in self.wanted:
            out["zero_fraction"] = metric_value(raw["zeros"] / self.numel)
        if finite == 0:
            for name in self.wanted & FINITE_METRICS:
                out[name] = MetricValue(None, reasons.NO_FINITE)
            return out
        for name in ("mean", "std", "min", "max"):
            if name in self.wanted:
                out[name] = metric_value(raw[name])
        for name, q in QUARTILES.items():
            if name in self.wanted:
                gamma = (finite - 1) * q - math.floor((finite - 1) * q)
                out[name] = metric_value(_lerp(raw[f"{name}_lo"], raw[f"{name}_hi"], gamma))
        return out


def _lerp(a: float, b: float, t: float) -> float:
    """Linear interpolation exactly as `numpy.percentile(method="linear")` rounds it."""
    if a == b:
        return a
    diff = b - a
    result = b - diff * (1 - t) if t >= 0.5 else a + diff * t
    if not math.isfinite(result):  # b - a overflowed; this form cannot
        result = a * (1 - t) + b * t
    return result


def metric_value(value: float) -> MetricValue:
    """A stored value, or null with a reason when it is not finite."""
    if not math.isfinite(value):
        return MetricValue(None, reasons.NON_FINITE_RESULT)
    return MetricValue(value + 0.0)  # + 0.0 turns -0.0 into 0.0


# --- host: the edges, the moments and the histogram of sorted finite segments -----------------

# Entries per chunk of the float64 moments: bounds their temporaries (8 MiB of float64 each).
CHUNK = 1 << 20


def edges_on_host(low: float, high: float, bins: int) -> np.ndarray:
    """bins + 1 non-decreasing float64 edges from low to high, exactly as `_edges` computes them.

    The same IEEE operations in the same order as the torch version (`histograms._edges`, which
    the general path runs on the device), elementwise in NumPy, so every path reports identical
    edges.
    """
    steps, complement = _steps(bins)
    edges = low * complement
    edges += high * steps
    np.maximum.accumulate(edges, out=edges)
    np.maximum(edges, low, out=edges)
    np.minimum(edges, high, out=edges)
    edges[0], edges[-1] = low, high
    return edges


@functools.lru_cache(maxsize=8)
def _steps(bins: int) -> tuple[np.ndarray, np.ndarray]:
    """i / bins and 1 - i / bins for i in 0..bins (read-only: shared by every call)."""
    steps = np.arange(bins + 1, dtype=np.float64) / bins
    complement = 1.0 - steps
    steps.flags.writeable = complement.flags.writeable = False
    return steps, complement


def _smallest_at_least(edges: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Per float64 edge, the smallest `dtype` value >= it, so that for every x of `dtype`,
    x < edge exactly when x < that value (rounded to nearest, one ulp up where that fell below)."""
    rounded = edges.astype(dtype)
    if rounded.dtype != np.float64:
        np.nextafter(rounded, np.float32(np.inf), out=rounded, where=rounded < edges)
    return rounded


def host_moments(
    values: np.ndarray, starts: np.ndarray, counts: np.ndarray, with_squares: bool
) -> list[tuple[float, float, float, float]]:
    """Per segment: (sum, sum of squares, mean, population std), float64.

    The sums are `segment_sums`'; the last step is plain float arithmetic per segment (cheaper
    than NumPy's for the one segment of a large tensor), where an overflow is inf (later a null
    with a reason), never a warning. `segment_moments` is the same arithmetic on arrays.
    """
    sums, squares, residual, scale = segment_sums(values, starts, counts)
    out = []
    for total, square, rest, count in zip(
        sums.tolist(), squares.tolist(), residual.tolist(), np.asarray(counts).tolist(), strict=True
    ):
        mean = total / count
        std = math.sqrt(max((square - rest * rest / count) / count, 0.0)) * scale
        # sum(x**2) = sum(d**2) + 2 mean sum(d) + count mean**2, with d = x - mean
        sum_squares = (square + 2.0 * mean * rest + count * mean * mean) * scale * scale
        out.append((total * scale, sum_squares if with_squares else 0.0, mean * scale, std))
    return out


def segment_moments(
    values: np.ndarray, starts: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per segment, as float64 arrays: the mean and the population std, by `host_moments`'
    arithmetic elementwise (so the same bits; `tests/test_lane.py` holds them to it)."""
    sums, squares, residual, scale = segment_sums(values, starts, counts)
    with np.errstate(over="ignore", invalid="ignore"):
        means = sums / counts
        stds = np.sqrt(np.maximum((squares - residual * residual / counts) / counts, 0.0)) * scale
        return means * scale, stds


def segment_sums(
    values: np.ndarray, starts: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Per segment, float64 arrays: the sum, the sum of squared deviations from the mean and the
    sum of those deviations (a correction term), of values scaled by the returned power of two.

    Args:
        values: Finite float32 or float64 entries, ascending within each segment.
        starts: Where each segment starts in `values` (ascending; segments do not overlap).
        counts: The length of each segment (each at least 1).

    A corrected two-pass algorithm over float64 copies made one `CHUNK` at a time (a segment may
    span chunks): segmented sums (`add.reduceat`), then the deviations' sums and squares. float32
    squares always fit float64; float64 values whose squares could overflow or underflow are
    scaled by one power of two per call (exact), chosen from the segments' ends (they are sorted).
    """
    scale = 1.0
    if values.dtype == np.float64:
        low, high = float(values[starts].min()), float(values[starts + counts - 1].max())
        max_abs = max(abs(low), abs(high))
        if max_abs > 2.0**400 or max_abs < 2.0**-400:
            exponent = math.frexp(max_abs)[1] if max_abs else 0
            scale = math.ldexp(1.0, max(-_MAX_SCALE_EXPONENT, min(_MAX_SCALE_EXPONENT, exponent)))
    ends = starts + counts
    size = int(ends[-1])
    pieces = []  # (lo, hi, first segment, last segment + 1, segment starts local to [lo, hi))
    for lo in range(int(starts[0]), size, CHUNK):
        hi = min(lo + CHUNK, size)
        if lo == starts[0] and hi == size:
            pieces.append((lo, hi, 0, counts.size, starts - lo))
            break
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(starts, hi, side="left"))
        local = np.maximum(starts[first:last] - lo, 0)
        pieces.append((lo, hi, first, last, local))
    inverse = 1.0 / scale
    counts = np.asarray(counts)
    sums = np.zeros(counts.size)
    for lo, hi, first, last, local in pieces:  # float64 sums, without a float64 copy
        piece = values[lo:hi] if scale == 1.0 else values[lo:hi] * inverse
        if last - first == 1:  # reduce: twice as fast as reduceat when it casts float32
            sums[first] += np.add.reduce(piece, dtype=np.float64)
        else:
            sums[first:last] += np.add.reduceat(piece, local, dtype=np.float64)
    means = sums / counts
    squares = np.zeros(counts.size)
    residual = np.zeros(counts.size)
    for lo, hi, first, last, local in pieces:  # the deviations: one float64 temporary a piece
        piece = values[lo:hi] if scale == 1.0 else values[lo:hi] * inverse
        if last - first == 1:
            chunk = np.subtract(piece, means[first], dtype=np.float64)
        else:
            subtrahend = np.repeat(means[first:last], np.diff(local, append=hi - lo))
            chunk = np.subtract(piece, subtrahend, dtype=np.float64)
        residual[first:last] += np.add.reduceat(chunk, local)
        squares[first:last] += np.add.reduceat(np.square(chunk, out=chunk), local)
    return sums, squares, residual, scale


def host_histogram(values: np.ndarray, bins: int, total: float, sum_squares: float) -> list[float]:
    """The histogram vector of one segment of sorted finite values (see `measure_on_cpu`).

    Each inner edge becomes the smallest value of the working dtype >= it, so one `searchsorted`
    counts the entries below every edge exactly as `numpy.histogram` bins them.
    """
    count = values.size
    if count == 0:
        return [0.0] * (5 + 2 * bins + 1)
    low, high = values[0].item(), values[-1].item()
    edges = edges_on_host(low, high, bins)
    if low == high:
        bin_counts = [float(count)] + [0.0] * (bins - 1)
    else:
        below = np.empty(bins + 1, dtype=np.int64)
        below[0], below[-1] = 0, count
        below[1:-1] = values.searchsorted(_smallest_at_least(edges[1:-1], values.dtype))
        bin_counts = np.subtract(below[1:], below[:-1], dtype=np.float64).tolist()
    return [float(count), low, high, total, sum_squares, *edges.tolist(), *bin_counts]


@dataclass
class CpuResult:
    """Raw values of the default profile (as `DefaultDeriver` reads them) and the histogram."""

    raw: dict[str, float]
    histogram: list[float] | None


def _from_sorted(
    values: np.ndarray,
    counts: Sequence[int],
    zeros: Sequence[float],
    wanted: frozenset[str],
    bins: Sequence[int | None],
) -> list[CpuResult]:
    """The results of every segment of sorted finite `values` (`counts` long each, maybe 0):
    one segmented moments pass, one gather of every order statistic, a histogram per segment
    that wants one. Only building the results is a loop over the segments."""
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    present = [index for index, count in enumerate(counts) if count]
    moments: dict[int, tuple[float, float, float, float]] = {}
    if present:
        chosen = np.array([starts[i] for i in present]), np.array([counts[i] for i in present])
        moments = dict(zip(present, host_moments(values, *chosen, any(bins)), strict=True))
    keys = ["min", "max"]
    for name in QUARTILES:
        if name in wanted:
            keys += [f"{name}_lo", f"{name}_hi"]
    positions: list[int] = []
    for index in present:  # min, max, then each quartile's two neighbours
        start, last = starts[index], counts[index] - 1
        positions += [start, start + last]
        for name, q in QUARTILES.items():
            if name in wanted:
                low = math.floor(last * q)
                positions += [start + low, start + min(low + 1, last)]
    picked = values.take(positions).tolist() if positions else []
    results: list[CpuResult] = []
    cursor = 0
    for index, count in enumerate(counts):
        raw = {"zeros": float(zeros[index]), "finite": float(count)}
        total = sum_squares = 0.0
        if count:
            raw.update(zip(keys, picked[cursor : cursor + len(keys)], strict=True))
            cursor += len(keys)
            total, sum_squares, raw["mean"], raw["std"] = moments[index]
        histogram = None
        segment_bins = bins[index]
        if segment_bins:
            segment = values[starts[index] : starts[index] + count]
            histogram = host_histogram(segment, segment_bins, total, sum_squares)
        results.append(CpuResult(raw, histogram))
    return results


# --- host fast path: one NumPy sort -------------------------------------------------------------


def _probes(dtype: np.dtype) -> np.ndarray:
    """Search keys whose left insertion points count -inf, -inf..+inf, x < 0 and x <= 0."""
    info = np.finfo(dtype)
    tiny = np.nextafter(dtype.type(0), dtype.type(1))
    probes = np.array([-info.max, np.inf, 0.0, tiny], dtype=dtype)
    probes.flags.writeable = False
    return probes


_PROBES = {np.dtype(dtype): _probes(np.dtype(dtype)) for dtype in (np.float32, np.float64)}


def measure_on_cpu(tensor: torch.Tensor, wanted: frozenset[str], bins: int | None) -> CpuResult:
    """Default-profile raw values of a plain CPU tensor and, if `bins`, its histogram vector.

    The histogram vector is laid out as `finite, min, max, sum, sum_squares`, then the bins + 1
    edges and the bins counts (all zeros when nothing is finite). One NumPy sort of a copy of the
    working values (x86-simd-sort on AVX2/AVX-512, an order of magnitude faster than `torch.sort`
    on one thread); one `searchsorted` of four probes gives the non-finite counts and the zero
    count (-0.0 == 0.0). The tensor is never written.
    """
    flat = tensor.reshape(-1)
    if flat.dtype == torch.float32 or flat.dtype == torch.float64:  # the caller's memory: a copy
        ordered = flat.numpy().copy()
    else:  # converted to the working dtype: already our own copy
        ordered = flat.to(tensors.working_dtype(flat.dtype)).numpy()
    ordered.sort()
    neg, end, below_zero, upto_zero = ordered.searchsorted(_PROBES[ordered.dtype]).tolist()
    values = ordered if end - neg == ordered.size else ordered[neg:end]
    return _from_sorted(values, [end - neg], [upto_zero - below_zero], wanted, [bins])[0]


# --- host fast path: many small tensors at once -------------------------------------------------

# Tensors of at most this many entries are measured together at the end of a sampled forward (or
# backward): their values are copied at the layer's return and reduced in one segmented pass...
BATCH_MAX = 1 << 10
# ... when at least this many of them want the same metrics; fewer are measured one by one
# (`measure_on_cpu`). From `uv run bench/small_tensors.py` (one thread): 4 tensors of 640 entries
# cost 0.96 x one sort each, 16 cost 0.64 x; at 4,096 entries the batch's one int64 sort is slower
# than float32 sorts one by one (1.1 to 2 x), hence BATCH_MAX.
BATCH_MIN = 4
_KEY_OFFSET = 1 << 31  # float32 keys shifted into [0, 2**32) below the segment index
_INF_KEY = 0x7F800000  # the key of +inf: non-finite entries sort after every finite one


def measure_batch_on_cpu(
    segments: Sequence[torch.Tensor], wanted: frozenset[str], bins: Sequence[int | None]
) -> list[CpuResult]:
    """`measure_on_cpu` of many small flat float32 tensors, in a fixed number of NumPy calls.

    The tensors are concatenated and sorted into segments by `sorted_segments`; `_from_sorted`
    measures every segment at once.

    Args:
        segments: Non-empty 1-D float32 CPU tensors (copies the caller owns).
        wanted: Default metrics wanted.
        bins: Per segment, the histogram's bin count, or None for no histogram.
    """
    count = len(segments)
    lengths = np.fromiter((segment.numel() for segment in segments), dtype=np.int64, count=count)
    values = (torch.cat(list(segments)) if count > 1 else segments[0]).numpy()  # one torch op
    ordered, counts, zeros = sorted_segments(values, lengths)
    return _from_sorted(ordered, counts.tolist(), zeros.tolist(), wanted, bins)


def sorted_segments(
    values: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The finite entries of each float32 segment of `values`, ascending, one after another.

    ONE sort of int64 keys that hold the segment index above the float32 sortable key
    (non-finite entries get the key of +inf, so each segment's finite entries come first, in
    order), read back as float32, non-finite entries dropped.

    Args:
        values: The segments' float32 entries, concatenated (never written).
        lengths: Each segment's number of entries (each at least 1).

    Returns:
        The sorted finite entries, each segment's finite count (int64), and each segment's
        count of zeros (float64; -0.0 is a zero).
    """
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


# --- many small tensors as arrays: the default profile of every segment at once ------------------

# Row layout of `segment_profiles`' result: the nine default metrics.
PROFILE = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")


def segment_profiles(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The default profile of every float32 segment of `values`, as arrays.

    The same numbers, bit for bit, as `measure_batch_on_cpu` followed by `DefaultDeriver` for
    each segment (a test holds them to it), computed with array operations only: the same
    float64 operations in the same order, elementwise (`_lerp`, `metric_value` and the
    fractions as `DefaultDeriver` computes them). No Python work per segment.

    Args:
        values: The segments' float32 entries, concatenated (never written).
        lengths: Each segment's number of entries (each at least 1), int64.

    Returns:
        `(profile, finite)`: a float64 array of shape (segments, 9) in `PROFILE` order, NaN where
        a value is null, and each segment's finite count; a null is "no finite entries" where
        that count is 0 (for the seven metrics of finite entries), else "non-finite result".
    """
    ordered, finite, zeros = sorted_segments(values, lengths)
    count = lengths.size
    profile = np.full((count, len(PROFILE)), np.nan)
    numel = lengths.astype(np.float64)
    profile[:, 7] = zeros / numel
    profile[:, 8] = (lengths - finite).astype(np.float64) / numel
    present = np.flatnonzero(finite)
    if present.size:
        counts = finite[present]
        starts = np.zeros(counts.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        means, stds = segment_moments(ordered, starts, counts)
        last = counts - 1
        profile[present, 0] = means
        profile[present, 1] = stds
        profile[present, 2] = ordered[starts]
        profile[present, 3] = ordered[starts + last]
        for column, q in enumerate(QUARTILES.values(), start=4):
            rank = last * q
            low = np.floor(rank)
            at = starts + low.astype(np.int64)
            lo = ordered[at].astype(np.float64)
            hi = ordered[np.minimum(at + 1, starts + last)].astype(np.float64)
            profile[present, column] = lerp(lo, hi, rank - low)
    profile[~np.isfinite(profile)] = np.nan  # metric_value: a non-finite result is a null
    profile += 0.0  # -0.0 becomes 0.0, as metric_value does
    return profile, finite


def lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """`_lerp` elementwise: the same operations per element, so the same bits."""
    diff = b - a
    with np.errstate(over="ignore", invalid="ignore"):
        result = np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
        overflowed = ~np.isfinite(result)
        if overflowed.any():
            result[overflowed] = (a * (1 - t) + b * t)[overflowed]
    return np.where(a == b, a, result)


# --- the general path: torch ops on the tensor's device, no host sync ---------------------------


@dataclass(frozen=True, slots=True)
class DeviceSort:
    """What the general path's one sort leaves for a histogram of the same tensor (0-d tensors).

    `ordered` holds the working values ascending, non-finite ones replaced by +inf (so they sort
    last and are never below a finite edge); `low`, `high`, `mean`, `std` are float64.
    """

    ordered: torch.Tensor
    finite: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def raw_on_device(
    values: torch.Tensor, wanted: frozenset[str]
) -> tuple[list[str], torch.Tensor, DeviceSort | None]:
    """Raw values as one float64 device block, computed without any host synchronisation.

    Also returns the sort and moments behind them when all were computed (the quartiles or
    min/max, and mean/std, are wanted), so that a focus tensor's histogram is counted from the
    same sort (`histograms.vector_from_sort`); None otherwise.
    """
    numel = values.numel()
    finite_mask = torch.isfinite(values)
    finite = finite_mask.sum()
    entries: dict[str, torch.Tensor] = {"finite": finite.to(torch.float64)}
    if "zero_fraction" in wanted:
        entries["zeros"] = (numel - torch.count_nonzero(values)).to(torch.float64)
    last = (finite - 1).clamp(min=0)
    ranks = [name for name in QUARTILES if name in wanted]
    low = high = ordered = None
    if ranks or wanted & {"min", "max"}:
        inf = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
        ordered = torch.sort(torch.where(finite_mask, values, inf)).values
        low = ordered[0]
        high = ordered.gather(0, last.reshape(1)).reshape(())
        entries["min"], entries["max"] = low.to(torch.float64), high.to(torch.float64)
        if ranks:
            steps = torch.tensor(
                [QUARTILES[name] for name in ranks], dtype=torch.float64, device=values.device
            )
            positions = torch.floor(last.to(torch.float64) * steps).to(torch.int64)
            lows = ordered.gather(0, positions).to(torch.float64)
            highs = ordered.gather(0, torch.minimum(positions + 1, last)).to(torch.float64)
            for index, name in enumerate(ranks):
                entries[f"{name}_lo"], entries[f"{name}_hi"] = lows[index], highs[index]
    if wanted & {"mean", "std"}:
        entries["mean"], entries["std"] = _moments_on_device(values, finite_mask, finite, low, high)
    keys = list(entries)
    shared = None
    if ordered is not None and "mean" in entries:
        shared = DeviceSort(
            ordered, finite, entries["min"], entries["max"], entries["mean"], entries["std"]
        )
    return keys, torch.stack([entries[key] for key in keys]), shared


def _moments_on_device(
    values: torch.Tensor,
    finite_mask: torch.Tensor,
    finite: torch.Tensor,
    low: torch.Tensor | None,
    high: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std of the finite entries, float64, corrected two-pass, no sync.

    float32 working values need no scaling: float64 holds the squares of every float32 (at most
    about 1.2e77, at least about 2e-90) and their sums over any tensor, which saves a dozen
    scalar kernels per tensor on a GPU; float64 values are scaled by a power of two (exact).
    """
    count = finite.clamp(min=1).to(torch.float64)
    wide = torch.where(finite_mask, values.to(torch.float64), 0.0)
    scale = None
    if values.dtype == torch.float64:
        if low is None or high is None:
            max_abs = wide.abs().amax()
        else:
            max_abs = torch.maximum(low.abs(), high.abs()).to(torch.float64)
        max_abs = torch.where(torch.isfinite(max_abs), max_abs, 1.0)
        exponent = torch.frexp(max_abs).exponent.to(torch.int64)
        exponent = exponent.clamp(-_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
        scale = _power_of_two(exponent)
        wide = wide * _power_of_two(-exponent)
    mean = wide.sum() / count
    wide = torch.where(finite_mask, wide.sub_(mean), 0.0)
    squares, residual = torch.dot(wide, wide), wide.sum()
    std = ((squares - residual * residual / count) / count).clamp(min=0.0).sqrt()
    return (mean, std) if scale is None else (mean * scale, std * scale)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as an exact float64 built from its bit pattern (exponent within ±1000)."""
    return ((exponent + 1023) << 52).reshape(1).view(torch.float64).reshape(())
