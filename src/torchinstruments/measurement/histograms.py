"""Histograms of the finite entries of one tensor, counted where its statistics are.

Design decision: like the statistics, a histogram is reduced in two halves, and it shares the
default profile's work when both measure the same tensor: the statistics' min, max, sum and sum
of squares are the histogram's head and range, and the counts are one more pass
(`numerics.histogram_vector`, the one histogram count of every path). On the CPU the vector
is a host list (it never round-trips through a tensor); on the general path it is counted on
the tensor's device without any host synchronisation and travels to the host with the sample's
single transfer. `record` turns it into a `HistogramRecord`.

The bins are equally spaced over [finite min, finite max] and follow `numpy.histogram` (bin i
holds edges[i] <= x < edges[i + 1], the last bin also the max), consistent with the float64
edges reported however narrow the bins (`numerics.thresholds`). A constant tensor gets one bin
of tiny width so that TensorBoard can draw it. Which tensors get a histogram, in which working
dtype, is `tensors`' rule, shared with the statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from torchinstruments.records import HistogramRecord, TensorKey

__all__ = ["DEFAULT_BINS", "HistogramVector", "record"]

DEFAULT_BINS = 64
# A histogram vector (`numerics.histogram_vector`): its `_HEAD` entries `finite, min, max, sum,
# sum_squares`, the bins + 1 edges and the bins counts (on the host or the tensor's device).
HistogramVector = torch.Tensor | list[float]
_HEAD = 5


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
