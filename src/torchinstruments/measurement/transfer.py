"""From launched reductions to records: one host transfer per device, then plain records.

Design decision: everything one sampled forward (or one backward pass) launched stays on its
device until this module moves it, all at once: the result vectors of every tensor are
concatenated per device and copied with one transfer each, then each tensor's `PendingReduction`
and `PendingHistogram` are resolved into `Measurement` and `HistogramRecord`s. This is the only
place where measured values cross to the host.

The path of a value, from a layer's return to a history row: `observer` (or `gradients`) calls
`launch_tensor`, which launches the reductions on the device and returns a `PendingTensor`;
`build_records` transfers and resolves a list of them into one `SampleRecord` per sample; the
sinks turn those into rows. On the CPU, small tensors are only copied by `launch_tensor` (so later
in-place ops cannot change what is measured) and `build_records` first reduces all of them
together (`reducers.settle`): one segmented pass per sampled forward or backward, so the number
of torch ops per sample does not grow with the number of layers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchinstruments import reasons
from torchinstruments._torch_internals import functorch_active, functorch_disabled
from torchinstruments.measurement import tensors
from torchinstruments.measurement.histograms import PendingHistogram
from torchinstruments.measurement.reducers import Measurer, PendingReduction, settle
from torchinstruments.records import HistogramRecord, Measurement, SampleRecord, TensorKey


@dataclass(frozen=True, slots=True)
class PendingTensor:
    """One measured tensor whose results are still on its device."""

    key: TensorKey
    shape: tuple[int, ...] | None
    dtype: str
    timestamp_us: int
    reduction: PendingReduction
    histogram: PendingHistogram | None
    placement: str | None = None
    mesh_coordinate: tuple[int, ...] | None = None
    note: str | None = None


def launch_tensor(
    measurer: Measurer, key: TensorKey, tensor: torch.Tensor, focus: bool
) -> PendingTensor:
    """Launch the device-side reductions of one tensor; a failure becomes null + reason.

    What is measured is the tensor's `tensors.measured_form` (torch.func wrappers unwrapped, a
    DTensor's local tensor, ...), reduced with torch.func's transforms switched off, so that the
    statistics are plain tensors even inside `grad` or `vmap`.
    """
    form: tensors.MeasuredForm | None = None
    histogram = None
    try:
        with _outside_torch_func():
            form = tensors.measured_form(tensor)
            if form.values is None:
                reduction = measurer.unavailable(form.reason or reasons.NO_VALUE)
            elif focus:
                reduction, histogram = measurer.launch_with_histogram(form.values, defer=True)
            else:
                reduction = measurer.launch(form.values, defer=True)
    except Exception as error:
        reduction = measurer.unavailable(reasons.error("measurement", error))
    return PendingTensor(
        key,
        form.shape if form is not None else _shape(tensor),
        tensors.dtype_name(tensor.dtype),
        time.time_ns() // 1000,
        reduction,
        histogram,
        form.placement if form is not None else None,
        form.mesh_coordinate if form is not None else None,
        form.note if form is not None else None,
    )


def unavailable_tensor(
    measurer: Measurer, key: TensorKey, tensor: torch.Tensor, reason: str
) -> PendingTensor:
    """A tensor that is not measured: every metric null with `reason`, nothing to transfer."""
    return PendingTensor(
        key,
        _shape(tensor),
        tensors.dtype_name(tensor.dtype),
        time.time_ns() // 1000,
        measurer.unavailable(reason),
        None,
    )


def _shape(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The row's shape of a tensor whose measured form is not known."""
    try:
        return tensors.measured_form(tensor).shape
    except Exception:
        return tensors.shape_of(tensor)


def _outside_torch_func() -> contextlib.AbstractContextManager[object]:
    """torch.func's transforms switched off while measuring, if one is running (else nothing)."""
    return functorch_disabled() if functorch_active() else contextlib.nullcontext()


def to_host(vectors: Sequence[torch.Tensor | None]) -> list[list[float]]:
    """Move many small device vectors to the host in one transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for index, vector in enumerate(vectors):
        if vector is not None:
            by_device.setdefault(vector.device, []).append(index)
    host: list[list[float]] = [[] for _ in vectors]
    for indices in by_device.values():
        flat = torch.cat([vectors[i].reshape(-1) for i in indices])  # type: ignore[union-attr]
        values = flat.to("cpu", torch.float64).tolist()
        start = 0
        for i in indices:
            length = vectors[i].numel()  # type: ignore[union-attr]
            host[i] = values[start : start + length]
            start += length
    return host


def build_records(
    signal: str, pending: Sequence[PendingTensor], metrics: tuple[str, ...], rank: int | None
) -> list[SampleRecord]:
    """Transfer pending results to the host and resolve them into one record per sample."""
    with _outside_torch_func():
        settle([item.reduction for item in pending])  # the small CPU tensors, all at once
    vectors: list[torch.Tensor | None] = []
    for item in pending:
        vectors.append(item.reduction.device_vector)
        vectors.append(item.histogram.device_vector if item.histogram is not None else None)
    with _outside_torch_func():
        host = to_host(vectors)
    by_sample: dict[int, tuple[int, list[Measurement], list[HistogramRecord]]] = {}
    for position, item in enumerate(pending):
        key = item.key
        _, measurements, histograms = by_sample.setdefault(
            key.sample_id, (key.forward_index, [], [])
        )
        measurements.append(_measurement(item, host[2 * position], metrics, rank))
        if item.histogram is not None:
            histogram = item.histogram.resolve(
                host[2 * position + 1],
                sample_id=key.sample_id,
                layer=key.layer.name,
                call_index=key.call_index,
                signal=key.signal,
                tensor_path=key.tensor_path,
            )
            if histogram is not None:
                histograms.append(histogram)
    return [
        SampleRecord(signal, sample_id, forward_index, tuple(ms), tuple(hs))
        for sample_id, (forward_index, ms, hs) in by_sample.items()
    ]


def _measurement(
    item: PendingTensor, host_values: list[float], metrics: tuple[str, ...], rank: int | None
) -> Measurement:
    """The host-side record of one measured tensor."""
    key = item.key
    return Measurement(
        sample_id=key.sample_id,
        forward_index=key.forward_index,
        timestamp_us=item.timestamp_us,
        rank=rank,
        layer=key.layer.name,
        module_type=key.layer.module_type,
        call_index=key.call_index,
        signal=key.signal,
        tensor_path=key.tensor_path,
        shape=item.shape,
        dtype=item.dtype,
        mode=key.mode,
        grad_enabled=key.grad_enabled,
        metrics=metrics,
        values=item.reduction.resolve(host_values),
        placement=item.placement,
        mesh_coordinate=item.mesh_coordinate,
    )
