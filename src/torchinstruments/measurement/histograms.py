"""Histograms of the finite entries of one tensor, counted where its statistics are.

Design decision: like the statistics, a histogram is reduced in two halves, and it shares the
default profile's work when both measure the same tensor: the statistics' min, max, sum and sum
of squares are the histogram's head and range, and the counts are one more pass
(`numerics.histogram_vector`, the one histogram count of every path). On the CPU the vector
stays a host list (`PendingHistogram.host_vector`, it never round-trips through a tensor); on
the general path it is counted on the tensor's device without any host synchronisation and
travels to the host with the sample's single transfer. `resolve` turns either into a
`HistogramRecord`.

The bins are equally spaced over [finite min, finite max] and follow `numpy.histogram`: bin i
holds edges[i] <= x < edges[i + 1], and the last bin also holds the max. Counts are exactly
consistent with the float64 edges reported, even when bins are only a few ulps wide or the range
overflows float64 arithmetic (`numerics.thresholds`). A constant tensor gets one bin of tiny
width (relative 1e-6, at least 1e-12) so that TensorBoard can draw it. Which tensors get a
histogram and in which working dtype they are binned is `tensors`' rule, shared with the
statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchinstruments.measurement import tensors
from torchinstruments.records import HistogramRecord

__all__ = ["DEFAULT_BINS", "PendingHistogram"]

DEFAULT_BINS = 64
# Width of the single bin of a constant tensor, relative to its value (absolute for values near 0).
_CONSTANT_BIN_RELATIVE_WIDTH = 1e-6
_CONSTANT_BIN_MIN_WIDTH = 1e-12
# Layout of the head of device_vector; the bins + 1 edges and the bins counts follow.
_HEAD = ("finite", "min", "max", "sum", "sum_squares")


@dataclass(slots=True)  # not frozen: a frozen one's __init__ costs more, per tensor
class PendingHistogram:
    """A histogram counted on the device, waiting for the sample's host transfer.

    Attributes:
        device_vector: 1-D float64 tensor on the tensor's device, or None when there is nothing
            to transfer (unsupported or empty tensor, a failure while counting, or a histogram
            counted on the host).
        bins: The number of bins counted.
        host_vector: The same layout as a list, for a histogram counted on the host (the CPU
            paths), which then never round-trips through a tensor; `resolve` reads it instead of
            its argument.
    """

    device_vector: torch.Tensor | None
    bins: int
    host_vector: list[float] | None = None

    def resolve(
        self,
        host_values: Sequence[float],
        *,
        sample_id: int,
        layer: str,
        call_index: int,
        signal: str,
        tensor_path: str,
        mode: str = "train",
    ) -> HistogramRecord | None:
        """The record from `host_values` (`device_vector.tolist()`, or empty when it is None;
        ignored when `host_vector` is set), or None when the tensor has no finite entries, is
        unsupported, or the values are malformed. Never raises."""
        try:
            bins = self.bins
            if self.host_vector is not None:
                host_values = self.host_vector
            elif self.device_vector is None:
                return None
            if len(host_values) != len(_HEAD) + 2 * bins + 1:
                return None
            finite, low, high, total, squares = map(float, host_values[: len(_HEAD)])
            count = round(finite)
            if count == 0 or not (math.isfinite(low) and math.isfinite(high)):
                return None
            if low == high:
                width = max(abs(low) * _CONSTANT_BIN_RELATIVE_WIDTH, _CONSTANT_BIN_MIN_WIDTH)
                limits: tuple[float, ...] = (low + width,)
                counts: tuple[float, ...] = (float(count),)
            else:
                edges = host_values[len(_HEAD) : len(_HEAD) + bins + 1]
                limits = tuple(map(float, edges[1:]))
                counts = tuple(map(float, host_values[len(_HEAD) + bins + 1 :]))
            return HistogramRecord(
                sample_id=sample_id,
                layer=layer,
                call_index=call_index,
                signal=signal,
                tensor_path=tensor_path,
                mode=mode,
                min=low,
                max=high,
                num=float(count),
                sum=total,
                sum_squares=squares,
                bucket_limits=limits,
                bucket_counts=counts,
            )
        except Exception:  # finishing must never crash the training step
            return None


def pending_histogram(vector: torch.Tensor, bins: int) -> PendingHistogram:
    """A device vector waiting for the transfer; a tensor subclass's is read now (see
    `tensors.host_floats`), so that it never joins, or breaks, the sample's transfer."""
    if tensors.is_plain(vector):
        return PendingHistogram(vector, bins)
    return PendingHistogram(None, bins, tensors.host_floats(vector))
