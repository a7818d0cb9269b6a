"""Histograms of the finite entries of one tensor, counted where its statistics are.

Design decision: a histogram shares the default profile's work: the statistics' min, max, sum
and sum of squares are its head and range, and the counts are one more pass (`histogram_vector`,
the one histogram count of every path): a host list on the CPU, counted on the tensor's device
without a host synchronisation elsewhere (it crosses with the sample's single transfer).

The bins are equally spaced over [finite min, finite max] and follow `numpy.histogram` (the last
bin also holds the max), consistent with the float64 edges however narrow the bins: an entry's
bin is the number of inner `thresholds` (each edge rounded up to the working dtype) <= it. A
constant tensor gets one bin of tiny width so that TensorBoard can draw it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchinstruments.records import HistogramRecord, TensorKey

__all__ = [
    "DEFAULT_BINS",
    "HistogramVector",
    "bin_counts",
    "edges",
    "guess_scale",
    "histogram_vector",
    "record",
    "thresholds",
]

DEFAULT_BINS = 64
# A histogram vector (`histogram_vector`): its `_HEAD` entries `finite, min, max, sum,
# sum_squares`, the bins + 1 edges and the bins counts (on the host or the tensor's device).
HistogramVector = torch.Tensor | list[float]
_HEAD = 5
_Array = Any  # a NumPy array or a torch tensor: what the generic functions take
_CHUNK = 1 << 16  # entries counted at a time on the host: bounds the temporaries
_COUNTERS = 4  # copies of the counters `bin_counts` counts into
_MAX_OFF = 3  # a guess that can miss by more bins is not corrected: each entry bisected instead


def edges(low: _Array, high: _Array, bins: int) -> _Array:
    """bins + 1 non-decreasing float64 edges from low to high (no overflow for any finite pair):
    float64 NumPy arrays for float `low`/`high` (a row each for columns of them), else tensors
    on their device."""
    if isinstance(low, torch.Tensor):
        steps = torch.arange(bins + 1, dtype=torch.float64, device=low.device) / bins
        complement = 1.0 - steps
        out = torch.cummax(low * complement + high * steps, 0).values
        out = torch.minimum(torch.maximum(out, low), high)
        return torch.cat([low.reshape(1), out[1:-1], high.reshape(1)])
    steps, complement = _steps(bins)
    out = low * complement + high * steps  # one row per pair, if they are columns
    np.maximum.accumulate(out, axis=-1, out=out)
    np.minimum(np.maximum(out, low, out=out), high, out=out)
    out[..., :1], out[..., -1:] = low, high
    return out


@functools.lru_cache(maxsize=8)
def _steps(bins: int) -> tuple[np.ndarray, np.ndarray]:
    """i / bins and 1 - i / bins for i in 0..bins (read-only: shared by every call)."""
    steps = np.arange(bins + 1, dtype=np.float64) / bins
    complement = 1.0 - steps
    steps.flags.writeable = complement.flags.writeable = False
    return steps, complement


def thresholds(edges: _Array, dtype: Any) -> _Array:
    """Per inner edge, the smallest value of the working `dtype` >= it, so that for every x of
    `dtype`, x < edge exactly when x < threshold (generic; per row of NumPy `edges`)."""
    inner = edges[..., 1:-1]
    if isinstance(inner, torch.Tensor):
        rounded = inner.to(dtype)
        up = torch.nextafter(rounded, torch.full_like(rounded, math.inf))
        return torch.where(rounded < inner, up, rounded)
    rounded = inner.astype(dtype)
    if rounded.dtype != np.float64:
        np.nextafter(rounded, np.float32(np.inf), out=rounded, where=rounded < inner)
    return rounded


def bin_counts(
    values: _Array, bounds: _Array, bins: int, finite: _Array | None = None, ascending: bool = False
) -> _Array:
    """How many `values` fall in each of the `bins` bins between the `bounds` (the `edges`;
    generic): an entry's bin is the number of inner `thresholds` <= it; entries where `finite`
    is False are in none. float64 counts; `ascending`: sorted NumPy parts, a row of `bounds`
    each, counted by bisection (a row of counts each)."""
    limits = thresholds(bounds, (values[0] if ascending else values).dtype)
    if ascending:  # the entries of each part below each of its limits: a bisection each
        below = np.zeros((len(values), bins + 1), dtype=np.int64)
        below[:, 1:-1] = [part.searchsorted(row) for part, row in zip(values, limits, strict=True)]
        below[:, -1] = [part.size for part in values]
        return np.diff(below, axis=1).astype(np.float64)
    if isinstance(values, torch.Tensor):
        index = torch.bucketize(values.contiguous(), limits, right=True)  # else torch warns, copies
        if finite is not None:
            index = torch.where(finite, index, bins)
        counts = values.new_zeros(bins + 1, dtype=torch.float64)
        return counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float64))[:bins]
    low = float(bounds[0])
    scale, off = guess_scale(limits, low, float(bounds[-1]) - low, bins)
    # Bin i holds the entries from around[i] to around[i + 1]; bin `bins` the max's, added to the
    # last. Counted by np.bincount into `_COUNTERS` copies of the counters, entry j into copy
    # j % _COUNTERS: one counter hit by a run of entries (a ReLU's zeros) waits for each increment
    # before the next, four copies do not (16,384 float32 entries here: 22 us whatever the
    # values; one copy 18 us, 27 with a ReLU's zeros; NumPy's add.at over pairs of bins 24).
    around = np.concatenate([[-np.inf], limits, [np.inf]]).astype(limits.dtype)
    width = bins + 1
    counts = np.zeros(width, dtype=np.int64)
    offsets = _counter_offsets(width)
    size = min(_CHUNK, values.size)
    buffer, indices = np.empty(size), np.empty(size, np.int32)  # int32: half int64's casts
    for begin in range(0, values.size, _CHUNK):
        piece = values[begin : begin + _CHUNK]
        index = indices[: piece.size]
        if off > _MAX_OFF:  # no span to guess within, or bins too narrow: a bisection each
            index[:] = np.searchsorted(limits, piece, side="right")
        else:
            guess = buffer[: piece.size]
            np.copyto(guess, piece)  # then in place: a cast within the subtraction is slower
            guess -= low
            guess *= scale
            np.copyto(index, guess, casting="unsafe")  # truncation: the floor of a guess >= 0
            if off:
                np.minimum(index, bins - 1, out=index)
            for _ in range(off):  # each step takes every entry a bin nearer its own
                index -= piece < around.take(index)
                index += piece >= around.take(index + 1)
        np.add(index, offsets[: index.size], out=index)
        copies = np.bincount(index, minlength=_COUNTERS * width)
        counts += copies.reshape(_COUNTERS, width).sum(axis=0)
    totals = counts.astype(np.float64)
    totals[bins - 1] += totals[bins]
    return totals[:bins]


@functools.lru_cache(maxsize=8)
def _counter_offsets(width: int) -> np.ndarray:
    """Per entry of a chunk, where its copy of `width` counters starts (int32, read-only)."""
    offsets = np.tile(np.arange(_COUNTERS, dtype=np.int32) * width, _CHUNK // _COUNTERS)
    offsets.flags.writeable = False
    return offsets


def guess_scale(limits: np.ndarray, low: float, span: float, bins: int) -> tuple[float, int]:
    """The factor of the guess `int((x - low) * scale)` of an unsorted entry's bin (`limits`:
    the inner `thresholds`), and by how many bins it can miss (above `_MAX_OFF`: bisect instead),
    read on each limit and the value below it (the guess is monotone in x). `bins / span` is
    rounded up, so that a limit that is an edge exactly reaches its bin."""
    scale = math.nextafter(bins / span, math.inf) if 0 < span < math.inf else math.inf
    if not math.isfinite(scale):  # the span overflowed, or is too narrow to divide by
        return math.nan, _MAX_OFF + 1
    with np.errstate(over="ignore", invalid="ignore"):
        at = np.floor(np.subtract(limits, low, dtype=np.float64) * scale)
        below = np.nextafter(limits, np.array(-np.inf, dtype=limits.dtype))
        under = np.floor(np.subtract(below, low, dtype=np.float64) * scale)
    steps = np.arange(1, bins)
    off = np.concatenate([[0], steps - at, under + 1 - steps]).max()  # short, or over
    return scale, int(off) if off <= _MAX_OFF else _MAX_OFF + 1


def histogram_vector(
    values: _Array,
    low: _Array,
    high: _Array,
    head: tuple[_Array, _Array, _Array],
    bins: int,
    finite: _Array | None = None,
    ascending: bool = False,
) -> Any:
    """`finite, min, max, sum, sum_squares` (`head`: count, sum, sum of squares), the bins + 1
    edges and the bins counts: a list for finite NumPy `values`, a tensor for torch ones, and
    for `ascending` ones (sorted NumPy parts, with arrays of `low`, `high` and `head`, an entry
    per part) a list per part, their edges and limits computed as rows, at once."""
    count, total, sum_squares = head
    low, high = low + 0.0, high + 0.0  # -0.0 is 0.0, as a metric (sorts put either zero first)
    bounds = edges(low[:, None], high[:, None], bins) if ascending else edges(low, high, bins)
    counts = bin_counts(values, bounds, bins, finite, ascending)
    if isinstance(values, torch.Tensor):
        return torch.cat([torch.stack([count, low, high, total, sum_squares]), bounds, counts])
    if ascending:
        heads = np.stack([count, low, high, total, sum_squares], axis=1, dtype=np.float64)
        return np.concatenate([heads, bounds, counts], axis=1).tolist()
    head_values = [float(count), float(low), float(high), float(total), float(sum_squares)]
    return [*head_values, *bounds.tolist(), *counts.tolist()]


def record(
    values: Sequence[float], bins: int, key: TensorKey, signal: str
) -> HistogramRecord | None:
    """The record of the histogram vector of the tensor `key` names as `signal`, read on the
    host, or None when the tensor has no finite entries or the values are malformed. An eval
    tensor's record has tags of its own (`records.histogram_tag`). Never raises."""
    try:
        if len(values) != _HEAD + 2 * bins + 1:
            return None
        finite, low, high, total, squares = map(float, values[:_HEAD])
        count = round(finite)
        if count == 0 or not (math.isfinite(low) and math.isfinite(high)):
            return None
        if low == high:
            width = max(abs(low) * 1e-6, 1e-12)  # relative to the value, absolute near 0
            limits: tuple[float, ...] = (low + width,)
            counts: tuple[float, ...] = (float(count),)
        else:
            limits = tuple(map(float, values[_HEAD + 1 : _HEAD + bins + 1]))
            counts = tuple(map(float, values[_HEAD + bins + 1 :]))
        return HistogramRecord(
            sample_id=key.sample_id,
            layer=key.layer.name,
            call_index=key.call_index,
            signal=signal,
            tensor_path=key.tensor_path,
            min=low,
            max=high,
            num=float(count),
            sum=total,
            sum_squares=squares,
            bucket_limits=limits,
            bucket_counts=counts,
            mode=key.mode,
        )
    except Exception:  # finishing must never crash the training step
        return None
