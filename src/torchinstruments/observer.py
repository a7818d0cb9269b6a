"""The running observer: root forwards, call indices, measurement batching and gradient hooks.

One `Observer` serves one model. Its state lives here, outside the model: the proxies hold the
observer, the observer holds the model's modules only through weak references, so a model that
is dropped without `remove_observer` is collected and its run is finalized by `weakref.finalize`.

Timing of work, by design:
- unsampled root forward: one Python call of `on_root_call` (counter, sampler) and nothing per
  layer (wrapt's C path, see capture.py);
- sampled root forward: reductions are launched on each tensor's device as the layer returns (so
  a later in-place op cannot change what was measured), their results stay on the device, and
  everything the forward produced crosses to the host in one transfer per device when the root
  forward ends;
- backward: each sampled output's `Tensor.register_hook` reduces the gradient on its device; the
  first hook of a backward pass queues one autograd-engine callback that transfers all of that
  pass's gradient results at once when the pass ends.

Root forwards: the outermost call of the root's `forward` (via `model(x)` or `model.forward(x)`).
A call of the root inside its own forward is part of the enclosing root forward: it is not
counted, not sampled on its own, and (if the root is a selected layer) gets the next call_index.
A selected layer called outside any root forward (for instance `self.encoder(x)` in a Lightning
step when the LightningModule is the root) is not observed: it runs untouched and nothing is
recorded; inject into the module your loop calls.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import _symbolic_trace
from torch.utils.hooks import RemovableHandle

from torchinstruments.capture import (
    called_through_module_call,
    install_proxy,
    iter_tensors,
    restore_proxy,
)
from torchinstruments.histograms import PendingHistogram, reduce_histogram
from torchinstruments.records import (
    OUTPUT,
    OUTPUT_GRADIENT,
    HistogramRecord,
    LayerInfo,
    Measurement,
    RunCounts,
    SampleRecord,
)
from torchinstruments.sinks import SinkGroup
from torchinstruments.statistics import Measurer, PendingReduction


def is_tracing() -> bool:
    """True while torch.jit.trace, torch.compile or torch.fx is tracing the model.

    Such a call is not a training step: it passes through untouched, so no measurement op ends
    up in a traced program and nothing is counted.
    """
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or _is_fx_tracing()


# torch.fx symbolic tracing; `is_fx_tracing` (older torch) also logs a warning in newer releases.
_is_fx_tracing: Callable[[], bool] = getattr(
    _symbolic_trace, "is_fx_symbolic_tracing", _symbolic_trace.is_fx_tracing
)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `float32`."""
    return str(dtype).removeprefix("torch.")


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


@dataclass(frozen=True, slots=True)
class _TensorKey:
    """Which tensor of which sample: shared by an output and the gradient into it."""

    sample_id: int
    forward_index: int
    layer: LayerInfo
    call_index: int
    signal: str
    tensor_path: str
    mode: str
    grad_enabled: bool


@dataclass(frozen=True, slots=True)
class _Pending:
    """One measured tensor whose results are still on its device."""

    key: _TensorKey
    shape: tuple[int, ...]
    dtype: str
    timestamp_us: int
    reduction: PendingReduction
    histogram: PendingHistogram | None


class _Sample:
    """A sampled root forward in progress."""

    __slots__ = ("call_counts", "forward_index", "pending", "sample_id")

    def __init__(self, sample_id: int, forward_index: int) -> None:
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.call_counts: dict[str, int] = {}
        self.pending: list[_Pending] = []

    def next_call_index(self, layer: str) -> int:
        """The call_index of this layer's next invocation inside this root forward."""
        index = self.call_counts.get(layer, 0)
        self.call_counts[layer] = index + 1
        return index


class _LayerCapture:
    """The wrapper behind one selected layer's proxy; runs only during sampled forwards."""

    __slots__ = ("focus", "info", "module_ref", "observer")

    def __init__(self, observer: Observer, module: nn.Module, info: LayerInfo, focus: bool) -> None:
        self.observer = observer
        self.module_ref = weakref.ref(module)
        self.info = info
        self.focus = focus

    def on_call(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        """Assign the call_index, run the forward, measure what it returned, return it as is."""
        observer = self.observer
        sample = observer.current
        if sample is None or (
            not observer.capture_direct_forwards and not called_through_module_call()
        ):
            return wrapped(*args, **kwargs)
        call_index = sample.next_call_index(self.info.name)
        output = wrapped(*args, **kwargs)
        observer.measure_output(sample, self, call_index, output)
        return output

    def mode(self) -> str:
        """`train` or `eval`, read from the module at call time."""
        module = self.module_ref()
        return "train" if module is None or module.training else "eval"


class _GradientHook:
    """`Tensor.register_hook` callback: records the first gradient into one sampled output."""

    __slots__ = ("fired", "focus", "key", "observer")

    def __init__(self, observer: Observer, key: _TensorKey, focus: bool) -> None:
        self.observer = observer
        self.key = key
        self.focus = focus
        self.fired = False

    def __call__(self, grad: torch.Tensor) -> None:
        if not self.fired and not self.observer.closed:
            self.fired = True
            try:
                self.observer.measure_gradient(self.key, grad, self.focus)
            except Exception as error:  # never break the user's backward
                self.observer.warn_once("gradient", f"recording a gradient failed: {error!r}")
        return None


class Observer:
    """Runtime state of one observed model; created by `inject_observer`."""

    def __init__(
        self,
        *,
        directory: Path,
        sampler: Any,
        measurer: Measurer,
        sinks: SinkGroup,
        rank: int | None,
        capture_direct_forwards: bool,
    ) -> None:
        self.directory = directory
        self.sampler = sampler
        self.finalizer: weakref.finalize | None = None
        self.measurer = measurer
        self.sinks = sinks
        self.rank = rank
        self.capture_direct_forwards = capture_direct_forwards
        # Non-empty exactly while a sampled root forward runs (one item per thread running one);
        # its bound __len__ is every leaf proxy's `enabled` test, evaluated in wrapt's C code.
        self.active: list[int] = []
        # Root depth and the open sample are per thread: a model run from several threads keeps
        # each thread's forwards apart. Counters and the sampler are shared, under a lock.
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self._sink_lock = threading.RLock()
        self.closed = False
        self.root_forwards = 0
        self.samples = 0
        self.backward_sample_ids: set[int] = set()
        self._token = object()
        self._installed: list[weakref.ref[nn.Module]] = []
        self._root_layer: _LayerCapture | None = None
        self._pending_backward: list[_Pending] = []
        self._backward_lock = threading.Lock()
        self._backward_flush_queued = False
        self._warned: set[str] = set()
        self._leaf_hooks: list[
            tuple[weakref.ref[torch.Tensor], RemovableHandle, _GradientHook]
        ] = []

    # -- installation -------------------------------------------------------------------------

    def install(
        self, root: nn.Module, layers: Sequence[tuple[nn.Module, LayerInfo]], focus: set[str]
    ) -> None:
        """Install a proxy on every selected layer, then on the root (which delimits forwards)."""
        for module, info in layers:
            capture = _LayerCapture(self, module, info, info.name in focus)
            if module is root:
                self._root_layer = capture
                continue
            self._install(module, capture.on_call, self.active.__len__)
        self._install(root, self.on_root_call, None)

    def _install(self, module: nn.Module, wrapper: Callable[..., Any], enabled: Any) -> None:
        """Install one proxy and remember how to undo it."""
        install_proxy(module, wrapper, enabled, self._token)
        self._installed.append(weakref.ref(module))

    def restore(self) -> int:
        """Undo every proxy in reverse order; returns how many were left in place (not ours)."""
        left_in_place = 0
        for module_ref in reversed(self._installed):
            module = module_ref()
            if module is not None and not restore_proxy(module, self._token):
                left_in_place += 1
        self._installed.clear()
        return left_in_place

    # -- root forwards ------------------------------------------------------------------------

    def on_root_call(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        """Count root forwards, ask the sampler, and hold the sample open while the forward runs."""
        if (
            self.closed
            or is_tracing()
            or (not self.capture_direct_forwards and not called_through_module_call())
        ):
            return wrapped(*args, **kwargs)
        local = self._local
        if getattr(local, "depth", 0) > 0:
            return self._call_nested(wrapped, args, kwargs)
        with self._count_lock:
            forward_index = self.root_forwards
            self.root_forwards += 1
            sample_id = self.samples if self._should_sample(forward_index) else None
            if sample_id is not None:
                self.samples += 1
        if sample_id is None:
            local.depth = 1
            try:
                return wrapped(*args, **kwargs)
            finally:
                local.depth = 0
        sample = _Sample(sample_id, forward_index)
        local.sample = sample
        local.depth = 1
        self.active.append(1)
        try:
            return self._call_root_layer(wrapped, args, kwargs)
        finally:
            self.active.pop()
            local.depth = 0
            local.sample = None
            self._emit_forward(sample)

    @property
    def current(self) -> _Sample | None:
        """The sampled root forward running in this thread, if any."""
        return getattr(self._local, "sample", None)

    def _call_nested(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A root call inside a root forward (same thread): part of the enclosing forward."""
        self._local.depth += 1
        try:
            return self._call_root_layer(wrapped, args, kwargs)
        finally:
            self._local.depth -= 1

    def _call_root_layer(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run the root's forward, measuring it when the root is itself a selected layer."""
        sample = self.current
        if self._root_layer is None or sample is None:
            return wrapped(*args, **kwargs)
        call_index = sample.next_call_index(self._root_layer.info.name)
        output = wrapped(*args, **kwargs)
        self.measure_output(sample, self._root_layer, call_index, output)
        return output

    def _should_sample(self, forward_index: int) -> bool:
        """The sampler's decision; a raising sampler means "not sampled" (warned once)."""
        try:
            return bool(self.sampler.should_sample(forward_index))
        except Exception as error:
            self.warn_once("sampler", f"sampler {self.sampler!r} raised {error!r}; not sampled")
            return False

    # -- measurement --------------------------------------------------------------------------

    def measure_output(
        self, sample: _Sample, layer: _LayerCapture, call_index: int, output: Any
    ) -> None:
        """Launch the reductions of every tensor in `output` and hook their gradients."""
        try:
            mode = layer.mode()
            grad_enabled = torch.is_grad_enabled()
            tensors = list(iter_tensors(output))
        except Exception as error:
            self.warn_once(
                f"walk:{layer.info.name}",
                f"reading the output of layer {layer.info.name!r} failed: {error!r}",
            )
            return
        for path, tensor in tensors:
            key = _TensorKey(
                sample.sample_id,
                sample.forward_index,
                layer.info,
                call_index,
                OUTPUT,
                path,
                mode,
                grad_enabled,
            )
            sample.pending.append(self._measure(key, tensor, layer.focus))
            self._hook_gradient(key, tensor, layer.focus)

    def _measure(self, key: _TensorKey, tensor: torch.Tensor, focus: bool) -> _Pending:
        """Launch the device-side reductions of one tensor; a failure becomes null + reason."""
        try:
            shape = tuple(tensor.shape)
        except Exception:  # e.g. nested tensors have no single shape
            shape = ()
        try:
            reduction = self.measurer.reduce(tensor)
            histogram = reduce_histogram(tensor) if focus else None
        except Exception as error:
            reduction = self.measurer.unavailable(
                f"measurement error: {type(error).__name__}: {error}"
            )
            histogram = None
        return _Pending(
            key, shape, dtype_name(tensor.dtype), time.time_ns() // 1000, reduction, histogram
        )

    def _hook_gradient(self, key: _TensorKey, tensor: torch.Tensor, focus: bool) -> None:
        """Register the hook that records the gradient into this sampled output."""
        try:
            if not tensor.requires_grad:
                return
            hook = _GradientHook(self, key, focus)
            handle = tensor.register_hook(hook)
            if tensor.grad_fn is None:
                self._track_leaf_hook(tensor, handle, hook)
        except Exception as error:
            self.warn_once("hook", f"hooking an output's gradient failed: {error!r}")

    def _track_leaf_hook(
        self, tensor: torch.Tensor, handle: RemovableHandle, hook: _GradientHook
    ) -> None:
        """A leaf (e.g. an input or parameter returned as is) outlives the graph: keep at most one
        unfired hook of ours on it, and remove the rest after their backward or at close."""
        kept = []
        for ref, old_handle, old_hook in self._leaf_hooks:
            if ref() is tensor and not old_hook.fired:
                old_handle.remove()
            else:
                kept.append((ref, old_handle, old_hook))
        kept.append((weakref.ref(tensor), handle, hook))
        self._leaf_hooks = kept

    def measure_gradient(self, key: _TensorKey, grad: torch.Tensor, focus: bool) -> None:
        """Reduce the gradient into one sampled output; flushed when the backward pass ends."""
        pending = self._measure(replace(key, signal=OUTPUT_GRADIENT), grad, focus)
        with self._backward_lock:
            self._pending_backward.append(pending)
            queue = not self._backward_flush_queued
            self._backward_flush_queued = True
        if queue:
            self._queue_backward_flush()

    def _queue_backward_flush(self) -> None:
        """Flush when the autograd engine finishes this pass, or now if no pass is running."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        except Exception:
            self.flush_backward()

    def end_backward(self) -> None:
        """Autograd-engine callback at the end of a backward pass: no hook is running now."""
        self._remove_leaf_hooks(only_fired=True)
        self.flush_backward()

    def flush_backward(self) -> None:
        """Transfer and emit every gradient measured since the last flush."""
        with self._backward_lock:
            pending, self._pending_backward = self._pending_backward, []
            self._backward_flush_queued = False
        if not pending:
            return
        try:
            records = self._finish(OUTPUT_GRADIENT, pending)
            with self._sink_lock:
                for record in records:
                    self.backward_sample_ids.add(record.sample_id)
                    self.sinks.write_backward(record)
        except Exception as error:
            self.warn_once("flush_backward", f"recording gradients failed: {error!r}")

    def _emit_forward(self, sample: _Sample) -> None:
        """One host transfer for the whole sampled forward, then one record to the sinks."""
        try:
            records = self._finish(OUTPUT, sample.pending)
            if not records:
                records = [SampleRecord(OUTPUT, sample.sample_id, sample.forward_index, ())]
            with self._sink_lock:
                for record in records:
                    self.sinks.write_forward(record)
        except Exception as error:
            self.warn_once("emit_forward", f"recording a sample failed: {error!r}")

    def _finish(self, signal: str, pending: list[_Pending]) -> list[SampleRecord]:
        """Transfer pending results to the host and turn them into one record per sample."""
        vectors: list[torch.Tensor | None] = []
        for item in pending:
            vectors.append(item.reduction.device_vector)
            vectors.append(item.histogram.device_vector if item.histogram is not None else None)
        host = to_host(vectors)
        by_sample: dict[int, tuple[int, list[Measurement], list[HistogramRecord]]] = {}
        for position, item in enumerate(pending):
            key = item.key
            _, measurements, histograms = by_sample.setdefault(
                key.sample_id, (key.forward_index, [], [])
            )
            measurements.append(self._measurement(item, host[2 * position]))
            if item.histogram is not None:
                histogram = item.histogram.finish(
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

    def _measurement(self, item: _Pending, host_values: list[float]) -> Measurement:
        """The host-side record of one measured tensor."""
        key = item.key
        return Measurement(
            sample_id=key.sample_id,
            forward_index=key.forward_index,
            timestamp_us=item.timestamp_us,
            rank=self.rank,
            layer=key.layer.name,
            module_type=key.layer.module_type,
            call_index=key.call_index,
            signal=key.signal,
            tensor_path=key.tensor_path,
            shape=item.shape,
            dtype=item.dtype,
            mode=key.mode,
            grad_enabled=key.grad_enabled,
            metrics=self.measurer.metrics,
            values=item.reduction.finish(host_values),
        )

    # -- shutdown -----------------------------------------------------------------------------

    def counts(self) -> RunCounts:
        """How many root forwards, samples and backward samples this observer saw."""
        return RunCounts(self.root_forwards, self.samples, len(self.backward_sample_ids))

    def close(self) -> None:
        """Make every proxy inert, emit outstanding gradients, and close the sinks (idempotent)."""
        if self.closed:
            return
        self.flush_backward()
        self._remove_leaf_hooks(only_fired=False)
        self.closed = True
        with self._sink_lock:
            self.sinks.close(self.counts())

    def _remove_leaf_hooks(self, only_fired: bool) -> None:
        """Remove hooks left on leaf tensors; runs when no backward is iterating over them."""
        keep = []
        for ref, handle, hook in self._leaf_hooks:
            if only_fired and not hook.fired:
                keep.append((ref, handle, hook))
            else:
                handle.remove()
        self._leaf_hooks = keep

    def warn_once(self, key: str, message: str) -> None:
        """Report a measurement failure once per kind; training goes on."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"torchinstruments: {message}", RuntimeWarning, stacklevel=3)
