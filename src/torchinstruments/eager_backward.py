"""The backward pass of a sampled forward runs with torch.compile off, as that forward did.

A sampled forward runs eagerly (`compilation.call_eagerly`): compiled modules nested in the model
(`block.compile()`, `torch.compile(block)`) run their eager code. Activation checkpointing runs
part of a forward again during the backward pass: with `use_reentrant=False` it recomputes the
tensors the region saved and checks them against those of the forward, with
`use_reentrant=True` it runs the region again and differentiates that run. After a sampled
forward, torch.compile is on again, so a compiled region inside a checkpoint would be
recomputed by its compiled graph: the non-reentrant check then fails the user's backward with a
`CheckpointError` ("Recomputed values ... have different metadata"; a compiled graph saves other
tensors than eager code), and the reentrant one differentiates another computation (another
dropout mask) than the forward ran, silently. Without the observer both run the compiled graph.

Design decision: a gradient hook on each tensor a sampled forward returns (it returns None and
never alters a gradient) turns torch.compile off, with the same process-wide stance as the
sampled forward (`compilation.force_eager`), when the backward pass first reaches the model's
outputs: before any node inside the model runs, and so before any recomputation. The engine's
end-of-pass callback turns it back on. Where no callback can be queued (compiled autograd,
which traces the hooks into its graph), nothing is changed. A backward pass that raised never
runs its callback: the next root forward, sampled or not, or the observer's removal (a
trainer's callback removes it after a fit that raised) turns the stance back on, so a process
never stays eager past that. A gradient that enters the model other than through its outputs (a
loss kept on a module attribute) is not seen here; its recomputation stays compiled, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from torchinstruments._torch_internals import (
    WeakIdKeyDictionary,
    in_compiled_autograd,
    queue_at_backward_end,
)
from torchinstruments._torch_internals.dynamo import opaque_to_compilation
from torchinstruments.ambient import apart
from torchinstruments.outputs import iter_tensors

__all__ = ["hold_eager_for_backward", "release_held_backwards"]

# The one piece of process-wide state here: the hooks holding the eager stance now, so that the
# next root forward (or removal) ends a hold whose backward raised (the engine then runs no
# callback). Held strongly: a weak set lost a hook whose tensors were freed after the failed pass,
# and with it the only way to end its hold, leaving the whole process eager.
_HOLDING: set[_EagerBackward] = set()
_HOLDING_LOCK = threading.Lock()
# Tensors hooked so far: one a model returns again (a cached tensor) is hooked once, not once per
# sampled forward (any hook here does the same for every forward).
_HOOKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _EagerBackward:
    """The hook on one sampled forward's outputs: eager from the first gradient into them to
    the end of that backward pass."""

    def __init__(self, enter: Callable[[], None], exit_: Callable[[], None]) -> None:
        self._enter, self._exit = enter, exit_
        self._held = False

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is None or in_compiled_autograd():
            return None
        with _HOLDING_LOCK:
            if self._held:  # another output of the same forward, in the same pass
                return None
            self._held = True
            _HOLDING.add(self)
        try:
            self._enter()
        except Exception:  # never fail the user's backward: it stays as it was without this
            with _HOLDING_LOCK:
                self._held = False
                _HOLDING.discard(self)
            return None
        if not queue_at_backward_end(self.release):
            self.release()
        return None

    def release(self) -> None:
        """End the hold (at the end of the backward pass, or at the next root forward)."""
        with _HOLDING_LOCK:
            if not self._held:
                return
            self._held = False
            _HOLDING.discard(self)
        self._exit()


def hold_eager_for_backward(
    output: Any, enter: Callable[[], None], exit_: Callable[[], None]
) -> None:
    """Hook the tensors of a sampled forward's `output` that require grad (module docstring);
    `enter` / `exit_` turn torch.compile off and on again."""
    hook: _EagerBackward | None = None
    with apart():  # the user's autocast and modes set aside (ambient.py)
        for _, tensor in iter_tensors(output):
            if tensor.requires_grad and tensor.grad_fn is not None and tensor not in _HOOKED:
                hook = hook or _EagerBackward(enter, exit_)
                tensor.register_hook(hook)
                _HOOKED[tensor] = None


def release_held_backwards() -> None:
    """At a root forward and at removal: end every hold left by a backward pass that raised."""
    if not _HOLDING:
        return
    with _HOLDING_LOCK:
        held = list(_HOLDING)
    for hook in held:
        hook.release()


# Called by the autograd engine, also while a compiled function's backward runs outside its
# graph (a torch.func transform that runs eagerly inside a compiled step): dynamo would compile
# the hook's frame there, with the transform's wrapped gradient as an input it cannot fake
# (an AssertionError in the user's backward), and its end would be a graph of its own.
opaque_to_compilation(_EagerBackward.__call__)
opaque_to_compilation(_EagerBackward.release)
