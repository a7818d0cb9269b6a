"""Every private torch (and CPython) internal the library relies on, one adapter each.

torch does not promise any of these; a torch upgrade that moves one breaks here and nowhere else.
Each adapter says why it is needed and the torch version it was checked on. Nothing outside this
package (and `_tensorboard_internals` for TensorBoard) reads a private name of another library:
`tests/test_internals.py` fails on any `torch._*`, `._C.` or `._name` of another library
elsewhere in src. This module holds the nn.Module, autograd, tensor and torch.func adapters;
torch.compile's (dynamo's switches and frames) are in `_torch_internals.dynamo`, imported from
there by their users (this module re-exports none of them).

Checked on torch 2.15.0 (the locked version, whole suite) and torch 2.13.0 (the floor in
pyproject.toml: `.ci/floor` runs the smoke subset on it), both with CPython 3.11.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import torch
import torch.utils.checkpoint
import wrapt
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import _symbolic_trace
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "RunningFrame",
    "UserModesSuspended",
    "WeakIdKeyDictionary",
    "ambient_state_on",
    "called_through_module_call",
    "caller_of_code_is_module_call",
    "child_modules",
    "functorch_active",
    "functorch_disabled",
    "has_fused_fast_path",
    "hook_without_handle",
    "in_backward_pass",
    "in_compiled_autograd",
    "in_reentrant_checkpoint",
    "innermost_frame",
    "is_fake",
    "is_functorch_wrapped",
    "is_legacy_batched",
    "is_tracing",
    "is_view",
    "layer_by_layer",
    "outer_transform_hides_grad",
    "pickled_for_a_new_process",
    "queue_at_backward_end",
    "ran_by_a_backward",
    "references_counted_exactly",
    "registered_tensor_slots",
    "running",
    "tensor_hooks",
    "tensor_version",
    "unwrap_functorch",
]

# torch.utils.weak.WeakIdKeyDictionary (undocumented module, checked on 2.15.0, present since
# 2.0): a weak dictionary keyed by identity; a plain WeakKeyDictionary compares tensors with ==.

# --- nn.Module.__call__: which frames call `self.forward` ---------------------------------------


def _nested_codes(code: CodeType) -> Iterator[CodeType]:
    """`code` and the code of every function defined inside it, at any depth."""
    yield code
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            yield from _nested_codes(constant)


# Frames of nn.Module.__call__ that call `self.forward`; a proxy whose caller is not one of these
# was called directly (`module.forward(x)`). Read from torch, not from a global registry.
# Why: tells `model(x)` from `model.forward(x)`. `_call_impl` calls it itself on its fast path
# (no hooks), and from a function nested in it (`inner`) where the module or the process has
# hooks (a forward or backward hook, pruning's pre-hook): both frames are `__call__`'s. Checked
# on torch 2.15.0.
_MODULE_CALL_CODES: frozenset[CodeType] = frozenset(
    {*_nested_codes(nn.Module._call_impl.__code__), nn.Module._slow_forward.__code__}
)

# wrapt's pure-Python fallback (no C extension) adds frames of its own between caller and wrapper.
_WRAPT_DIRECTORY = os.path.dirname(wrapt.__file__)


def called_through_module_call(depth: int = 2) -> bool:
    """True when the proxy `depth` frames up (wrapt's own frames skipped) was called by
    `nn.Module.__call__`, False for a direct `module.forward(x)`.

    Relies on CPython frames (`sys._getframe`) and on the code objects of `nn.Module._call_impl`
    and `_slow_forward`, read from torch at import. Checked on torch 2.15.0.
    """
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_WRAPT_DIRECTORY):
        frame = frame.f_back
    return frame is not None and frame.f_code in _MODULE_CALL_CODES


def caller_of_code_is_module_call(code: CodeType) -> bool:
    """Whether the innermost frame of this thread running `code` was called by
    `nn.Module.__call__` (wrapt's frames skipped); False where none runs it.

    Why: with capture_direct_forwards=False, a root forward that reached the proxy through a
    forward rebuilt from its `__func__` (rebuilt_forwards.py: accelerate's mixed precision) has
    that forward's wrappers, not `nn.Module.__call__`, as the proxy's caller; `code` is the
    rebuilt forward's own, whose caller tells `model(x)` from `model.forward(x)`. Relies on
    CPython frames (`sys._getframe`), as `called_through_module_call`; checked on torch 2.15.0.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    frame = frame.f_back if frame is not None else None
    while frame is not None and frame.f_code.co_filename.startswith(_WRAPT_DIRECTORY):
        frame = frame.f_back
    return frame is not None and frame.f_code in _MODULE_CALL_CODES


def pickled_for_a_new_process() -> bool:
    """Whether the pickling under way is multiprocessing's, of a process being started with
    'spawn' or 'forkserver' (its arguments are unpickled in a fresh interpreter).

    Relies on CPython's `multiprocessing.context.get_spawning_popen`, set on this thread while
    such a start pickles the `Process` (undocumented; torch's own reductions read it too).
    Checked on CPython 3.11.
    """
    from multiprocessing import context  # imported by torch already; not at our import

    return context.get_spawning_popen() is not None


def child_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`(name, child)` for each direct child, read from `module._modules` as torch stores them.

    Why: `named_children()` skips a child registered twice and goes through `__getattr__`, which a
    compiled wrapper (OptimizedModule) forwards; walking the dict is what `named_modules()` does
    itself. Checked on torch 2.15.0.
    """
    for name, child in module._modules.items():
        if child is not None:
            yield name, child


def running(code: CodeType, owner: object) -> bool:
    """Whether this thread's stack holds a frame running `code` with `self` being `owner`,
    beyond the caller's caller (the frame asking, and the call it serves, are left out).

    Why: tells a call of the root inside its own forward from a sampled forward's end that a
    KeyboardInterrupt cut (interrupts.py); relies on CPython frames (`sys._getframe`), checked
    on Python 3.11 to 3.13.
    """
    frame = sys._getframe(3)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is owner:
            return True
        frame = frame.f_back
    return False


def innermost_frame(thread_id: int | None) -> FrameType | None:
    """The innermost Python frame the thread `thread_id` runs now (None: none, or no thread).

    Why: the SIGTERM watcher (rundir/term_watch.py) tells a main thread that runs Python from
    one blocked in native code by whether this frame, or its last instruction, moves; relies on
    CPython's `sys._current_frames` (documented in `sys` as an implementation detail), which
    returns the same frame object while that frame runs. Checked on CPython 3.11.
    """
    return None if thread_id is None else sys._current_frames().get(thread_id)


class _FrameToken:
    """Kept among a watched frame's locals alone: it lives as long as that frame object."""


# The name a `RunningFrame` keeps its token under in the frame's locals (no code reads it).
_TOKEN = "__torchinstruments_running_frame__"


class RunningFrame:
    """A running frame, watched without being kept alive: whether it still runs (`on_stack`),
    and whether a frame is it (`is_frame`).

    Why: the Hugging Face Trainer tells its callbacks nothing when `train()` raises outside a
    training step, so the callback tells its fit's end by its `train()` frame having left the
    stack (integrations/huggingface.py). Kept, that frame kept its locals and its callers'
    (the Trainer and its optimizer, a batch, the caller's tensors) alive after the exception
    was handled, until the model's next use. A frame takes no weak reference, so a token is
    put among its locals (`frame.f_locals`, which CPython keeps with the frame object: a dict
    on 3.11 and 3.12, the extra locals of its proxy from 3.13) and watched weakly: while it
    lives, the frame object does, and its `id` names it alone. Relies on CPython frames (one
    frame object per running frame). Checked on CPython 3.11.
    """

    def __init__(self, frame: FrameType, thread_id: int) -> None:
        token = _FrameToken()
        self._token: Callable[[], object] = weakref.ref(token)
        try:
            frame.f_locals[_TOKEN] = token
        except Exception:  # an interpreter whose frames take no new local: the frame is kept
            self._token = lambda: frame
        self._id = id(frame)
        self.thread_id = thread_id

    def is_frame(self, frame: FrameType) -> bool:
        """Whether `frame` is the watched frame (never a later one at its address)."""
        if id(frame) != self._id:
            return False
        token = self._token()
        return token is frame or (token is not None and frame.f_locals.get(_TOKEN) is token)

    def on_stack(self) -> bool:
        """Whether the watched frame still runs: on the stack of its thread, now."""
        if self._token() is None:  # the frame object is gone: it ran out long ago
            return False
        here = self.thread_id == threading.get_ident()
        current = sys._getframe(1) if here else innermost_frame(self.thread_id)
        while current is not None:
            if self.is_frame(current):
                return True
            current = current.f_back
        return False


def references_counted_exactly() -> bool:
    """Whether this interpreter counts every reference to an object at once (a GIL build).

    Why: gradient_hooks.py reuses a gradient hook only when `sys.getrefcount` says nothing but
    its own list holds it; a free-threaded build counts some references lazily, so a count
    could say no one holds a hook that a graph does. Relies on CPython's
    `sys._is_gil_enabled` (3.13 and later; earlier interpreters always have the GIL).
    """
    return bool(getattr(sys, "_is_gil_enabled", lambda: True)())


def registered_tensor_slots(module: nn.Module) -> Iterator[str]:
    """The names of `module`'s own parameters and buffers, those registered as None included,
    read from `module._parameters` and `module._buffers` as torch stores them.

    Why: `named_parameters()` and `named_buffers()` skip a slot registered as None
    (`nn.MultiheadAttention(bias=False)` registers `out_proj.bias` so), yet the module holds it:
    its owner reads `out_proj.bias` (None) and never calls it. Checked on torch 2.15.0.
    """
    yield from module._parameters
    yield from module._buffers


# --- nn.TransformerEncoderLayer's fused fast path -----------------------------------------------

# nn.TransformerEncoderLayer runs as one fused kernel in eval under no_grad, calling none of its
# submodules, unless one of its fast-path conditions fails (it also checks for module hooks, which
# is how a hook user sees the inner layers). This integer attribute (1 relu, 2 gelu, 0 other
# activation) is one of those conditions, read only by that check and by the fused call; the
# layer-by-layer path uses `self.activation` instead. Checked on torch 2.15.0.
_FUSED_SWITCH = "activation_relu_or_gelu"


def has_fused_fast_path(module: nn.Module) -> bool:
    """True for a module that may skip its submodules with a fused kernel in eval."""
    return isinstance(module, nn.TransformerEncoderLayer) and isinstance(
        module.__dict__.get(_FUSED_SWITCH), int
    )


@contextlib.contextmanager
def layer_by_layer(module: nn.Module) -> Iterator[None]:
    """Run `module` (see `has_fused_fast_path`) on its layer-by-layer path for this call only.

    The layer then computes exactly what it computes with a hook attached, and its submodules'
    forwards run. Only the layer's own fused kernel is avoided: nn.MultiheadAttention inside keeps
    its own fast path, and nn.TransformerEncoder still packs padded batches as nested tensors.
    The switch is an attribute of the module, set for the duration of this call: another thread
    running the same module object at that moment also takes the layer-by-layer path (the same
    values up to floating-point rounding). It is restored even if the forward raises.
    """
    saved = module.__dict__[_FUSED_SWITCH]
    module.__dict__[_FUSED_SWITCH] = 0
    try:
        yield
    finally:
        module.__dict__[_FUSED_SWITCH] = saved


# --- tracing flags and the autograd engine -------------------------------------------------------

# torch.fx symbolic tracing; `is_fx_tracing` (older torch) also logs a warning in newer releases.
# Why: a traced call is not a training step. Checked on torch 2.15.0 (`is_fx_symbolic_tracing`).
_is_fx_tracing: Callable[[], bool] = getattr(
    _symbolic_trace, "is_fx_symbolic_tracing", _symbolic_trace.is_fx_tracing
)


def is_tracing() -> bool:
    """True while torch.jit.trace, torch.compile or torch.fx is tracing the model.

    Such a call is not a training step: it passes through untouched, so no measurement op ends
    up in a traced program and nothing is counted.
    """
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or _is_fx_tracing()


def queue_at_backward_end(callback: Callable[[], None]) -> bool:
    """Run `callback` when the autograd engine finishes the backward pass now running.

    Uses the engine's private `queue_callback` (why: one host transfer per backward pass; checked
    on torch 2.15.0); returns False (queuing nothing) when no backward pass is running or the
    engine refuses, so the caller can run the work itself.
    """
    if in_compiled_autograd():
        return False
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
    except Exception:
        return False
    return True


def in_compiled_autograd() -> bool:
    """Whether compiled autograd runs a backward graph now (`torch._dynamo.config.
    compiled_autograd`, a backward inside a compiled function).

    Why: the engine accepts a callback queued from a hook that graph calls, but never runs it
    (compiled autograd ends the pass without the engine's final callbacks). Read from
    `torch._dynamo.compiled_autograd.in_compiled_autograd_region`, set while its graph runs, only
    where that module is imported already (importing torch._dynamo takes seconds). Checked on
    torch 2.15.0.
    """
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(getattr(module, "in_compiled_autograd_region", False))


def in_backward_pass() -> bool:
    """Whether this thread runs inside a backward pass of the autograd engine now.

    Uses the private `torch._C._current_graph_task_id` (-1 outside any pass; checked on torch
    2.15.0). Why: a pass that raised never runs the callback `queue_at_backward_end` queued, and
    outside every pass such a callback can no longer come. Where the name is missing, True:
    nothing is taken for ended.
    """
    return _GRAPH_TASK_ID is None or _GRAPH_TASK_ID() != -1


# Read once, for `in_backward_pass` and `ran_by_a_backward` (this one runs at every root forward).
_GRAPH_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def ran_by_a_backward() -> bool:
    """Whether the autograd engine runs a backward pass on this thread now, so that a forward
    called here is called by it (activation checkpointing recomputing what it did not keep).

    The same private `torch._C._current_graph_task_id` as `in_backward_pass` (checked on torch
    2.15.0). Why: such a call is torch's, not a forward of the user's. Where the name
    is missing, False: every call is then taken for the user's, as before.
    """
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


# Reentrant checkpointing's forward (`torch.utils.checkpoint.CheckpointFunction`, in that
# module's __all__), read once for `in_reentrant_checkpoint`.
_REENTRANT_CHECKPOINT: CodeType | None = getattr(
    getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None),
    "__code__",
    None,
)


def in_reentrant_checkpoint() -> bool:
    """Whether reentrant activation checkpointing's forward (`checkpoint(..., use_reentrant=True)`)
    is on this thread's stack: it runs the checkpointed function under torch.no_grad().

    Why: a root forward it runs is a training forward whose backward flows through the
    recomputation, not an evaluation forward under the caller's no_grad (phases.py). Relies on
    CPython frames (`sys._getframe`) and on `CheckpointFunction.forward`'s code object; checked
    on torch 2.15.0. Where that is missing, False: every no_grad is then taken for the caller's.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_CHECKPOINT:
            return True
        frame = frame.f_back
    return False


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter (`Tensor._version`).

    Why: tells whether a custom reducer modified the tensor it was given, or a later in-place
    op a view a layer returned (gradients.py), without comparing values. Checked on torch 2.15.0.
    """
    return tensor._version


def is_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view of another (`Tensor._is_view`): an in-place op on it or its
    base gives it a new autograd node, so the node a layer returned leaves the graph
    (gradients.py). Checked on torch 2.15.0."""
    return tensor._is_view()


def hook_without_handle(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> bool:
    """`tensor.register_hook(hook)` without the handle it returns, where `tensor` is a plain
    tensor with an autograd node and no torch function mode is active; False (nothing done)
    elsewhere: a leaf, whose hook must be removable, a subclass or a mode, which dispatch
    `register_hook` themselves. The hook stays until the tensor dies, as a non-leaf's does.

    Why: the handle (a `RemovableHandle` and its weak reference) is 1.6 us of `register_hook`'s
    2.3, paid by every hooked output of a sampled step (3,000 on a 3,000-layer model), and
    gradients.py never removes a non-leaf's hook. These are `register_hook`'s own steps (the
    node read first, which refreshes a stale view's; `Tensor._backward_hooks`, which the node
    reads through `_register_hook_dict`), the hook keyed by its id instead of the handle's
    (unique while the dict holds the hook). Checked on torch 2.15.0; the same steps since 1.x.
    """
    if type(tensor) is not torch.Tensor or torch._C._has_torch_function_unary(tensor):
        return False
    node = tensor.grad_fn
    if node is None:
        return False
    hooks = tensor._backward_hooks
    if hooks is None:
        hooks = tensor._backward_hooks = OrderedDict()
        node._register_hook_dict(tensor)
    hooks[id(hook)] = hook
    return True


def tensor_hooks(tensor: torch.Tensor) -> Iterator[object]:
    """The hooks `Tensor.register_hook` put on `tensor` and that are still registered, oldest
    first (`Tensor._backward_hooks`, the dict `register_hook` writes and its handle's `remove`
    deletes from; None until the first hook).

    Why: gradients.py finds its own unfired hook on a tensor returned again (a shared output)
    where it is, on the tensor, instead of keeping a weak dictionary entry (two more objects for
    the garbage collector) per sampled output. Checked on torch 2.15.0 and 2.13.0.
    """
    hooks = tensor._backward_hooks
    if hooks:
        yield from hooks.values()


# --- torch.func: the tensors its transforms wrap -------------------------------------------------

# torch.func (functorch) hands a layer wrapper tensors with no storage of their own: under `grad`
# and `jacrev` one wrapper per level (GradTrackingTensor), under `vmap` a BatchedTensor whose
# unwrapped value carries the batch dimension. The library measures the unwrapped value: what the
# plain model computes (for `vmap`, the whole batch). No public API unwraps them. Checked on torch
# 2.15.0 (`torch._C._functorch`, present since 2.0).
#
# torch.autograd's own vmap (`torch._vmap_internals`, older than torch.func) batches the
# cotangents of `torch.autograd.grad(..., is_grads_batched=True)`, which
# `torch.autograd.functional.jacobian`/`hessian(vectorize=True)` use: the gradient hooks of such
# a pass get a legacy batched tensor, which no op of the statistics can read. Its batch is
# unwrapped the same way, at the innermost legacy vmap level (`torch._remove_batch_dim` moves
# the batch dimension first). Checked on torch 2.15.0.


def unwrap_functorch(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The plain tensor under every torch.func wrapper of `tensor`, and the sizes of the vmapped
    dimensions met on the way (outermost transform first; empty outside `vmap`); a legacy batched
    tensor (see above) gives its batch at the innermost level of torch.autograd's vmap."""
    functorch = torch._C._functorch
    batch: list[int] = []
    while functorch.is_functorch_wrapped_tensor(tensor):
        if functorch.is_batchedtensor(tensor):
            level_value = functorch.get_unwrapped(tensor)
            batch.append(int(level_value.shape[functorch.maybe_get_bdim(tensor)]))
            tensor = level_value
        else:
            tensor = functorch.get_unwrapped(tensor)
    if is_legacy_batched(tensor):
        # 1: the size it would expand a tensor not batched at this level to (batched only at an
        # outer one, nested passes: left batched, so its rows are null with the error's reason).
        level_value = torch._remove_batch_dim(tensor, _legacy_vmap_level(), 1, 0)
        batch.append(level_value.shape[0])
        tensor = level_value
    return tensor, tuple(reversed(batch))


def _legacy_vmap_level() -> int:
    """The innermost level of torch.autograd's vmap now running (0: none): the nesting count,
    which only its increment returns."""
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()
    return level - 1


def functorch_active() -> bool:
    """Whether a torch.func transform is running (`maybe_current_level` is None outside every
    one). Checked on torch 2.15.0."""
    return torch._C._functorch.maybe_current_level() is not None


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a torch.func wrapper, or batched by torch.autograd's vmap (see
    `unwrap_functorch`). Checked on 2.15.0."""
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor) or is_legacy_batched(tensor)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a FakeTensor (FakeTensorMode's: a shape, a dtype and a device, no
    values; it refuses ops with real tensors, so measuring it fails). Checked on torch 2.15.0."""
    return type(tensor) is not torch.Tensor and isinstance(tensor, FakeTensor)


def outer_transform_hides_grad(tensor: torch.Tensor) -> str | None:
    """The torch.func transform whose wrapper hides that `tensor`'s value requires grad, or None.

    Under `vmap` (a BatchedTensor) and `jvp`/`jacfwd` the wrapper a layer returns reports
    `requires_grad=False` and refuses a hook, though the plain value under it requires grad: a
    backward outside the transform sends gradients into that value, where no hook on the
    layer's output can see them. Checked on torch 2.15.0."""
    functorch = torch._C._functorch
    if tensor.requires_grad or not functorch.is_functorch_wrapped_tensor(tensor):
        return None
    if not unwrap_functorch(tensor)[0].requires_grad:
        return None
    return "vmap" if functorch.is_batchedtensor(tensor) else "jvp or jacfwd"


def is_legacy_batched(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is batched by torch.autograd's vmap (see `unwrap_functorch`). Checked on
    2.15.0."""
    return torch._C._functorch.is_legacy_batchedtensor(tensor)


def functorch_disabled() -> contextlib.AbstractContextManager[Any]:
    """A context in which torch ops on plain tensors run as outside every torch.func transform,
    so the statistics of an unwrapped value are plain tensors (not wrapped again at the current
    level) that NumPy and `.tolist()` can read. Checked on torch 2.15.0 (`torch._C`)."""
    return torch._C._DisableFuncTorch()


# --- the user's torch function and dispatch modes, set aside while the library measures --------


_ANY_AUTOCAST = torch._C._is_any_autocast_enabled
_FUNCTION_MODES = torch._C._len_torch_function_stack
_DISPATCH_MODES = torch._C._len_torch_dispatch_stack


def ambient_state_on() -> bool:
    """Whether autocast is on for any device type, or a torch function or Python dispatch mode
    (infra ones too) is on this thread's stacks: three flag reads per sampled layer call, where
    `torch.is_autocast_enabled` per device type took longer than the whole of this. Checked on
    torch 2.15.0 (`torch._C`)."""
    return bool(_ANY_AUTOCAST() or _FUNCTION_MODES() or _DISPATCH_MODES())


class UserModesSuspended:
    """Every torch function mode and every user Python dispatch mode taken off this thread's
    stacks for the block, and put back as they were at its end.

    Why: the library's reads of a sampled tensor (its hook, its statistics, the host transfer)
    are not the model's ops; a user's mode that counts, logs or refuses ops saw them, or made
    them fail. torch has no public way to step outside the active modes. Dispatch modes torch
    marks as infrastructure (fake, proxy and functional tensors' modes) stay: tensors made under
    them cannot be read without them. The
    stacks are popped top first and pushed back in the reverse order, as `torch.overrides.
    _pop_mode_temporarily` and `torch.utils._python_dispatch._disable_current_modes` do (the
    user stack pops before the infra slots). Never raises: where a mode cannot be taken off,
    every one is left on. Checked on torch 2.15.0."""

    def __enter__(self) -> None:
        self._functions: list[Any] = []
        self._dispatch: list[Any] = []
        try:
            for _ in range(torch._C._len_torch_function_stack()):
                self._functions.append(torch._C._pop_torch_function_stack())
            stack = torch._C._len_torch_dispatch_stack()
            at = torch._C._get_dispatch_stack_at
            for _ in range(sum(not at(i).is_infra_mode() for i in range(stack))):
                mode = torch._C._pop_torch_dispatch_stack(None)
                if mode.is_infra_mode():  # not a user's: back where it was, nothing further
                    torch._C._push_on_torch_dispatch_stack(mode)
                    break
                self._dispatch.append(mode)
        except Exception:  # what was taken off goes back, and the block runs under the modes
            self.__exit__()
            self._functions, self._dispatch = [], []

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._dispatch):
            torch._C._push_on_torch_dispatch_stack(mode)
        for mode in reversed(self._functions):
            torch._C._push_on_torch_function_stack(mode)
