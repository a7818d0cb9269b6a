"""From launched reductions to records: one host transfer per device, then plain records.

Design decision: everything one sampled forward (or backward) launched stays on its device until
this module moves it: the result vectors of every tensor are concatenated per device and copied
with one transfer each, then resolved into metric values and `HistogramRecord`s. This is the
only place where measured values cross to the host. `launch` sends a tensor on the cheapest path
that takes it (`launch`'s docstring); `build_records` gathers what each path measured, in launch
order, into one `SampleRecord` per sample, so the lane's torch ops do not grow with the layers.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from torchinstruments import reasons
from torchinstruments._torch_internals import (
    functorch_active,
    functorch_disabled,
    is_functorch_wrapped,
)
from torchinstruments.measurement import histograms, lane, numerics, paths, tensors
from torchinstruments.measurement.histograms import DEFAULT_BINS, HistogramVector
from torchinstruments.measurement.reducers import Measurer, PendingReduction
from torchinstruments.records import HistogramRecord, MeasurementBlock, SampleRecord, TensorKey
from torchinstruments.spare_core import Deferred, SpareCore, results

__all__ = [
    "LaneCopy",
    "Launched",
    "Measured",
    "PendingTensor",
    "build_records",
    "launch",
    "launch_tensor",
    "note_of",
]


@dataclass(frozen=True, slots=True)
class PendingTensor:
    """One measured tensor whose results are still on its device."""

    key: TensorKey
    shape: tuple[int, ...] | None
    dtype: str
    timestamp_us: int
    reduction: PendingReduction
    histogram: HistogramVector | None
    placement: str | None = None
    mesh_coordinate: tuple[int, ...] | None = None
    note: str | None = None


def launch_tensor(
    measurer: Measurer,
    key: TensorKey,
    tensor: torch.Tensor,
    focus: bool,
    reason: str | None = None,
) -> PendingTensor:
    """Launch the device-side reductions of one tensor; with `reason`, or on the meta device (no
    values to transfer), none: every metric null with it. A failure becomes null + reason.

    What is measured is the tensor's `tensors.measured_form` (torch.func wrappers unwrapped, a
    DTensor's local tensor, ...), reduced with torch.func's transforms switched off, so that the
    statistics are plain tensors even inside `grad` or `vmap`.
    """
    form: tensors.MeasuredForm | None = None
    histogram = None
    try:
        with _outside_torch_func():
            form = tensors.measured_form(tensor)
            reason = reason or (reasons.META_DEVICE if tensor.is_meta else None)
            if reason is not None or form.values is None:
                reduction = measurer.unavailable(reason or form.reason or reasons.NO_VALUE)
            elif focus:
                reduction, histogram = measurer.launch_with_histogram(form.values)
            else:
                reduction = measurer.launch(form.values)
    except Exception as error:
        reduction = measurer.unavailable(reason or reasons.error("measurement", error))
    form = form or tensors.MeasuredForm(None, tensors.shape_of(tensor))
    return PendingTensor(
        key,
        form.shape,
        tensors.dtype_name(tensor.dtype),
        time.time_ns() // 1000,
        reduction,
        histogram,
        form.placement,
        form.mesh_coordinate,
        form.note,
    )


def _outside_torch_func() -> contextlib.AbstractContextManager[object]:
    """torch.func's transforms switched off while measuring, if one is running (else nothing)."""
    return functorch_disabled() if functorch_active() else contextlib.nullcontext()


# A tensor the small-tensor lane took (after its key in a pass's list): when it was measured, its
# values' copy, its focus and its sizes. It holds no object the garbage collector tracks, so the
# collector stops tracking it at once instead of promoting it with the pass's survivors.
LaneCopy = tuple[int, np.ndarray, bool, *tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Measured:
    """A plain CPU tensor measured as it was launched (`numerics.measure_on_cpu`), when the
    default profile is the only reducer: its raw profile (`numerics.RAW`) and its histogram
    vector are ready, so nothing of it waits for the transfer; its metrics are derived with the
    pass's others (its key's signal is the batch's)."""

    key: TensorKey
    timestamp_us: int
    shape: tuple[int, ...]
    dtype: str
    raw: list[float]
    histogram: list[float] | None


# The entries `launch` gives for one tensor (a lane copy is two: its key, then its `LaneCopy`);
# `build_records` takes a pass's list of them.
Launched = PendingTensor | TensorKey | LaneCopy | Measured | Deferred[Measured | PendingTensor]


def launch(
    measurer: Measurer, key: TensorKey, tensor: torch.Tensor, focus: bool, spare: SpareCore
) -> tuple[Launched, ...]:
    """Launch the measurement of one tensor: the small-tensor lane's copy where the lane takes
    it (`lane`: the key, then a `LaneCopy`), a plain CPU tensor measured now or on the spare
    core (`Measured`, `Deferred`), else the general path's reductions (`launch_tensor`). The key
    is the output's, also for its gradient: the signal is the one `build_records` is given."""
    metrics = measurer.default_only
    if metrics is not None:
        try:
            path = paths.choose(tensor, host_paths=measurer.host_paths, lane_ok=True)
            if path == "lane":
                copy = lane.copy_values(tensor)
                if spare.hold(_held_bytes(copy.size)):  # else the lane keeps enough: now
                    return key, (time.time_ns() // 1000, copy, focus, *tensor.shape)
                path = "host"
            if path == "host" and _measured_here(tensor):
                return (spare.run(partial(_measure, measurer, key, focus, time.time_ns()), tensor),)
        except Exception:  # handed to the general path, which gives null + reason if it fails too
            pass
    return (launch_tensor(measurer, key, tensor, focus),)


def _held_bytes(numel: int) -> int:
    """The bytes a lane copy of `numel` entries counts against `spare_core.MAX_BYTES_HELD`."""
    return 4 * numel if numel >= lane.HELD_FROM else 0


def _measured_here(tensor: torch.Tensor) -> bool:
    """Whether the general path would measure `tensor` as it is (no unwrapping), with values."""
    if not tensor.numel() or not tensors.is_real_dtype(tensor.dtype) or functorch_active():
        return False
    return not is_functorch_wrapped(tensor)


def _measure(
    measurer: Measurer, key: TensorKey, focus: bool, stamp_ns: int, tensor: torch.Tensor
) -> Measured | PendingTensor:
    """A plain CPU tensor's default profile, as `Measured`; the general path's if it fails."""
    try:
        result = numerics.measure_on_cpu(tensor, DEFAULT_BINS if focus else None)
        raw = [result.raw[name] for name in numerics.RAW]
    except Exception:
        return launch_tensor(measurer, key, tensor, focus)
    shape, dtype = tuple(tensor.shape), tensors.dtype_name(tensor.dtype)
    return Measured(key, stamp_ns // 1000, shape, dtype, raw, result.histogram)


def note_of(item: Launched) -> str | None:
    """What the run should say about a launched tensor (a torch.func wrapper, a DTensor)."""
    return item.note if type(item) is PendingTensor else None


def build_records(
    signal: str,
    launched: Sequence[Launched],
    metrics: tuple[str, ...],
    rank: int | None,
    spare: SpareCore,
) -> list[SampleRecord]:
    """Measure the lane's tensors, transfer the others' results to the host, and resolve all of
    them into one record per sample, in launch order."""
    try:
        ready = results(launched)
        copies = [item for item in ready if type(item) is tuple]
        with spare.buffers() as buffers:
            focus = [copy[2] for copy in copies]
            lane_values, lane_why, lane_vectors = lane.measure(
                [copy[1] for copy in copies], metrics, focus, DEFAULT_BINS, buffers
            )
    finally:  # the lane's copies are dropped with the pass, however it ends
        kept = (item[1].size for item in launched if type(item) is tuple)
        spare.release(sum(_held_bytes(numel) for numel in kept))
    done_values: list[float | None] = []  # the `Measured` tensors' metrics, derived together
    done_why: list[str | None] = []
    if done := [item for item in ready if type(item) is Measured]:
        numel = np.array([math.prod(item.shape) for item in done])
        raw = np.array([item.raw for item in done], dtype=np.float64)
        done_values, done_why = numerics.profile_metrics(raw, numel, metrics)
    host = iter(_to_host([item for item in ready if type(item) is PendingTensor]))
    k = len(metrics)
    values: list[float | None] = []
    why: list[str | None] = []
    entries: list[_Entry] = []
    counted: dict[int, list[HistogramRecord]] = {}  # by sample, in launch order
    # One tuple per distinct shape: a block waits in the history buffer until a part takes it,
    # and each tuple is an object the garbage collector scans until then.
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    lane_at = done_at = 0
    lane_keys = [item for item in ready if isinstance(item, TensorKey)]  # each before its copy
    for item in ready:
        if isinstance(item, TensorKey):  # a lane copy's, which comes next
            continue
        if isinstance(item, PendingTensor):
            resolved, crossed = item.reduction.resolve(next(host)), next(host)
            values += [value.value for value in resolved]
            why += [value.reason for value in resolved]
            vector = crossed if isinstance(item.histogram, torch.Tensor) else item.histogram
            where = (item.placement, item.mesh_coordinate)
            entry = (item.key, item.timestamp_us, item.shape, item.dtype, *where)
        elif isinstance(item, Measured):
            values += done_values[done_at * k : (done_at + 1) * k]
            why += done_why[done_at * k : (done_at + 1) * k]
            done_at, vector, shape = done_at + 1, item.histogram, item.shape
            shape = shapes.setdefault(shape, shape)
            entry = (item.key, item.timestamp_us, shape, item.dtype, None, None)
        else:
            values += lane_values[lane_at * k : (lane_at + 1) * k]
            why += lane_why[lane_at * k : (lane_at + 1) * k]
            vector, shape, key = lane_vectors[lane_at], item[3:], lane_keys[lane_at]
            entry = (key, item[0], shapes.setdefault(shape, shape), "float32", None, None)
            lane_at += 1
        entries.append(entry)
        made = None if vector is None else histograms.record(vector, DEFAULT_BINS, entry[0], signal)
        if made is not None:
            counted.setdefault(made.sample_id, []).append(made)
    by_sample: dict[int, list[int]] = {}
    for position, entry in enumerate(entries):
        by_sample.setdefault(entry[0].sample_id, []).append(position)
    records = []
    for sample_id, positions in by_sample.items():
        if len(positions) == len(entries):  # the usual case: one sample
            chosen, block_values, block_why = entries, values, why
        else:
            chosen = [entries[p] for p in positions]
            block_values = [v for p in positions for v in values[p * k : (p + 1) * k]]
            block_why = [r for p in positions for r in why[p * k : (p + 1) * k]]
        block = _block(chosen, block_values, block_why, sample_id, signal, rank, metrics)
        made_here = tuple(counted.get(sample_id, ()))
        records.append(SampleRecord(signal, sample_id, block.forward_index, block, made_here))
    return records


# (key, timestamp_us, shape, dtype, placement, mesh_coordinate) of one tensor of a block.
_Entry = tuple[TensorKey, int, tuple[int, ...] | None, str, str | None, tuple[int, ...] | None]


def _block(
    entries: Sequence[_Entry],
    values: list[float | None],
    why: list[str | None],
    sample_id: int,
    signal: str,
    rank: int | None,
    metrics: tuple[str, ...],
) -> MeasurementBlock:
    """One sample's block, in tuples: no sink can change what another sink receives."""
    keys, stamps, shapes, dtypes, placements, meshes = zip(*entries, strict=True)
    return MeasurementBlock(
        sample_id=sample_id,
        forward_index=keys[0].forward_index,
        signal=signal,
        rank=rank,
        metrics=metrics,
        timestamps_us=stamps,
        layers=tuple([key.layer.name for key in keys]),
        module_types=tuple([key.layer.module_type for key in keys]),
        call_indices=tuple([key.call_index for key in keys]),
        tensor_paths=tuple([key.tensor_path for key in keys]),
        shapes=shapes,
        dtypes=dtypes,
        modes=tuple([key.mode for key in keys]),
        grad_enabled=tuple([key.grad_enabled for key in keys]),
        placements=placements,
        mesh_coordinates=meshes,
        values=tuple(values),
        reasons=tuple(why),
        step=keys[0].step,
    )


def _to_host(pending: Sequence[PendingTensor]) -> list[list[float]]:
    """The general path's vectors on the host, two per tensor, one transfer per device."""
    vectors: list[torch.Tensor | None] = []
    for item in pending:
        histogram = item.histogram
        vectors.append(item.reduction.device_vector)
        vectors.append(histogram if isinstance(histogram, torch.Tensor) else None)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for index, vector in enumerate(vectors):
        if vector is not None:
            by_device.setdefault(vector.device, []).append((index, vector))
    host: list[list[float]] = [[] for _ in vectors]
    with _outside_torch_func():
        for placed in by_device.values():
            flat = torch.cat([vector.reshape(-1) for _, vector in placed])
            values = flat.to("cpu", torch.float64).tolist()
            start = 0
            for index, vector in placed:
                host[index] = values[start : start + vector.numel()]
                start += vector.numel()
    return host
