"""The exact numerics of the default profile: order statistics, moments, quartiles.

Two ways to the same numbers, chosen by `tensors.host_sync_is_free(device)`:

* Device path (CUDA and any non-CPU device): no host synchronisation at all. Non-finite entries
  are replaced by +inf and the tensor is sorted once; min, max and the quartile neighbours are
  gathered at positions computed on the device from the finite count, and the interpolation is
  done on the host by `DefaultDeriver`. One sort is O(n log n) but it is the cheapest sync-free
  exact selection on a GPU, and it has no size limit (unlike `torch.quantile`, which refuses
  inputs over 2**24 elements).
* CPU path: host syncs are free, so it selects instead of sorting. A fast `x.sum()` proves the
  common all-finite case; otherwise the finite entries are compacted once. The order statistics
  come from an exact radix select on the float bit patterns (16 bits per level, at most two levels
  for float32 and four for float64, each a `bincount` plus one compaction of the bucket that holds
  the wanted rank); small candidate sets are just sorted. On 1e6 float32 entries the whole profile
  costs a small fraction of `torch.sort` (see `bench/statistics.py`).
* Mean and std are always accumulated in float64 with a corrected two-pass algorithm on values
  scaled by a power of two (exact), so neither a float32 variance nor a float64 sum of huge values
  overflows into a null.

Quartiles use NumPy's "linear" interpolation. A value that comes out non-finite is never stored:
it is null with the reason "non-finite result". Negative zero results are reported as 0.0.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchinstruments import reasons
from torchinstruments.records import MetricValue

QUARTILES: dict[str, float] = {"p25": 0.25, "p50": 0.5, "p75": 0.75}
FINITE_METRICS = frozenset({"mean", "std", "min", "max", "p25", "p50", "p75"})

# Candidate sets at most this large are sorted instead of refined by another radix level.
_SORT_BELOW = 1 << 14
_RADIX_BITS = 16
_RADIX_MASK = (1 << _RADIX_BITS) - 1
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


# --- CPU: compaction and selection --------------------------------------------------------------


def raw_on_host(values: torch.Tensor, wanted: frozenset[str]) -> dict[str, float]:
    """Raw values on a device where host syncs are free (the CPU)."""
    numel = values.numel()
    raw: dict[str, float] = {}
    if "zero_fraction" in wanted:
        raw["zeros"] = float(numel - int(torch.count_nonzero(values)))
    # A finite sum proves every entry finite; only otherwise pay for the mask and the compaction.
    if math.isfinite(float(values.sum())):
        finite_values = values
    else:
        mask = torch.isfinite(values)
        count = int(mask.sum())
        finite_values = values if count == numel else values[mask]
    finite = finite_values.numel()
    raw["finite"] = float(finite)
    if finite == 0 or not wanted & FINITE_METRICS:
        return raw
    low, high = (float(v) for v in torch.aminmax(finite_values))
    raw["min"], raw["max"] = low, high
    if wanted & {"mean", "std"}:
        raw["mean"], raw["std"] = _moments_on_host(finite_values, low, high)
    ranks = _quartile_ranks(finite, wanted)
    if ranks:
        needed = sorted({rank for pair in ranks.values() for rank in pair} - {0, finite - 1})
        order = {0: low, finite - 1: high}
        if low == high:
            order.update(dict.fromkeys(needed, low))
        elif needed:
            order.update(_select(finite_values, needed))
        for name, (lo_rank, hi_rank) in ranks.items():
            raw[f"{name}_lo"], raw[f"{name}_hi"] = order[lo_rank], order[hi_rank]
    return raw


def _moments_on_host(values: torch.Tensor, low: float, high: float) -> tuple[float, float]:
    """Mean and population std in float64 (corrected two-pass, power-of-two scaled if needed)."""
    count = values.numel()
    max_abs = max(abs(low), abs(high))
    scale = 1.0
    if max_abs > 2.0**500 or 0.0 < max_abs < 2.0**-500:
        scale = math.ldexp(1.0, _scale_exponent(max_abs))
    work = values.to(torch.float64, copy=True)
    if scale != 1.0:
        work.mul_(1.0 / scale)
    mean = work.mean()
    work.sub_(mean)
    squares = float(torch.dot(work, work))
    residual = float(work.sum())
    variance = max((squares - residual * residual / count) / count, 0.0)
    return float(mean) * scale, math.sqrt(variance) * scale


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


def _select(values: torch.Tensor, ranks: Sequence[int]) -> dict[int, float]:
    """Exact order statistics (0-based ranks) of finite float32/float64 values by radix select."""
    keys = _sortable_keys(values)
    found: dict[int, int] = {}
    bits = 64 if values.dtype == torch.float64 else 32
    _radix_select(keys, [(rank, rank) for rank in ranks], bits - _RADIX_BITS, True, found)
    return {rank: _key_to_float(key, values.dtype) for rank, key in found.items()}


def _radix_select(
    keys: torch.Tensor, wanted: list[tuple[int, int]], shift: int, top: bool, found: dict[int, int]
) -> None:
    """Finds keys of the given local ranks by one 16-bit digit, recursing into their buckets."""
    if keys.numel() <= _SORT_BELOW:
        ordered = torch.sort(keys).values
        for rank, local in wanted:
            found[rank] = int(ordered[local])
        return
    if shift < 0:  # every digit consumed: all keys in this bucket are equal
        key = int(keys[0])
        for rank, _ in wanted:
            found[rank] = key
        return
    digits = keys >> shift if shift else keys.clone()
    digits &= _RADIX_MASK
    if top:  # the top digit holds the sign: flip it so that unsigned digit order is key order
        digits ^= 1 << (_RADIX_BITS - 1)
    cumulative = torch.bincount(digits, minlength=1 << _RADIX_BITS).cumsum(0)
    locals_ = torch.tensor([local for _, local in wanted], dtype=cumulative.dtype)
    buckets = torch.searchsorted(cumulative, locals_, right=True)
    before = torch.where(buckets > 0, cumulative[(buckets - 1).clamp(min=0)], 0)
    by_bucket: dict[int, list[tuple[int, int]]] = {}
    for (rank, local), bucket, skipped in zip(
        wanted, buckets.tolist(), before.tolist(), strict=True
    ):
        by_bucket.setdefault(bucket, []).append((rank, local - skipped))
    if len(by_bucket) == 1:
        [(bucket, members)] = by_bucket.items()
        _radix_select(keys[digits == bucket], members, shift - _RADIX_BITS, False, found)
        return
    # Several buckets: one gather and one compaction over all keys, then split the candidates.
    table = torch.full((1 << _RADIX_BITS,), -1, dtype=torch.int8)
    table[list(by_bucket)] = torch.arange(len(by_bucket), dtype=torch.int8)
    group = table[digits]
    positions = (group >= 0).nonzero().squeeze(1)
    candidates, candidate_group = keys[positions], group[positions]
    for index, members in enumerate(by_bucket.values()):
        subset = candidates[candidate_group == index]
        _radix_select(subset, members, shift - _RADIX_BITS, False, found)


# --- other devices: one sort, no host sync ------------------------------------------------------


def raw_on_device(values: torch.Tensor, wanted: frozenset[str]) -> tuple[list[str], torch.Tensor]:
    """Raw values as one float64 device block, computed without any host synchronisation."""
    numel = values.numel()
    finite_mask = torch.isfinite(values)
    finite = finite_mask.sum()
    entries: dict[str, torch.Tensor] = {"finite": finite.to(torch.float64)}
    if "zero_fraction" in wanted:
        entries["zeros"] = (numel - torch.count_nonzero(values)).to(torch.float64)
    last = (finite - 1).clamp(min=0)
    ranks = [name for name in QUARTILES if name in wanted]
    low = high = None
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
    return keys, torch.stack([entries[key] for key in keys])


def _moments_on_device(
    values: torch.Tensor,
    finite_mask: torch.Tensor,
    finite: torch.Tensor,
    low: torch.Tensor | None,
    high: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std of the finite entries, float64, power-of-two scaled, no sync."""
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
    count = finite.clamp(min=1).to(torch.float64)
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
