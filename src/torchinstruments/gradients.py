"""Gradients into sampled outputs: tensor hooks, one transfer per backward pass, leaf bookkeeping.

Design decision: the only hook the library uses is `Tensor.register_hook` on each sampled output
that requires grad. The hook launches the gradient's reductions on its device as the gradient
arrives (it never alters the gradient: it returns None), and the first hook of a backward pass
queues one autograd-engine callback (`capture.queue_at_backward_end`) that transfers all of that
pass's results at once when the pass ends. Outside a running backward pass (a hook fired by
`torch.autograd.grad` on a finished engine, say), the results are transferred at once.

A hook on a non-leaf output dies with the graph. A leaf output (a parameter or an input returned
as is) outlives it, so hooks on leaves are tracked: at most one unfired hook of ours stays on a
leaf, fired ones are removed at the end of their backward pass, and the rest at close.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.utils.hooks import RemovableHandle

from torchinstruments.capture import queue_at_backward_end
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.measurement.transfer import PendingTensor, build_records, launch_tensor
from torchinstruments.records import OUTPUT_GRADIENT, SampleRecord, TensorKey

Emit = Callable[[SampleRecord], None]
WarnOnce = Callable[[str, str], None]


class _GradientHook:
    """`Tensor.register_hook` callback: records the first gradient into one sampled output."""

    __slots__ = ("fired", "focus", "key", "recorder")

    def __init__(self, recorder: GradientRecorder, key: TensorKey, focus: bool) -> None:
        self.recorder = recorder
        self.key = key
        self.focus = focus
        self.fired = False

    def __call__(self, grad: torch.Tensor) -> None:
        if not self.fired and not self.recorder.closed:
            self.fired = True
            try:
                self.recorder.launch_gradient(self.key, grad, self.focus)
            except Exception as error:  # never break the user's backward
                self.recorder.warn_once("gradient", f"recording a gradient failed: {error!r}")
        return None


class GradientRecorder:
    """Records the gradients into the sampled outputs of one observer.

    Args:
        measurer: the observer's reducers.
        rank: written into every record.
        emit: hands one finished `SampleRecord` to the sinks.
        warn_once: reports a failure once per kind; training goes on.
    """

    def __init__(
        self, measurer: Measurer, rank: int | None, emit: Emit, warn_once: WarnOnce
    ) -> None:
        self._measurer = measurer
        self._rank = rank
        self._emit = emit
        self.warn_once = warn_once
        self.closed = False
        self.sample_ids: set[int] = set()
        self._lock = threading.Lock()
        self._pending: list[PendingTensor] = []
        self._flush_queued = False
        self._leaf_hooks: list[
            tuple[weakref.ref[torch.Tensor], RemovableHandle, _GradientHook]
        ] = []

    def hook_output(self, key: TensorKey, tensor: torch.Tensor, focus: bool) -> None:
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

    def launch_gradient(self, key: TensorKey, grad: torch.Tensor, focus: bool) -> None:
        """Launch the reductions of one gradient; transferred when the backward pass ends."""
        pending = launch_tensor(self._measurer, replace(key, signal=OUTPUT_GRADIENT), grad, focus)
        with self._lock:
            self._pending.append(pending)
            queue = not self._flush_queued
            self._flush_queued = True
        if queue and not queue_at_backward_end(self._end_backward):
            self.flush()

    def flush(self) -> None:
        """Transfer and emit every gradient launched since the last flush."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._flush_queued = False
        if not pending:
            return
        try:
            for record in build_records(
                OUTPUT_GRADIENT, pending, self._measurer.metrics, self._rank
            ):
                self.sample_ids.add(record.sample_id)
                self._emit(record)
        except Exception as error:
            self.warn_once("flush_backward", f"recording gradients failed: {error!r}")

    def close(self) -> None:
        """Emit outstanding gradients, remove every hook left on a leaf, and stop recording."""
        if self.closed:
            return
        self.flush()
        self._remove_leaf_hooks(only_fired=False)
        self.closed = True

    def _end_backward(self) -> None:
        """Autograd-engine callback at the end of a backward pass: no hook is running now."""
        self._remove_leaf_hooks(only_fired=True)
        self.flush()

    def _track_leaf_hook(
        self, tensor: torch.Tensor, handle: RemovableHandle, hook: _GradientHook
    ) -> None:
        """Keep at most one unfired hook of ours on a leaf; older unfired ones are removed."""
        kept = []
        for ref, old_handle, old_hook in self._leaf_hooks:
            if ref() is tensor and not old_hook.fired:
                old_handle.remove()
            else:
                kept.append((ref, old_handle, old_hook))
        kept.append((weakref.ref(tensor), handle, hook))
        self._leaf_hooks = kept

    def _remove_leaf_hooks(self, only_fired: bool) -> None:
        """Remove hooks left on leaf tensors; runs when no backward is iterating over them."""
        keep = []
        for ref, handle, hook in self._leaf_hooks:
            if only_fired and not hook.fired:
                keep.append((ref, handle, hook))
            else:
                handle.remove()
        self._leaf_hooks = keep
