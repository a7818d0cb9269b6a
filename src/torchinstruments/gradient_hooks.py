"""The gradient hook of one sampled output, and the hooks each series keeps for its next samples.

A hook is also the key of the output's own rows (`GradientHook` is a `TensorKey`): whatever
lives from a sampled forward into its backward is promoted to the collector's oldest generation,
whose full collections a 3,000-layer sampled step pays for, so one object per hooked output,
not a key and a hook. And that object is made once per series (a layer's call and tensor_path),
not once per sample: `HookSlots` keeps the hooks it made and arms one again for the series' next
sample once nothing but itself holds it. An object that nothing else references cannot be seen
changing: no tensor's hook dict holds it (its graph is gone, so no backward can call it), no
pass's list of launched tensors holds it as a key (its rows are built), and no caller kept it.
CPython counts those references exactly (`sys.getrefcount`), so the test is the very condition
that makes reuse safe; a hook still held anywhere is left alone and the sample gets a new one.
Two per series, so that an ordinary loop, which holds the last step's loss (and graph) while
it runs the next forward, alternates between them.

A sample's `Awaited` is alive while one of its hooks is (gradients.py relies on it): a kept hook
that nobody else holds lets go of its sample's `Awaited` before the recorder asks
(`HookSlots.let_go`), so that only hooks that can still fire, or whose rows wait, keep it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

import torch

from torchinstruments._torch_internals import references_counted_exactly
from torchinstruments.ambient import apart
from torchinstruments.notices import shown
from torchinstruments.records import LayerInfo, TensorKey

__all__ = ["SLOTS_PER_SERIES", "Awaited", "GradientHook", "HookSlots", "Recorder"]

SLOTS_PER_SERIES = 2
# A free-threaded build counts some references lazily, so a count could say no one holds a hook
# that a graph does: there, no hook is kept.
_KEPT = SLOTS_PER_SERIES if references_counted_exactly() else 0


def _references(slots: list[GradientHook], index: int) -> int:
    """The references to `slots[index]` (`sys.getrefcount`, the one read counted too)."""
    return sys.getrefcount(slots[index])


# What `_references` reads of an object that only its list holds, measured here rather than
# assumed: how an interpreter counts the references of its own stack varies by version.
_ALONE = _references([object()], 0)  # type: ignore[list-item]


class Awaited:
    """The gradients one sample awaits: how many of its outputs were hooked, how many of those
    hooks fired. Held by the sample's hooks, weakly by the recorder (gradients.py)."""

    __slots__ = (
        "__weakref__", "fired", "forward_index", "hooked", "mode", "raised", "sample_id", "step",
    )  # fmt: skip

    def __init__(self, key: TensorKey) -> None:
        self.sample_id = key.sample_id
        self.forward_index = key.forward_index
        self.step = key.step
        self.mode = key.mode
        self.hooked = 0
        self.fired = 0
        self.raised = False  # its root forward raised: marked, and no loss awaits its outputs


# What a kept hook holds once it let go of its sample's `Awaited` (no sample's).
_NO_SAMPLE = Awaited(TensorKey(-1, -1, LayerInfo("", ""), -1, "", "", "", False))


class Recorder(Protocol):
    """What a hook calls: gradients.GradientRecorder."""

    closed: bool

    @property
    def warn_once(self) -> Callable[[str, str], None]: ...
    def launch_gradient(self, hook: GradientHook, grad: torch.Tensor) -> None: ...
    def cut_in_hook(self, awaited: Awaited) -> None: ...


# Not a dataclass itself, so its own __slots__ are allowed (the checker reads it as one).
class GradientHook(TensorKey):  # type: ignore[bad-class-definition]
    """`Tensor.register_hook` callback: records the first gradient into one sampled output
    (or, for a tensor several sampled calls returned, a null row per call), and the key of the
    first call that returned the tensor. Further calls of a shared output are a list made only
    then."""

    __slots__ = ("awaited", "fired", "focus", "more", "node", "recorder")

    def __init__(
        self, recorder: Recorder, key: TensorKey, focus: bool, node: int | None, awaited: Awaited
    ) -> None:
        self.recorder = recorder
        self.arm(key, focus, node, awaited)

    def arm(self, key: TensorKey, focus: bool, node: int | None, awaited: Awaited) -> None:
        """Make this hook `key`'s, unfired, for the tensor whose autograd node has id `node`."""
        self.sample_id, self.forward_index, self.layer = key.sample_id, key.forward_index, key.layer
        self.call_index, self.signal, self.tensor_path = key.call_index, key.signal, key.tensor_path
        self.mode, self.grad_enabled, self.step = key.mode, key.grad_enabled, key.step
        self.focus = focus
        self.more: list[tuple[TensorKey, bool]] | None = None  # later calls, same tensor
        self.fired = False
        # The id of the tensor's autograd node when it was hooked (None for a leaf): not the
        # node itself, which would make a reference cycle through the node's hook dict.
        self.node = node
        self.awaited = awaited  # keeps the sample's `Awaited` alive while this hook lives
        awaited.hooked += 1

    @property
    def calls(self) -> list[tuple[TensorKey, bool]]:
        """Every sampled call that returned the hooked tensor with this node, in order."""
        return [(self, self.focus), *(self.more or ())]

    def add_call(self, key: TensorKey, focus: bool) -> None:
        """The same tensor, with the same autograd node, returned by one more sampled call."""
        if self.more is None:
            self.more = []
        self.more.append((key, focus))

    def __call__(self, grad: torch.Tensor | None) -> None:
        # None: the pass reached the output's autograd node through another of its outputs only
        # (`split`'s or a custom Function's piece the loss never used): no gradient arrived, so
        # the hook waits for a pass that brings one.
        if grad is not None and not self.fired and not self.recorder.closed:
            self.fired = True
            try:
                with apart():  # the user's autocast and modes set aside (ambient.py)
                    self.recorder.launch_gradient(self, grad)
            except Exception as error:  # never break the user's backward
                self.recorder.warn_once(
                    "gradient",
                    f"recording a gradient failed: {shown(error)}; that gradient of sample "
                    f"{self.sample_id} has no rows",
                )
            except BaseException:  # a Ctrl-C landed here: the pass raises, this sample is cut
                self.recorder.cut_in_hook(self.awaited)
                raise
        return None


class HookSlots:
    """The hooks each series (a layer's name, or its name, call_index and tensor_path) made,
    `SLOTS_PER_SERIES` at most, armed again once nothing but this holds them (module
    docstring). The caller serializes `take` and `let_go` (gradients.py holds its lock)."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._slots: dict[object, list[GradientHook]] = {}

    def take(
        self, series: object, key: TensorKey, focus: bool, node: int | None, awaited: Awaited
    ) -> GradientHook:
        """A hook armed for `key`: one of the series' that nothing else holds, else a new one
        (kept for the series' next samples while it has fewer than `SLOTS_PER_SERIES`)."""
        slots = self._slots.get(series)
        if slots is None:
            slots = self._slots[series] = []
        for index in range(len(slots)):
            if _references(slots, index) <= _ALONE:
                slots[index].arm(key, focus, node, awaited)
                return slots[index]
        hook = GradientHook(self._recorder, key, focus, node, awaited)
        if len(slots) < _KEPT:
            slots.append(hook)
        return hook

    def let_go(self) -> None:
        """Every kept hook that nothing else holds lets go of its sample's `Awaited`."""
        for slots in self._slots.values():
            for index in range(len(slots)):
                if _references(slots, index) <= _ALONE:
                    slots[index].awaited = _NO_SAMPLE

    def clear(self) -> None:
        """Forget every kept hook (the recorder is closed)."""
        self._slots.clear()
