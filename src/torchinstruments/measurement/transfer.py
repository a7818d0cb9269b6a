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
from typing import cast

import numpy as np
import torch

from torchinstruments import reasons
from torchinstruments._torch_internals import (
    functorch_active,
    functorch_disabled,
    is_fake,
    is_functorch_wrapped,
)
from torchinstruments.measurement import histograms, lane, numerics, paths, tensors
from torchinstruments.measurement.histograms import DEFAULT_BINS, HistogramVector
from torchinstruments.measurement.reducers import Measurer, PendingReduction
from torchinstruments.records import (
    Columns,
    HistogramRecord,
    MeasurementBlock,
    SampleRecord,
    TensorKey,
)
from torchinstruments.spare_core import Deferred, SpareCore, results

__all__ = [
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
    histogram, dtype = None, "unknown"  # the dtype of a subclass that refuses to tell it
    try:
        with _outside_torch_func():
            dtype = tensors.dtype_name(tensor.dtype)
            form = tensors.measured_form(tensor)
            reason = reason or reasons.without_values(tensor.is_meta, is_fake(tensor))
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
        dtype,
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


# The entries `launch` gives for one tensor; `build_records` takes a pass's list of them. A
# tensor the small-tensor lane took is four: its key, when it was measured, its values' copy (in
# its shape) and its focus. No tuple of them: the three are objects the garbage collector does
# not track, where a tuple was one more per tensor that counted towards its collections.
Launched = (
    PendingTensor | TensorKey | int | np.ndarray | Measured | Deferred[Measured | PendingTensor]
)


def launch(
    measurer: Measurer, key: TensorKey, tensor: torch.Tensor, focus: bool, spare: SpareCore
) -> tuple[Launched, ...]:
    """Launch the measurement of one tensor: the small-tensor lane's copy where the lane takes
    it (`lane`: the key, its time, the copy, its focus), a plain CPU tensor measured now or on the spare
    core (`Measured`, `Deferred`), else the general path's reductions (`launch_tensor`). The key
    is the output's, also for its gradient: the signal is the one `build_records` is given."""
    metrics = measurer.default_only
    if metrics is not None:
        try:
            path = paths.choose(tensor, host_paths=measurer.host_paths, lane_ok=True)
            if path == "lane":
                copy = lane.copy_values(tensor)
                if spare.hold(_held_bytes(copy.size)):  # else the lane keeps enough: now
                    return key, time.time_ns() // 1000, copy, focus
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
    except Exception:  # a copy of the copy: its memory is reused (`SpareCore.run`)
        return launch_tensor(measurer, key, tensor.clone(), focus)
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
        at = [i for i, item in enumerate(ready) if type(item) is np.ndarray]  # the lane's copies
        with spare.buffers() as buffers:
            flat = [ready[i].reshape(-1) for i in at]  # type: ignore[union-attr]
            focus: list[bool] = [ready[i + 1] for i in at]  # type: ignore[misc]
            lane_values, lane_why, lane_vectors = lane.measure(
                flat, metrics, focus, DEFAULT_BINS, buffers
            )
    finally:  # the lane's copies are dropped with the pass, however it ends
        kept = (item.size for item in launched if type(item) is np.ndarray)
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
    # One list per field (`MeasurementBlock.of_keys`), not a tuple per tensor: a 3,000-layer
    # pass made 3,000 tuples that held a key (tracked by the collector) and 3,000 iterators to
    # transpose them, promoted into its oldest generation by the collections the pass ran.
    columns: Columns = ([], [], [], [], [], [])
    keys, stamps, shapes_of, dtypes, placements, meshes = columns
    counted: dict[int, list[HistogramRecord]] = {}  # by sample, in launch order
    # One tuple per distinct shape: a block waits in the history buffer until a part takes it,
    # and each tuple is an object the garbage collector scans until then.
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    lane_at = done_at = 0
    for position, item in enumerate(ready):
        if type(item) is PendingTensor:  # exact types, as the lists above take them
            resolved, crossed = item.reduction.resolve(next(host)), next(host)
            values += [value.value for value in resolved]
            why += [value.reason for value in resolved]
            vector = crossed if isinstance(item.histogram, torch.Tensor) else item.histogram
            key, shape, dtype, stamp = item.key, item.shape, item.dtype, item.timestamp_us
            placements.append(item.placement)
            meshes.append(item.mesh_coordinate)
        elif type(item) is Measured or type(item) is np.ndarray:
            if type(item) is Measured:
                values += done_values[done_at * k : (done_at + 1) * k]
                why += done_why[done_at * k : (done_at + 1) * k]
                done_at, vector, shape, key = done_at + 1, item.histogram, item.shape, item.key
                dtype, stamp = item.dtype, item.timestamp_us
            else:  # a lane copy, after its key and time
                values += lane_values[lane_at * k : (lane_at + 1) * k]
                why += lane_why[lane_at * k : (lane_at + 1) * k]
                vector, shape, lane_at = lane_vectors[lane_at], item.shape, lane_at + 1
                key: TensorKey = ready[position - 2]  # type: ignore[assignment]
                stamp: int = ready[position - 1]  # type: ignore[assignment]
                dtype = "float32"
            shape = shapes.setdefault(shape, shape)
            placements.append(None)
            meshes.append(None)
        else:  # a lane copy's key, time or focus
            continue
        keys.append(key)
        stamps.append(stamp)
        shapes_of.append(shape)
        dtypes.append(dtype)
        made = None if vector is None else histograms.record(vector, DEFAULT_BINS, key, signal)
        if made is not None:
            counted.setdefault(made.sample_id, []).append(made)
    by_sample: dict[int, list[int]] = {}
    for position, key in enumerate(keys):
        by_sample.setdefault(key.sample_id, []).append(position)
    records = []
    for sample_id, positions in by_sample.items():
        if len(positions) == len(keys):  # the usual case: one sample
            chosen, block_values, block_why = columns, values, why
        else:
            chosen = cast(Columns, tuple([column[p] for p in positions] for column in columns))
            block_values = [v for p in positions for v in values[p * k : (p + 1) * k]]
            block_why = [r for p in positions for r in why[p * k : (p + 1) * k]]
        block = MeasurementBlock.of_keys(chosen, block_values, block_why, signal, rank, metrics)
        made_here = tuple(counted.get(sample_id, ()))
        records.append(SampleRecord(signal, sample_id, block.forward_index, block, made_here))
    return records


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
