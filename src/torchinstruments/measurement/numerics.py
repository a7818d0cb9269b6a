"""The exact numerics of the default profile: order statistics, moments, quartiles.

Two ways to the same numbers, chosen by `tensors.host_sync_is_free(device)`:

* Device path (CUDA and any non-CPU device): no host synchronisation at all. Non-finite entries
  are replaced by +inf and the tensor is sorted once; min, max and the quartile neighbours are
  gathered at positions computed on the device from the finite count, and the interpolation is
  done on the host by `DefaultDeriver`. One sort is O(n log n) but it is the cheapest sync-free
  exact selection on a GPU, and it has no size limit (unlike `torch.quantile`, which refuses
  inputs over 2**24 elements).
* CPU path (`measure_on_cpu`), tensors of at most `SORT_MAX` (2**24) entries
  (`measure_by_sort`): NumPy's vectorised sort of a copy of the working values, then binary
  searches only. NaN sorts last and -inf first, so the counts of -inf, finite, zero and the
  histogram's "x < edge" are insertion points, the finite entries are one slice whose ends are
  min and max, and each order statistic is one read. Measured (`bench/statistics.py`, one
  thread): NumPy sorts 16k float32 in ~70 us where `torch.sort` takes ~1.3 ms, so this beats
  both the radix passes below (whose fixed ~35 torch ops cost ~0.8 ms per tensor) and a
  hand-rolled `torch.quantile`. Its one temporary of the tensor's size is the sorted copy.
* CPU path, the small tensors of one sample (`measure_batch_on_cpu`: at least `BATCH_MIN` of at
  most `BATCH_MAX` entries each): one NumPy sort of int64 keys holding the tensor's index above
  the float32 sortable key, and segmented sums, so only reading the results is a loop over the
  tensors (a sort per tensor costs ~40 us of fixed NumPy calls, whatever its size).
* CPU path, larger tensors (`_measure_by_radix`): host syncs are free, so it selects instead of
  sorting, and it computes the statistics and (for a focus layer) the histogram together, in
  chunks of `CHUNK` entries so that no temporary grows with the tensor (the working-dtype
  conversion, the float64 copy and the integer keys all exist one chunk at a time):
  1. per chunk: zero count; a fast `sum` that proves the chunk finite, else its finite entries
     compacted; min/max; the float64 sum; the sortable integer keys of the float bit patterns and
     the counts of their top 16 bits;
  2. on the host: the buckets that hold the wanted order statistics (quartile neighbours), and
     the buckets that hold the histogram's inner edges, each edge turned into the smallest key
     whose value is >= the edge, so that "x < edge" is exactly "key < threshold";
  3. the keys in those buckets (kept from pass 1 for a one-chunk tensor, gathered by a second
     chunked pass otherwise, with the moments' deviations) are sorted together once: buckets are
     disjoint key ranges, so one sort orders every bucket, each order statistic is one gather and
     each edge count one searchsorted. Only when the candidates are a large share of the tensor
     (values packed into a few buckets) is each bucket refined by its next 16 bits instead.
  Bin counts (both CPU paths) are differences of exact edge counts, so they agree with the
  reported edges as `numpy.histogram` bins them.
* Mean and std are always accumulated in float64 with a corrected two-pass algorithm on values
  scaled by a power of two (exact), so neither a float32 variance nor a float64 sum of huge values
  overflows into a null.

Quartiles use NumPy's "linear" interpolation. A value that comes out non-finite is never stored:
it is null with the reason "non-finite result". Negative zero results are reported as 0.0.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from torchinstruments import reasons
from torchinstruments.measurement import tensors
from torchinstruments.records import MetricValue

if TYPE_CHECKING:
    import numpy as np
else:
    try:  # NumPy is not a runtime dependency: without it, CPU tensors take the radix passes.
        import numpy as np
    except ImportError:  # exercised in a subprocess by tests/test_imports.py
        np = None

# Whether the NumPy sort path is available (NumPy importable in this process).
HAVE_NUMPY = np is not None

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


def _quartile_ranks(finite: int, wanted: frozenset[str]) -> dict[str, tuple[int, int]]:
    """The 0-based ranks of the two order statistics around each wanted quartile."""
    ranks: dict[str, tuple[int, int]] = {}
    for name, q in QUARTILES.items():
        if name in wanted:
            low = math.floor((finite - 1) * q)
            ranks[name] = (low, min(low + 1, finite - 1))
    return ranks


def _scale_exponent(max_abs: float) -> int:
    """Exponent e with max_abs < 2**e, clamped so 2**±e stays normal."""
    exponent = math.frexp(max_abs)[1] if math.isfinite(max_abs) else 0
    return max(-_MAX_SCALE_EXPONENT, min(_MAX_SCALE_EXPONENT, exponent))


# --- CPU: chunked passes, one radix pass shared by the statistics and the histogram --------------

# Entries per chunk of the CPU passes: bounds every temporary (8 MiB of float64 per chunk).
CHUNK = 1 << 20
# Key sets at most this large are sorted (torch's CPU sort is cheap below a few thousand keys).
_SORT_BELOW = 1 << 11
# Candidates of all buckets are sorted together when at most this many (or an 8th of the keys).
_ONE_SORT_LIMIT = 1 << 18
_RADIX_BITS = 16
_RADIX_MASK = (1 << _RADIX_BITS) - 1
_BUCKETS = 1 << _RADIX_BITS
_SIGN_DIGIT = 1 << (_RADIX_BITS - 1)

_Query = tuple[int, int]  # (query id, local rank) or (query id, threshold key)


def _sortable_keys(values: torch.Tensor) -> torch.Tensor:
    """Integers whose signed order is the float order of `values` (float32 or float64)."""
    if values.dtype == torch.float64:
        bits = values.view(torch.int64)
        keys = bits >> 63
        keys &= 0x7FFFFFFFFFFFFFFF
    else:
        bits = values.view(torch.int32)
        keys = bits >> 31
        keys &= 0x7FFFFFFF
    keys ^= bits
    return keys


def _key_to_float(key: int, dtype: torch.dtype) -> float:
    """Inverts `_sortable_keys` for one key."""
    if dtype == torch.float64:
        bits = key ^ 0x7FFFFFFFFFFFFFFF if key < 0 else key
        return struct.unpack("<d", struct.pack("<q", bits))[0]
    bits = key ^ 0x7FFFFFFF if key < 0 else key
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def edge_thresholds(edges: Sequence[float], dtype: torch.dtype) -> list[int]:
    """Keys K_i with (x < edges[i]) == (key(x) < K_i) for every finite x of `dtype`.

    K_i is the key of the smallest `dtype` value >= edges[i] (`array` rounds to float32 to
    nearest; one ulp up when that fell below, and adjacent keys are adjacent values). When that
    value is zero, K_i is the key of -0.0, so that -0.0, whose key sorts below +0.0's, is not
    below an edge that 0.0 is not below. A positive edge too small for the dtype rounds to 0.0
    and then goes one ulp up: both zeros are below it.
    """
    if dtype == torch.float64:
        rounded, bits = list(edges), array("q")
        bits.frombytes(array("d", edges).tobytes())
        mask = 0x7FFFFFFFFFFFFFFF
    else:
        narrow = array("f", edges)
        rounded, bits = narrow.tolist(), array("i")
        bits.frombytes(narrow.tobytes())
        mask = 0x7FFFFFFF
    out: list[int] = []
    for edge, value, bit in zip(edges, rounded, bits, strict=True):
        if value < edge:  # one ulp up (the key of +0.0 is 0: the smallest subnormal is 1)
            out.append((0 if value == 0.0 else bit ^ mask if bit < 0 else bit) + 1)
        elif value == 0.0:
            out.append(-1)  # the key of -0.0 (both widths)
        else:
            out.append(bit ^ mask if bit < 0 else bit)
    return out


def edges_on_host(low: float, high: float, bins: int) -> list[float]:
    """bins + 1 non-decreasing float64 edges from low to high, exactly as `_edges` computes them.

    The same IEEE operations in the same order as the torch version (`histograms._edges`, which
    the sync-free path runs on the device), elementwise in NumPy, so both paths report identical
    edges.
    """
    if not HAVE_NUMPY:
        return _edges_in_python(low, high, bins)
    return _edges_array(low, high, bins).tolist()


def _edges_array(low: float, high: float, bins: int) -> np.ndarray:
    """`edges_on_host` as a NumPy array."""
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


def _edges_in_python(low: float, high: float, bins: int) -> list[float]:
    """`edges_on_host` without NumPy: the same IEEE operations, one edge at a time."""
    steps = [index / bins for index in range(bins + 1)]
    running = itertools.accumulate([low * (1.0 - step) + high * step for step in steps], max)
    out = [min(max(value, low), high) for value in running]
    out[0], out[-1] = low, high
    return out


@dataclass
class _Answers:
    """Results of rank queries (id -> key) and count queries (id -> keys below the threshold)."""

    selected: dict[int, int] = field(default_factory=dict)
    counted: dict[int, int] = field(default_factory=dict)


class _Cumulative:
    """Cumulative bucket counts, read on the host only at the buckets a query needs."""

    def __init__(self, counts: torch.Tensor) -> None:
        self.tensor = counts.cumsum(0)
        self.known: dict[int, int] = {-1: 0}

    def fetch(self, buckets: set[int]) -> None:
        missing = sorted(buckets - self.known.keys())
        if missing:
            values = self.tensor[torch.tensor(missing, dtype=torch.int64)].tolist()
            self.known.update(zip(missing, values, strict=True))

    def __getitem__(self, bucket: int) -> int:
        return self.known[bucket]


_Plan = dict[int, tuple[list[_Query], list[_Query]]]


def _plan(
    cumulative: _Cumulative,
    selects: Sequence[_Query],
    counts: Sequence[_Query],
    shift: int,
    top: bool,
    out: _Answers,
) -> _Plan:
    """The bucket each query continues in, with its rank local to it; counts below are added."""
    plan: _Plan = {}
    select_buckets: list[int] = []
    if selects:
        locals_ = torch.tensor([local for _, local in selects], dtype=torch.int64)
        select_buckets = torch.searchsorted(cumulative.tensor, locals_, right=True).tolist()
    flip = _SIGN_DIGIT if top else 0
    count_buckets = [((threshold >> shift) & _RADIX_MASK) ^ flip for _, threshold in counts]
    cumulative.fetch({b for b in select_buckets + count_buckets for b in (b - 1, b)})
    for (qid, local), bucket in zip(selects, select_buckets, strict=True):
        plan.setdefault(bucket, ([], []))[0].append((qid, local - cumulative[bucket - 1]))
    for (qid, threshold), bucket in zip(counts, count_buckets, strict=True):
        before = cumulative[bucket - 1]
        out.counted[qid] = out.counted.get(qid, 0) + before
        if cumulative[bucket] > before:
            plan.setdefault(bucket, ([], []))[1].append((qid, threshold))
    return dict(sorted(plan.items()))


def _answer_sorted(
    ordered: torch.Tensor, selects: Sequence[_Query], counts: Sequence[_Query], out: _Answers
) -> None:
    """Rank queries by one gather, count queries by one searchsorted, over sorted keys."""
    if selects:
        positions = torch.tensor([local for _, local in selects], dtype=torch.int64)
        for (qid, _), key in zip(selects, ordered[positions].tolist(), strict=True):
            out.selected[qid] = key
    if counts:
        thresholds = torch.tensor([threshold for _, threshold in counts], dtype=ordered.dtype)
        below = torch.searchsorted(ordered, thresholds).tolist()
        for (qid, _), count in zip(counts, below, strict=True):
            out.counted[qid] = out.counted.get(qid, 0) + count


def _finish(
    candidates: torch.Tensor,
    group: torch.Tensor,
    cumulative: _Cumulative,
    plan: _Plan,
    shift: int,
    total: int,
    out: _Answers,
) -> None:
    """Answers the planned queries from the keys of their buckets (`group`: bucket index)."""
    sizes = [cumulative[bucket] - cumulative[bucket - 1] for bucket in plan]
    if candidates.numel() <= max(_ONE_SORT_LIMIT, total // 8) or shift < _RADIX_BITS:
        selects: list[_Query] = []
        counts: list[_Query] = []
        start = 0
        for (bucket_selects, bucket_counts), size in zip(plan.values(), sizes, strict=True):
            selects += [(qid, start + local) for qid, local in bucket_selects]
            for qid, threshold in bucket_counts:  # searchsorted counts the lower buckets too
                out.counted[qid] = out.counted.get(qid, 0) - start
                counts.append((qid, threshold))
            start += size
        _answer_sorted(torch.sort(candidates).values, selects, counts, out)
        return
    grouped = candidates[torch.argsort(group, stable=True)] if len(plan) > 1 else candidates
    start = 0
    for (bucket_selects, bucket_counts), size in zip(plan.values(), sizes, strict=True):
        _resolve(
            grouped[start : start + size], bucket_selects, bucket_counts, shift - _RADIX_BITS, out
        )
        start += size


def _resolve(
    keys: torch.Tensor,
    selects: Sequence[_Query],
    counts: Sequence[_Query],
    shift: int,
    out: _Answers,
) -> None:
    """Queries over the keys of one bucket, by their next 16-bit digit."""
    if not selects and not counts:
        return
    if keys.numel() <= _SORT_BELOW or shift < 0:
        _answer_sorted(torch.sort(keys).values, selects, counts, out)
        return
    digits = keys >> shift if shift else keys.clone()
    digits &= _RADIX_MASK
    cumulative = _Cumulative(torch.bincount(digits, minlength=_BUCKETS))
    plan = _plan(cumulative, selects, counts, shift, False, out)
    if plan:
        group, positions = _select_buckets(digits, plan)
        candidates = torch.index_select(keys, 0, positions)
        _finish(candidates, group, cumulative, plan, shift, keys.numel(), out)


def _select_buckets(digits: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the entries whose digit is a planned bucket, and their bucket index."""
    if len(plan) == 1:
        positions = (digits == next(iter(plan))).nonzero().squeeze(1)
        return torch.zeros(positions.shape, dtype=torch.int16), positions
    table = torch.full((_BUCKETS,), -1, dtype=torch.int16)
    table[list(plan)] = torch.arange(len(plan), dtype=torch.int16)
    group = torch.index_select(table, 0, digits)  # much faster than table[digits]
    positions = (group >= 0).nonzero().squeeze(1)
    return torch.index_select(group, 0, positions), positions


def _top_digits(keys: torch.Tensor, shift: int) -> torch.Tensor:
    """The top 16 bits of each key, sign bit flipped so that unsigned digit order is key order."""
    digits = keys >> shift
    digits &= _RADIX_MASK
    digits ^= _SIGN_DIGIT
    return digits


def _finite(chunk: torch.Tensor) -> torch.Tensor:
    """The finite entries of a chunk: the chunk itself when its sum proves them all finite."""
    if math.isfinite(float(chunk.sum())):
        return chunk
    return chunk[torch.isfinite(chunk)]


@dataclass
class CpuResult:
    """Raw values of the default profile (as `_Deriver` reads them) and the histogram vector."""

    raw: dict[str, float]
    histogram: list[float] | None


def measure_on_cpu(tensor: torch.Tensor, wanted: frozenset[str], bins: int | None) -> CpuResult:
    """Default-profile raw values of `tensor` and, if `bins`, its histogram vector.

    The histogram vector is laid out as `finite, min, max, sum, sum_squares`, then the bins + 1
    edges and the bins counts (all zeros when nothing is finite). Tensors of at most `SORT_MAX`
    entries are sorted by NumPy (`measure_by_sort`), larger ones take the chunked radix passes.
    """
    if HAVE_NUMPY and tensor.numel() <= SORT_MAX:
        return measure_by_sort(tensor, wanted, bins)
    return _measure_by_radix(tensor, wanted, bins)


# --- CPU: one NumPy sort ------------------------------------------------------------------------

# Tensors of at most this many entries are measured from one NumPy sort of a copy (the copy is the
# only temporary of the tensor's size; the float64 moments go chunk by chunk).
SORT_MAX = 1 << 24


def _probes(dtype: np.dtype) -> np.ndarray:
    """Search keys whose left insertion points count -inf, -inf..+inf, x < 0 and x <= 0."""
    info = np.finfo(dtype)
    tiny = np.nextafter(dtype.type(0), dtype.type(1))
    probes = np.array([-info.max, np.inf, 0.0, tiny], dtype=dtype)
    probes.flags.writeable = False
    return probes


_PROBES: dict[np.dtype, np.ndarray] = (
    {np.dtype(dtype): _probes(np.dtype(dtype)) for dtype in (np.float32, np.float64)}
    if HAVE_NUMPY
    else {}
)
_NUMPY_INF32 = np.float32(np.inf) if HAVE_NUMPY else math.inf


def measure_by_sort(tensor: torch.Tensor, wanted: frozenset[str], bins: int | None) -> CpuResult:
    """`measure_on_cpu` from one NumPy sort of the working values (a copy; the tensor is untouched).

    NumPy's vectorised sort (x86-simd-sort on AVX2/AVX-512) sorts float32 an order of magnitude
    faster than `torch.sort` on one CPU thread, and a sorted array answers everything with
    binary searches: NaN sorts last and -inf first, so one `searchsorted` of four probes gives the
    non-finite counts and the zero count (-0.0 == 0.0), the finite entries are one contiguous
    slice whose ends are min and max and whose order statistics are plain reads, and the
    histogram's inner edges, each turned into the smallest working-dtype value >= the edge, are
    counted by one more `searchsorted` ("x < edge" is exactly "x < that value" for every x of
    the dtype, as `numpy.histogram` bins them).
    """
    flat = tensor.reshape(-1)
    if flat.dtype == torch.float32 or flat.dtype == torch.float64:  # the caller's memory: a copy
        ordered = flat.numpy().copy()
    else:  # converted to the working dtype: already our own copy
        ordered = flat.to(tensors.working_dtype(flat.dtype)).numpy()
    ordered.sort()
    neg, end, below_zero, upto_zero = ordered.searchsorted(_PROBES[ordered.dtype]).tolist()
    finite = end - neg
    raw: dict[str, float] = {"zeros": float(upto_zero - below_zero), "finite": float(finite)}
    if finite == 0:
        return CpuResult(raw, [0.0] * (5 + 2 * bins + 1) if bins else None)
    values = ordered if finite == ordered.size else ordered[neg:end]
    low, high = values[0].item(), values[-1].item()
    raw["min"], raw["max"] = low, high
    total, sum_squares, mean, std = _sorted_moments(values, low, high, bool(bins))
    raw["mean"], raw["std"] = mean, std
    for name, (low_rank, high_rank) in _quartile_ranks(finite, wanted).items():
        raw[f"{name}_lo"], raw[f"{name}_hi"] = values[low_rank].item(), values[high_rank].item()
    if not bins:
        return CpuResult(raw, None)
    edges = _edges_array(low, high, bins)
    if low == high:
        bin_counts = [float(finite)] + [0.0] * (bins - 1)
    else:
        thresholds = _smallest_at_least(edges[1:-1], values.dtype)
        below = np.empty(bins + 1, dtype=np.int64)
        below[0], below[-1] = 0, finite
        below[1:-1] = values.searchsorted(thresholds)
        bin_counts = np.subtract(below[1:], below[:-1], dtype=np.float64).tolist()
    head = [float(finite), low, high, total, sum_squares]
    return CpuResult(raw, head + edges.tolist() + bin_counts)


def _sorted_moments(
    values: np.ndarray, low: float, high: float, with_squares: bool
) -> tuple[float, float, float, float]:
    """Sum, sum of squares, mean and population std of finite `values`, in float64 chunks.

    The same corrected two-pass algorithm as the radix path, on values scaled by a power of two
    when their magnitude would overflow (or underflow) float64 squares.
    """
    count = values.size
    max_abs = max(abs(low), abs(high))
    scale = 1.0
    if max_abs > 2.0**500 or max_abs < 2.0**-500:
        scale = math.ldexp(1.0, _scale_exponent(max_abs)) if max_abs else 1.0
    if scale == 1.0 and count <= CHUNK:  # the common case, in four passes; nothing can overflow
        total = float(np.add.reduce(values, dtype=np.float64))
        mean = total / count
        deviations = np.subtract(values, mean, dtype=np.float64)
        residual = float(np.add.reduce(deviations))
        squares = float(np.add.reduce(np.square(deviations, out=deviations)))  # no BLAS (`_dot`)
        variance = max((squares - residual * residual / count) / count, 0.0)
        # sum(x**2) = sum(d**2) + 2 mean sum(d) + count mean**2, with d = x - mean
        sum_squares = squares + 2.0 * mean * residual + count * mean * mean if with_squares else 0.0
        return total, sum_squares, mean, math.sqrt(variance)
    with np.errstate(over="ignore", invalid="ignore"):  # inf sums become nulls, as in torch
        return _moments_in_float64_chunks(values, count, scale, with_squares)


def _moments_in_float64_chunks(
    values: np.ndarray, count: int, scale: float, with_squares: bool
) -> tuple[float, float, float, float]:
    """`_sorted_moments` of large or scaled values: float64 copies one chunk at a time."""
    inverse = 1.0 / scale
    total = sum_squares = scaled = 0.0
    kept: np.ndarray | None = None
    for start in range(0, count, CHUNK):
        wide = values[start : start + CHUNK].astype(np.float64)
        total += float(wide.sum())
        if with_squares:
            sum_squares += _dot(wide)
        if scale != 1.0:
            wide *= inverse
            scaled += float(wide.sum())
        if count <= CHUNK:
            kept = wide
    mean = (scaled if scale != 1.0 else total) / count
    squares = residual = 0.0
    for start in range(0, count, CHUNK):
        if kept is not None:
            wide = kept
        else:
            wide = values[start : start + CHUNK].astype(np.float64)
            if scale != 1.0:
                wide *= inverse
        wide -= mean
        squares += _dot(wide)
        residual += float(wide.sum())
    variance = max((squares - residual * residual / count) / count, 0.0)
    return total, sum_squares, mean * scale, math.sqrt(variance) * scale


def _dot(values: np.ndarray) -> float:
    """sum(values**2) by `torch.dot` on the same memory: NumPy's BLAS dot starts its own threads,
    which on a busy machine wait for cores (`torch.set_num_threads` does not reach them)."""
    wide = torch.from_numpy(values)
    return float(torch.dot(wide, wide))


# --- CPU: chunked radix passes ------------------------------------------------------------------


def _measure_by_radix(tensor: torch.Tensor, wanted: frozenset[str], bins: int | None) -> CpuResult:
    """`measure_on_cpu` by the chunked radix passes (see the module docstring)."""
    flat = tensor.reshape(-1)
    numel = flat.numel()
    work = tensors.working_dtype(flat.dtype)
    bounds = [(start, min(start + CHUNK, numel)) for start in range(0, numel, CHUNK)]
    one_chunk = len(bounds) == 1
    shift = (64 if work == torch.float64 else 32) - _RADIX_BITS
    order_wanted = bool(bins) or bool(wanted & QUARTILES.keys())
    radix = order_wanted and numel > _SORT_BELOW
    top = torch.zeros(_BUCKETS, dtype=torch.int64) if radix else None
    # One chunk: its keys (and top digits) stay for the queries; more: gathered again in pass 2.
    kept_keys: torch.Tensor | None = None
    kept_digits: torch.Tensor | None = None
    finite = zeros = 0
    low, high = math.inf, -math.inf
    total = 0.0
    squares = residual = sum_squares = 0.0
    for start, stop in bounds:
        chunk = flat[start:stop].to(work)
        zeros += (stop - start) - int(torch.count_nonzero(chunk))
        values = _finite(chunk)
        count = values.numel()
        if not count:
            continue
        finite += count
        lo, hi = torch.aminmax(values)
        low, high = min(low, float(lo)), max(high, float(hi))
        wide = values.to(torch.float64)
        chunk_sum = float(wide.sum())
        total += chunk_sum
        if one_chunk:  # the moments need the mean first: one chunk has it now
            deviations = wide - chunk_sum / count
            squares = float(torch.dot(deviations, deviations))
            residual = float(deviations.sum())
            if bins:
                sum_squares = float(torch.dot(wide, wide))
        keys = digits = None
        if top is not None:
            keys = _sortable_keys(values)
            digits = _top_digits(keys, shift)
            counted = torch.bincount(digits, minlength=_BUCKETS)
            top = counted if one_chunk else top.add_(counted)
        elif order_wanted and one_chunk:
            keys = _sortable_keys(values)
        if one_chunk:
            kept_keys, kept_digits = keys, digits
    raw: dict[str, float] = {"zeros": float(zeros), "finite": float(finite)}
    if finite == 0:
        return CpuResult(raw, [0.0] * (5 + 2 * bins + 1) if bins else None)
    raw["min"], raw["max"] = low, high
    max_abs = max(abs(low), abs(high))
    scale = 1.0
    if max_abs > 2.0**500 or max_abs < 2.0**-500:
        scale = math.ldexp(1.0, _scale_exponent(max_abs)) if max_abs else 1.0
    mean = total / finite
    if scale != 1.0 or not math.isfinite(total) or not one_chunk:
        mean, squares, residual, sum_squares = _moments_in_chunks(
            flat, bounds, work, scale, finite, bool(bins)
        )
    variance = max((squares - residual * residual / finite) / finite, 0.0)
    raw["mean"], raw["std"] = mean * scale, math.sqrt(variance) * scale

    ranks = _quartile_ranks(finite, wanted)
    needed = sorted({rank for pair in ranks.values() for rank in pair} - {0, finite - 1})
    order = {0: low, finite - 1: high}
    if low == high:
        order.update(dict.fromkeys(needed, low))
        needed = []
    selects: list[_Query] = [(rank, rank) for rank in needed]
    edges = edges_on_host(low, high, bins) if bins else []
    counts: list[_Query] = []
    if bins and low != high:
        counts = list(enumerate(edge_thresholds(edges[1:-1], work)))
    out = _Answers()
    if selects or counts:
        if top is None:  # few entries, all in one chunk: sort them
            if kept_keys is not None:
                _answer_sorted(torch.sort(kept_keys).values, selects, counts, out)
        else:
            cumulative = _Cumulative(top)
            plan = _plan(cumulative, selects, counts, shift, True, out)
            if plan:
                if kept_keys is not None and kept_digits is not None:
                    group, positions = _select_buckets(kept_digits, plan)
                    candidates = torch.index_select(kept_keys, 0, positions)
                else:
                    candidates, group = _candidates_in_chunks(flat, bounds, work, shift, plan)
                _finish(candidates, group, cumulative, plan, shift, finite, out)
    for rank in needed:
        order[rank] = _key_to_float(out.selected[rank], work)
    for name, (lo_rank, hi_rank) in ranks.items():
        raw[f"{name}_lo"], raw[f"{name}_hi"] = order[lo_rank], order[hi_rank]
    if not bins:
        return CpuResult(raw, None)
    if low == high:
        bin_counts = [float(finite)] + [0.0] * (bins - 1)
    else:
        below = [0, *(out.counted.get(index, 0) for index in range(bins - 1)), finite]
        bin_counts = [float(b - a) for a, b in itertools.pairwise(below)]
    head = [float(finite), low, high, total, sum_squares]
    return CpuResult(raw, head + edges + bin_counts)


def _moments_in_chunks(
    flat: torch.Tensor,
    bounds: Sequence[tuple[int, int]],
    work: torch.dtype,
    scale: float,
    finite: int,
    with_squares: bool,
) -> tuple[float, float, float, float]:
    """Scaled mean, squared deviations, residual and (unscaled) sum of squares, in two passes."""
    inverse = 1.0 / scale
    total = 0.0
    for start, stop in bounds:
        total += float((_finite(flat[start:stop].to(work)).to(torch.float64) * inverse).sum())
    mean = total / finite
    squares = residual = sum_squares = 0.0
    for start, stop in bounds:
        wide = _finite(flat[start:stop].to(work)).to(torch.float64)
        if with_squares:
            sum_squares += float(torch.dot(wide, wide))
        deviations = wide * inverse - mean
        squares += float(torch.dot(deviations, deviations))
        residual += float(deviations.sum())
    return mean, squares, residual, sum_squares


def _candidates_in_chunks(
    flat: torch.Tensor,
    bounds: Sequence[tuple[int, int]],
    work: torch.dtype,
    shift: int,
    plan: _Plan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys in the planned top-level buckets, gathered chunk by chunk, with their bucket."""
    pieces: list[torch.Tensor] = []
    groups: list[torch.Tensor] = []
    for start, stop in bounds:
        keys = _sortable_keys(_finite(flat[start:stop].to(work)))
        group, positions = _select_buckets(_top_digits(keys, shift), plan)
        pieces.append(torch.index_select(keys, 0, positions))
        groups.append(group)
    return torch.cat(pieces), torch.cat(groups)


# --- CPU: many small tensors at once ------------------------------------------------------------

# Tensors of at most this many entries are measured together at the end of a sampled forward (or
# backward): their values are copied at the layer's return and reduced in one segmented pass...
BATCH_MAX = 1 << 10
# ... when at least this many of them want the same metrics (and NumPy is there); fewer are
# measured one by one (`measure_by_sort`). From `uv run bench/small_tensors.py` (one thread):
# 4 tensors of 640 entries cost 0.96 x one sort each, 16 cost 0.64 x; at 4,096 entries the
# batch's one int64 sort is slower than float32 sorts one by one (1.1 to 2 x), hence BATCH_MAX.
BATCH_MIN = 4
_KEY_OFFSET = 1 << 31  # float32 keys shifted into [0, 2**32) below the segment index
_INF_KEY = 0x7F800000  # the key of +inf: non-finite entries sort after every finite one


def measure_batch_on_cpu(
    segments: Sequence[torch.Tensor], wanted: frozenset[str], bins: Sequence[int | None]
) -> list[CpuResult]:
    """`measure_on_cpu` of many small flat float32 tensors, in a fixed number of NumPy calls.

    The tensors are concatenated; counts and moments are segmented sums (`add.reduceat`, the same
    corrected two-pass algorithm as one tensor); the order statistics and the histogram edge
    counts come from ONE sort of int64 keys that hold the segment index above the float32
    sortable key (non-finite entries get the key of +inf, so each segment's finite entries come
    first, in order), read by one gather and one searchsorted. Only building the results is a
    loop over the tensors.

    Args:
        segments: Non-empty 1-D float32 CPU tensors (copies the caller owns).
        wanted: Default metrics wanted.
        bins: Per segment, the histogram's bin count, or None for no histogram.
    """
    count = len(segments)
    lengths = np.fromiter((segment.numel() for segment in segments), dtype=np.int64, count=count)
    starts = np.zeros(count, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    values = (torch.cat(list(segments)) if count > 1 else segments[0]).numpy()  # one torch op
    finite = np.isfinite(values)
    all_finite = bool(finite.all())
    wide = values.astype(np.float64)
    if all_finite:
        counts = lengths.astype(np.float64)
    else:
        wide[~finite] = 0.0
        counts = np.add.reduceat(finite, starts, dtype=np.float64)
    sums = np.add.reduceat(wide, starts)
    deviations = wide - np.repeat(sums / np.maximum(counts, 1.0), lengths)
    if not all_finite:
        deviations[~finite] = 0.0
    columns = [
        counts,
        np.add.reduceat(values == 0, starts, dtype=np.float64),
        sums,
        np.add.reduceat(deviations * deviations, starts),
        np.add.reduceat(deviations, starts),
    ]
    if any(bins):
        columns.append(np.add.reduceat(wide * wide, starts))
    bits = values.view(np.int32)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)
    if not all_finite:
        keys[~finite] = _INF_KEY
    keys += np.repeat(np.arange(count, dtype=np.int64) << 32, lengths) + _KEY_OFFSET
    keys.sort()
    table = np.stack(columns, axis=1).tolist()
    return _batch_results(keys, table, starts.tolist(), wanted, bins)


def _batch_results(
    ordered: np.ndarray,
    table: list[list[float]],
    starts: Sequence[int],
    wanted: frozenset[str],
    bins: Sequence[int | None],
) -> list[CpuResult]:
    """Reads every segment's order statistics and edge counts from the sorted composite keys."""
    positions: list[int] = []
    for row, start in zip(table, starts, strict=True):
        count = round(row[0])
        if count:  # min, max, then each quartile's two neighbours
            positions += [start, start + count - 1]
            for low_rank, high_rank in _quartile_ranks(count, wanted).values():
                positions += [start + low_rank, start + high_rank]
    picked = _keys_to_float32(ordered.take(positions)) if positions else []
    results: list[CpuResult] = []
    thresholds: list[np.ndarray] = []
    edges_of: list[np.ndarray | None] = []
    cursor = 0
    for index, row in enumerate(table):
        finite, zeros, total, squares, residual = row[:5]
        count = round(finite)
        raw: dict[str, float] = {"zeros": zeros, "finite": finite}
        edges = None
        if count:
            low, high = picked[cursor], picked[cursor + 1]
            cursor += 2
            for name in QUARTILES:
                if name in wanted:
                    raw[f"{name}_lo"], raw[f"{name}_hi"] = picked[cursor], picked[cursor + 1]
                    cursor += 2
            mean = total / count
            variance = max((squares - residual * residual / count) / count, 0.0)
            raw.update(min=low, max=high, mean=mean, std=math.sqrt(variance))
            segment_bins = bins[index]
            if segment_bins:
                edges = _edges_array(low, high, segment_bins)
                if low != high:
                    thresholds.append(_threshold_keys(edges[1:-1]) + ((index << 32) + _KEY_OFFSET))
        edges_of.append(edges)
        results.append(CpuResult(raw, None))
    below = iter(ordered.searchsorted(np.concatenate(thresholds)).tolist() if thresholds else [])
    for index, (result, row) in enumerate(zip(results, table, strict=True)):
        segment_bins = bins[index]
        if not segment_bins:
            continue
        count = round(row[0])
        edges = edges_of[index]
        if not count or edges is None:
            result.histogram = [0.0] * (5 + 2 * segment_bins + 1)
            continue
        low, high = result.raw["min"], result.raw["max"]
        if low == high:
            bin_counts = [float(count)] + [0.0] * (segment_bins - 1)
        else:
            start = starts[index]
            cumulative = [0, *(next(below) - start for _ in range(segment_bins - 1)), count]
            bin_counts = [float(b - a) for a, b in itertools.pairwise(cumulative)]
        head = [float(count), low, high, row[2], row[5]]
        result.histogram = head + edges.tolist() + bin_counts
    return results


def _keys_to_float32(composite: np.ndarray) -> list[float]:
    """The float32 values of composite batch keys (segment index above the offset key)."""
    keys = ((composite & 0xFFFFFFFF) - _KEY_OFFSET).astype(np.int32)
    bits = keys ^ ((keys >> 31) & 0x7FFFFFFF)
    return bits.view(np.float32).tolist()


def _smallest_at_least(edges: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Per float64 edge, the smallest `dtype` value >= it, so that for every x of `dtype`,
    x < edge exactly when x < that value (rounded to nearest, one ulp up where that fell below)."""
    rounded = edges.astype(dtype)
    if rounded.dtype != np.float64:
        np.nextafter(rounded, _NUMPY_INF32, out=rounded, where=rounded < edges)
    return rounded


def _threshold_keys(edges: np.ndarray) -> np.ndarray:
    """`edge_thresholds` for float32, vectorised: int64 keys K with x < edge == key(x) < K."""
    rounded = _smallest_at_least(edges, np.dtype(np.float32))
    rounded[rounded == 0.0] = -0.0  # the smallest value >= the edge is a zero: -0.0 is one
    bits = rounded.view(np.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)


# --- other devices: one sort, no host sync ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceSort:
    """What the sync-free path's one sort leaves for a histogram of the same tensor (0-d tensors).

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
    """Mean and population std of the finite entries, float64, power-of-two scaled, no sync.

    float32 working values need no scaling: float64 holds the squares of every float32 (at most
    about 1.2e77, at least about 2e-90) and their sums over any tensor, which saves a dozen
    scalar kernels per tensor on a GPU.
    """
    count = finite.clamp(min=1).to(torch.float64)
    if values.dtype != torch.float64:
        wide = torch.where(finite_mask, values.to(torch.float64), 0.0)
        mean = wide.sum() / count
        wide = torch.where(finite_mask, wide.sub_(mean), 0.0)
        squares, residual = torch.dot(wide, wide), wide.sum()
        variance = ((squares - residual * residual / count) / count).clamp(min=0.0)
        return mean, variance.sqrt()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if low is None or high is None:
        max_abs = torch.where(finite_mask, values.abs(), zero).amax().to(torch.float64)
    else:
        max_abs = torch.maximum(low.abs(), high.abs()).to(torch.float64)
    max_abs = torch.where(torch.isfinite(max_abs), max_abs, 1.0)
    exponent = torch.frexp(max_abs).exponent.to(torch.int64)
    exponent = exponent.clamp(-_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
    scale = _power_of_two(exponent)
    inverse = _power_of_two(-exponent)
    scaled = torch.where(finite_mask, values.to(torch.float64) * inverse, 0.0)
    mean = scaled.sum() / count
    scaled.sub_(mean)
    scaled = torch.where(finite_mask, scaled, 0.0)
    squares = torch.dot(scaled, scaled)
    residual = scaled.sum()
    variance = ((squares - residual * residual / count) / count).clamp(min=0.0)
    return mean * scale, variance.sqrt() * scale


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as an exact float64 built from its bit pattern (exponent within ±1000)."""
    return ((exponent + 1023) << 52).reshape(1).view(torch.float64).reshape(())


# --- shared helpers -----------------------------------------------------------------------------


def metric_value(value: float) -> MetricValue:
    """A stored value, or null with a reason when it is not finite."""
    if not math.isfinite(value):
        return MetricValue(None, reasons.NON_FINITE_RESULT)
    return MetricValue(value + 0.0)  # + 0.0 turns -0.0 into 0.0
