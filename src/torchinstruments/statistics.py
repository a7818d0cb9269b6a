"""Descriptive statistics of one tensor, reduced where the tensor lives.

The default profile is nine numbers over the finite entries of a tensor (mean, population std,
min, max, the three quartiles with NumPy's "linear" interpolation) plus two fractions over all
entries (zero_fraction, nonfinite_fraction). Custom reducers add scalar metrics of their own.

Design decision: a reduction is split in two halves. `Measurer.reduce` runs on the tensor's device
and returns a `PendingReduction` whose `device_vector` holds every number that must cross to the
host; the capture engine concatenates the vectors of all tensors of one sampled forward and moves
them with ONE transfer, then calls `PendingReduction.finish` with the host values. Costs:

* Device path (CUDA and any non-CPU device): no host synchronisation at all. Non-finite entries
  are replaced by +inf and the tensor is sorted once; min, max and the quartile neighbours are
  gathered at positions computed on the device from the finite count, and the interpolation is
  done on the host in `finish`. One sort is O(n log n) but it is the cheapest sync-free exact
  selection on a GPU, and it has no size limit (unlike `torch.quantile`, which refuses inputs over
  2**24 elements).
* CPU path: host syncs are free, so it selects instead of sorting. A fast `x.sum()` proves the
  common all-finite case; otherwise the finite entries are compacted once. The order statistics
  come from an exact radix select on the float bit patterns (16 bits per level, at most two levels
  for float32 and four for float64, each a `bincount` plus one compaction of the bucket that holds
  the wanted rank); small candidate sets are just sorted. On 1e6 float32 entries the whole profile
  costs a small fraction of `torch.sort` (see `bench/statistics.py`).
* Mean and std are always accumulated in float64 with a corrected two-pass algorithm on values
  scaled by a power of two (exact), so neither a float32 variance nor a float64 sum of huge values
  overflows into a null.

Dtypes: float64 is measured in float64; float32, float16, bfloat16 (and other low-precision floats)
are measured as float32 values (the quartile neighbours are input values, interpolated in
float64). Integer and bool tensors are measured as float64 values (bool as 0/1; integers beyond
2**53 are rounded to the nearest float64). Complex dtypes and non-strided layouts (sparse, ...)
give every metric null with a reason. A value that comes out non-finite is never stored: it is
null with the reason "non-finite result". Negative zero results are reported as 0.0.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from torchinstruments.records import MetricValue

__all__ = [
    "DEFAULT_METRICS",
    "DefaultStatistics",
    "Measurer",
    "PendingReduction",
    "Reducer",
]

DEFAULT_METRICS: tuple[str, ...] = (
    "mean",
    "std",
    "min",
    "max",
    "p25",
    "p50",
    "p75",
    "zero_fraction",
    "nonfinite_fraction",
)

_QUARTILES: dict[str, float] = {"p25": 0.25, "p50": 0.5, "p75": 0.75}
_FINITE_METRICS = frozenset({"mean", "std", "min", "max", "p25", "p50", "p75"})

# Device types on which host syncs cost nothing, so selection (with syncs) beats one big sort.
_SELECTION_DEVICE_TYPES: frozenset[str] = frozenset({"cpu"})
# Candidate sets at most this large are sorted instead of refined by another radix level.
_SORT_BELOW = 1 << 14
_RADIX_BITS = 16
_RADIX_MASK = (1 << _RADIX_BITS) - 1
# Power-of-two scaling exponents stay in this range so that the scale and its inverse are normal.
_MAX_SCALE_EXPONENT = 1000

_INTEGRAL_DTYPES: frozenset[torch.dtype] = frozenset(
    dtype
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
)

NO_FINITE = "no finite entries"
EMPTY = "empty tensor"
NON_FINITE_RESULT = "non-finite result"
NO_VALUE = "reducer returned no value"


@runtime_checkable
class Reducer(Protocol):
    """A custom scalar reducer: the extension point for metrics beyond the default profile.

    `metrics` names every metric the reducer returns; it is read once when the observer is
    injected, so name clashes fail early. The call receives the tensor detached and under
    `torch.no_grad()`, and returns one scalar per metric: a 0-d (or one-element) tensor, which
    stays on the device until the sample's single host transfer, or a Python number.

    Example:
        >>> class AbsMax:
        ...     metrics = ("abs_max",)
        ...     def __call__(self, tensor):
        ...         return {"abs_max": tensor.abs().amax()}
    """

    @property
    def metrics(self) -> tuple[str, ...]:
        """Names of the metrics the reducer returns (a plain class attribute is fine)."""
        ...

    def __call__(self, tensor: torch.Tensor) -> Mapping[str, torch.Tensor | float]:
        """Returns one scalar per name in `metrics`."""
        ...


class DefaultStatistics:
    """The default profile, or a subset of it.

    Pass an instance in `reducers` to replace the implicit default profile, e.g.
    `DefaultStatistics(("mean", "std"))`, or `DefaultStatistics(())` for custom reducers only.

    Args:
        metrics: Names from `DEFAULT_METRICS`, in the order they should be reported.

    Raises:
        TypeError: If `metrics` is not a sequence of strings.
        ValueError: If a name is unknown or repeated.
    """

    def __init__(self, metrics: Sequence[str] = DEFAULT_METRICS) -> None:
        if isinstance(metrics, str | bytes) or not isinstance(metrics, Sequence):
            raise TypeError(
                f"metrics must be a sequence of metric names, got {metrics!r}; "
                f"allowed names: {', '.join(DEFAULT_METRICS)}"
            )
        for name in metrics:
            if not isinstance(name, str) or name not in DEFAULT_METRICS:
                raise ValueError(
                    f"metrics contains unknown metric {name!r}; "
                    f"allowed: {', '.join(DEFAULT_METRICS)}"
                )
        duplicates = sorted({name for name in metrics if list(metrics).count(name) > 1})
        if duplicates:
            raise ValueError(f"metrics repeats {', '.join(map(repr, duplicates))}")
        self.metrics: tuple[str, ...] = tuple(metrics)

    def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
        """Measures `tensor` synchronously; unavailable metrics are left out.

        `Measurer` uses the fused two-phase path instead; this exists so that the default profile
        also satisfies the `Reducer` protocol and can be called on its own.
        """
        measurer = Measurer([self])
        pending = measurer.reduce(tensor)
        vector = pending.device_vector
        values = pending.finish([] if vector is None else vector.tolist())
        return {
            name: mv.value
            for name, mv in zip(self.metrics, values, strict=True)
            if mv.value is not None
        }

    def __repr__(self) -> str:
        return f"DefaultStatistics(metrics={self.metrics!r})"


@dataclass(frozen=True, slots=True)
class _Part:
    """What one reducer produced for one tensor, waiting for the host values."""

    metrics: tuple[str, ...]
    host: dict[str, float] = field(default_factory=dict)
    refs: dict[str, int] = field(default_factory=dict)
    fixed: dict[str, MetricValue] = field(default_factory=dict)
    derive: Callable[[dict[str, float]], dict[str, MetricValue]] | None = None

    def finish(self, host_values: Sequence[float]) -> tuple[MetricValue, ...]:
        """Resolves the raw values and turns them into metric values."""
        raw = dict(self.host)
        raw.update({key: float(host_values[index]) for key, index in self.refs.items()})
        derived = self.derive(raw) if self.derive is not None else {}
        out: list[MetricValue] = []
        for name in self.metrics:
            if name in self.fixed:
                out.append(self.fixed[name])
            elif name in derived:
                out.append(derived[name])
            elif name in raw:
                out.append(_metric(raw[name]))
            else:
                out.append(MetricValue(None, NO_VALUE))
        return tuple(out)


class PendingReduction:
    """Device-resident result for one tensor; finished on the host after the single transfer.

    Attributes:
        device_vector: 1-D float64 tensor on the tensor's device holding everything that must
            cross to the host, or None if nothing must.
    """

    __slots__ = ("_parts", "_size", "device_vector")

    def __init__(self, device_vector: torch.Tensor | None, parts: Sequence[_Part]) -> None:
        self.device_vector = device_vector
        self._parts = tuple(parts)
        self._size = 0 if device_vector is None else int(device_vector.numel())

    def finish(self, host_values: Sequence[float]) -> tuple[MetricValue, ...]:
        """Turns the host copy of `device_vector` into metric values.

        Args:
            host_values: `device_vector.tolist()`, or an empty sequence when it is None.

        Returns:
            One `MetricValue` per name in `Measurer.metrics`, in order. Never raises: a failure
            becomes null values with the reason.
        """
        out: list[MetricValue] = []
        size_ok = len(host_values) == self._size
        for part in self._parts:
            if not size_ok:
                reason = (
                    f"statistics error: expected {self._size} host values, got {len(host_values)}"
                )
                out.extend(MetricValue(None, reason) for _ in part.metrics)
                continue
            try:
                out.extend(part.finish(host_values))
            except Exception as error:  # finishing must never crash the training step
                out.extend(
                    MetricValue(None, _error_reason("statistics", error)) for _ in part.metrics
                )
        return tuple(out)


class Measurer:
    """All metrics of one observer: the default profile and custom reducers, validated up front.

    Args:
        reducers: None for the default profile only. A sequence adds these reducers' metrics after
            the default profile, unless it contains a `DefaultStatistics` instance, which then
            replaces the implicit default profile in its position.

    Raises:
        TypeError: If `reducers` is not None or a sequence of reducers, or a reducer has no
            `metrics` sequence of non-empty strings.
        ValueError: If two reducers (or a reducer and the default profile) share a metric name,
            or one reducer repeats a name.
    """

    def __init__(self, reducers: Sequence[Reducer] | None) -> None:
        self._reducers: tuple[Reducer, ...] = _validate_reducers(reducers)
        self.metrics: tuple[str, ...] = tuple(
            name for reducer in self._reducers for name in reducer.metrics
        )

    def __repr__(self) -> str:
        return f"Measurer(reducers={list(self._reducers)!r})"

    def reduce(self, tensor: torch.Tensor) -> PendingReduction:
        """Starts measuring `tensor`; never raises and, off the CPU, never syncs with the host.

        Args:
            tensor: Any tensor; it is detached and never modified.

        Returns:
            The pending reduction; call `finish` with `device_vector.tolist()` once the values are
            on the host.
        """
        try:
            return self._reduce(tensor)
        except Exception as error:  # measuring must never crash the training step
            return self.unavailable(_error_reason("statistics", error))

    def unavailable(self, reason: str) -> PendingReduction:
        """A reduction whose every metric is null with `reason` (nothing to transfer)."""
        part = _Part(self.metrics, fixed={name: MetricValue(None, reason) for name in self.metrics})
        return PendingReduction(None, [part])

    def _reduce(self, tensor: torch.Tensor) -> PendingReduction:
        """Runs every reducer and packs the device values into one vector."""
        blocks: list[torch.Tensor] = []
        parts: list[_Part] = []
        with torch.no_grad():
            detached = tensor.detach()
            for reducer in self._reducers:
                offset = sum(int(block.numel()) for block in blocks)
                try:
                    if isinstance(reducer, DefaultStatistics):
                        part, block = _reduce_default(detached, reducer.metrics, offset)
                    else:
                        part, block = _call_reducer(reducer, detached, offset)
                except Exception as error:
                    reason = _error_reason("statistics", error)
                    fixed = {name: MetricValue(None, reason) for name in reducer.metrics}
                    part, block = _Part(tuple(reducer.metrics), fixed=fixed), None
                parts.append(part)
                if block is not None:
                    blocks.append(block)
            vector = None
            if blocks:
                vector = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return PendingReduction(vector, parts)


# --- validation ---------------------------------------------------------------------------------


def _validate_reducers(reducers: Sequence[Reducer] | None) -> tuple[Reducer, ...]:
    """Checks types and metric names; returns the reducers with the implicit default added."""
    if reducers is None:
        return (DefaultStatistics(),)
    if isinstance(reducers, str | bytes | Mapping) or not isinstance(reducers, Sequence):
        raise TypeError(
            "reducers must be None or a sequence of reducers (callables with a `metrics` tuple "
            f"of metric names), got {reducers!r}"
        )
    checked: list[Reducer] = []
    for index, reducer in enumerate(reducers):
        metrics = getattr(reducer, "metrics", None)
        if not callable(reducer):
            raise TypeError(f"reducers[{index}] must be callable, got {reducer!r}")
        if isinstance(metrics, str | bytes) or not isinstance(metrics, Sequence):
            raise TypeError(
                f"reducers[{index}] ({reducer!r}) must have a `metrics` tuple of metric names, "
                f"got {metrics!r}"
            )
        for name in metrics:
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"reducers[{index}] ({reducer!r}) has metric name {name!r}; "
                    "expected a non-empty str"
                )
        repeated = sorted({name for name in metrics if list(metrics).count(name) > 1})
        if repeated:
            raise ValueError(
                f"reducers[{index}] ({reducer!r}) repeats metric(s) {', '.join(map(repr, repeated))}"
            )
        checked.append(reducer)
    if not any(isinstance(reducer, DefaultStatistics) for reducer in checked):
        checked.insert(0, DefaultStatistics())
    owners: dict[str, list[str]] = {}
    for reducer in checked:
        for name in reducer.metrics:
            owners.setdefault(name, []).append(repr(reducer))
    clashes = {name: who for name, who in owners.items() if len(who) > 1}
    if clashes:
        described = "; ".join(f"{name!r} from {' and '.join(who)}" for name, who in clashes.items())
        raise ValueError(
            f"reducers: metric names must be unique across reducers and the default profile; "
            f"clashing: {described}. Rename the custom metric, or pass DefaultStatistics(...) "
            "with a subset to replace the default profile."
        )
    return tuple(checked)


# --- custom reducers ----------------------------------------------------------------------------


def _call_reducer(
    reducer: Reducer, tensor: torch.Tensor, offset: int
) -> tuple[_Part, torch.Tensor | None]:
    """Calls one custom reducer, keeping device scalars on the device."""
    metrics = tuple(reducer.metrics)
    try:
        result = reducer(tensor)
    except Exception as error:
        reason = _error_reason("reducer", error)
        return _Part(metrics, fixed={name: MetricValue(None, reason) for name in metrics}), None
    if not isinstance(result, Mapping):
        reason = f"reducer returned {type(result).__name__}, expected a mapping of metric names to scalars"
        return _Part(metrics, fixed={name: MetricValue(None, reason) for name in metrics}), None
    host: dict[str, float] = {}
    refs: dict[str, int] = {}
    fixed: dict[str, MetricValue] = {}
    device_values: list[torch.Tensor] = []
    for name in metrics:
        if name not in result:
            fixed[name] = MetricValue(None, NO_VALUE)
            continue
        value = result[name]
        if isinstance(value, torch.Tensor):
            problem = _scalar_tensor_problem(value)
            if problem is not None:
                fixed[name] = MetricValue(None, problem)
            elif value.device == tensor.device and value.device.type not in _SELECTION_DEVICE_TYPES:
                refs[name] = offset + len(device_values)
                device_values.append(value.detach().reshape(()).to(torch.float64))
            else:
                host[name] = float(value.detach().reshape(()).to(torch.float64).item())
        elif isinstance(value, numbers.Real):
            host[name] = float(value)
        else:
            fixed[name] = MetricValue(
                None,
                f"reducer returned {type(value).__name__} for {name!r}, "
                "expected a scalar tensor or a real number",
            )
    block = torch.stack(device_values) if device_values else None
    return _Part(metrics, host=host, refs=refs, fixed=fixed), block


def _scalar_tensor_problem(value: torch.Tensor) -> str | None:
    """Why a reducer's tensor value cannot be a metric, or None if it can."""
    if value.layout != torch.strided:
        return f"reducer returned a tensor with unsupported layout {value.layout}"
    if value.dtype.is_complex or not (value.dtype.is_floating_point or _is_integral(value.dtype)):
        return f"reducer returned a tensor of unsupported dtype {_dtype_name(value.dtype)}"
    if value.numel() != 1:
        return f"reducer returned a tensor of shape {tuple(value.shape)}, expected a scalar"
    return None


# --- default profile ----------------------------------------------------------------------------


def _reduce_default(
    tensor: torch.Tensor, metrics: tuple[str, ...], offset: int
) -> tuple[_Part, torch.Tensor | None]:
    """The default profile of one tensor: host values on the CPU, a device block elsewhere."""
    if not metrics:
        return _Part(metrics), None
    unsupported = _unsupported_reason(tensor)
    if unsupported is not None:
        return _Part(
            metrics, fixed={name: MetricValue(None, unsupported) for name in metrics}
        ), None
    numel = tensor.numel()
    if numel == 0:
        return _Part(metrics, fixed={name: MetricValue(None, EMPTY) for name in metrics}), None
    values = _working_values(tensor)
    wanted = frozenset(metrics)
    derive = _Deriver(numel, wanted)
    if values.device.type in _SELECTION_DEVICE_TYPES:
        host = _raw_by_selection(values, wanted)
        return _Part(metrics, host=host, derive=derive), None
    keys, block = _raw_on_device(values, wanted)
    refs = {key: offset + index for index, key in enumerate(keys)}
    return _Part(metrics, refs=refs, derive=derive), block


def _unsupported_reason(tensor: torch.Tensor) -> str | None:
    """Why the tensor cannot be measured at all, or None."""
    if tensor.layout != torch.strided:
        return f"unsupported layout {tensor.layout}"
    dtype = tensor.dtype
    if dtype.is_complex or not (dtype.is_floating_point or _is_integral(dtype)):
        return f"unsupported dtype {_dtype_name(dtype)}"
    return None


def _is_integral(dtype: torch.dtype) -> bool:
    """True for bool and the plain integer dtypes (not quantized ones)."""
    return dtype in _INTEGRAL_DTYPES


def _dtype_name(dtype: torch.dtype) -> str:
    """`torch.complex64` -> `complex64`."""
    return str(dtype).removeprefix("torch.")


def _working_values(tensor: torch.Tensor) -> torch.Tensor:
    """The flat float32/float64 values that are measured (see the module docstring)."""
    dtype = tensor.dtype
    if dtype in (torch.float32, torch.float64):
        work = tensor
    elif dtype.is_floating_point:
        work = tensor.to(torch.float32)
    else:
        work = tensor.to(torch.float64)
    return work.reshape(-1)


@dataclass(frozen=True, slots=True)
class _Deriver:
    """Turns the raw values (counts, moments, quartile neighbours) into the default metrics."""

    numel: int
    wanted: frozenset[str]

    def __call__(self, raw: dict[str, float]) -> dict[str, MetricValue]:
        """Computes fractions and interpolated quartiles on the host."""
        out: dict[str, MetricValue] = {}
        finite = round(raw["finite"])
        if "nonfinite_fraction" in self.wanted:
            out["nonfinite_fraction"] = _metric((self.numel - finite) / self.numel)
        if "zero_fraction" in self.wanted:
            out["zero_fraction"] = _metric(raw["zeros"] / self.numel)
        if finite == 0:
            for name in self.wanted & _FINITE_METRICS:
                out[name] = MetricValue(None, NO_FINITE)
            return out
        for name in ("mean", "std", "min", "max"):
            if name in self.wanted:
                out[name] = _metric(raw[name])
        for name, q in _QUARTILES.items():
            if name in self.wanted:
                gamma = (finite - 1) * q - math.floor((finite - 1) * q)
                out[name] = _metric(_lerp(raw[f"{name}_lo"], raw[f"{name}_hi"], gamma))
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
    for name, q in _QUARTILES.items():
        if name in wanted:
            low = math.floor((finite - 1) * q)
            ranks[name] = (low, min(low + 1, finite - 1))
    return ranks


def _scale_exponent(max_abs: float) -> int:
    """Exponent e with max_abs < 2**e, clamped so 2**±e stays normal."""
    exponent = math.frexp(max_abs)[1] if math.isfinite(max_abs) else 0
    return max(-_MAX_SCALE_EXPONENT, min(_MAX_SCALE_EXPONENT, exponent))


# --- CPU: compaction and selection --------------------------------------------------------------


def _raw_by_selection(values: torch.Tensor, wanted: frozenset[str]) -> dict[str, float]:
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
    if finite == 0 or not wanted & _FINITE_METRICS:
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


def _raw_on_device(values: torch.Tensor, wanted: frozenset[str]) -> tuple[list[str], torch.Tensor]:
    """Raw values as one float64 device block, computed without any host synchronisation."""
    numel = values.numel()
    finite_mask = torch.isfinite(values)
    finite = finite_mask.sum()
    entries: dict[str, torch.Tensor] = {"finite": finite.to(torch.float64)}
    if "zero_fraction" in wanted:
        entries["zeros"] = (numel - torch.count_nonzero(values)).to(torch.float64)
    last = (finite - 1).clamp(min=0)
    ranks = [name for name in _QUARTILES if name in wanted]
    low = high = None
    if ranks or wanted & {"min", "max"}:
        inf = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
        ordered = torch.sort(torch.where(finite_mask, values, inf)).values
        low = ordered[0]
        high = ordered.gather(0, last.reshape(1)).reshape(())
        entries["min"], entries["max"] = low.to(torch.float64), high.to(torch.float64)
        if ranks:
            steps = torch.tensor(
                [_QUARTILES[name] for name in ranks], dtype=torch.float64, device=values.device
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


def _metric(value: float) -> MetricValue:
    """A stored value, or null with a reason when it is not finite."""
    if not math.isfinite(value):
        return MetricValue(None, NON_FINITE_RESULT)
    return MetricValue(value + 0.0)  # + 0.0 turns -0.0 into 0.0


def _error_reason(source: str, error: BaseException) -> str:
    """`reducer error: ValueError: message`."""
    return f"{source} error: {type(error).__name__}: {error}"
