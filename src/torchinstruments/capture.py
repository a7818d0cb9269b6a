"""Forward proxies: how calls are intercepted without hooks, and how they are undone.

Each selected module gets its *instance* attribute `forward` replaced by a `wrapt.FunctionWrapper`
around the bound forward it had. `nn.Module.__call__` looks `self.forward` up on the instance, so
`module(x)` reaches the proxy, and a direct `module.forward(x)` reaches it natively. Module hooks
are not used: any hook pushes `nn.Module.__call__` off its fast path (about 1 µs per call here),
while an instance `forward` keeps it on it.

Between root forwards only the root carries a proxy; the selected layers get theirs when a
sampled root forward starts and lose them when it ends (observer.py), so an unsampled forward
costs one Python call at the root and nothing per layer, and compiled code (below) never meets
a layer proxy. During a sampled forward the layer proxies are built with
`enabled=<list>.__len__`: another thread's unsampled forward passing through them stays in
wrapt's C code (about 20 ns per call here; see bench/overhead.py).

Removal restores the instance `__dict__` exactly: the key is deleted where there was none, the
previous object is put back by identity where there was one, and a proxy someone else replaced or
wrapped after injection is left in place (the observer is closed, so it is inert for good).

Private torch internals: everything the interception relies on that torch does not promise (the
caller-frame check against `nn.Module._call_impl`, fx's symbolic-tracing flag, the autograd engine's
`queue_callback`, the switch that keeps `nn.TransformerEncoderLayer` off its fused kernel,
dynamo's frame-evaluation switches, the OptimizedModule wrapper) lives in this module, one
function each, so a torch upgrade that moves one of them breaks in one place.

torch.compile: dynamo compiles the frames a compiled call enters. The root proxy's wrapper is
excluded from that (`exclude_from_compilation`: its frame runs as plain Python, the frames it
calls are still compiled), and it pauses compilation while it does its own bookkeeping, so the
sampling decision is taken in Python at every root forward and an unsampled forward then enters
the compiled code exactly as the plain model does. Layer proxies exist only while a sampled
forward runs (observer.py), and a sampled forward runs with torch.compile off (`call_eagerly`):
compiled code never sees a proxy, so it has the graphs, breaks and guards of the plain model.

Copies: `copy.deepcopy` and `pickle`/`torch.save` of an observed model give a plain, unobserved
model. The proxy reduces to what was there before injection: the pre-existing instance `forward`,
or else the class's `forward` bound to the copy (so the copy's `__dict__` holds a plain bound
method under `forward`; its behaviour is the class's).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from types import CodeType
from typing import Any

import torch
import wrapt
from torch import nn
from torch.fx import _symbolic_trace

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

# Frames of nn.Module.__call__ that call `self.forward`; a proxy whose caller is not one of these
# was called directly (`module.forward(x)`). Read from torch, not from a global registry.
_MODULE_CALL_CODES: frozenset[CodeType] = frozenset(
    {nn.Module._call_impl.__code__, nn.Module._slow_forward.__code__}
)

# wrapt's pure-Python fallback (no C extension) adds frames of its own between caller and wrapper.
_WRAPT_DIRECTORY = os.path.dirname(wrapt.__file__)

_MAX_OUTPUT_DEPTH = 16


# --- the private torch internals interception relies on, each in one place ----------------------


def called_through_module_call(depth: int = 2) -> bool:
    """True when the proxy `depth` frames up (wrapt's own frames skipped) was called by
    `nn.Module.__call__`, False for a direct `module.forward(x)`.

    Relies on CPython frames (`sys._getframe`) and on the code objects of `nn.Module._call_impl`
    and `_slow_forward`, read from torch at import.
    """
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_WRAPT_DIRECTORY):
        frame = frame.f_back
    return frame is not None and frame.f_code in _MODULE_CALL_CODES


# nn.TransformerEncoderLayer runs as one fused kernel (`torch._transformer_encoder_layer_fwd`) in
# eval under no_grad, calling none of its submodules, unless one of its fast-path conditions fails
# (it also checks for module hooks, which is how a hook user sees the inner layers). This integer
# attribute (1 relu, 2 gelu, 0 other activation) is one of those conditions, read only by that
# check and by the fused call; the layer-by-layer path uses `self.activation` instead.
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


# torch.fx symbolic tracing; `is_fx_tracing` (older torch) also logs a warning in newer releases.
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

    Uses the engine's private `queue_callback`; returns False (queuing nothing) when no backward
    pass is running or the engine refuses, so the caller can run the work itself.
    """
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
    except Exception:
        return False
    return True


# --- torch.compile: dynamo's frame-evaluation switches, from torch._C (no torch._dynamo import) ----

try:
    from torch._C._dynamo import eval_frame as _eval_frame
except ImportError:  # pragma: no cover - a torch built without dynamo
    _eval_frame = None


def compile_support() -> bool:
    """Whether this torch can exclude one frame from compilation while compiling its callees."""
    return _eval_frame is not None and hasattr(_eval_frame, "set_code_exec_strategy")


def exclude_from_compilation(function: Callable[..., Any]) -> None:
    """Make dynamo run `function`'s frames as plain Python and still compile what they call.

    Marks the code object (`set_code_exec_strategy(SKIP, DEFAULT)`, what
    `torch.compiler.disable(recursive=False)` does for the frame it wraps) without importing
    torch._dynamo, which takes seconds; a no-op where this torch lacks it (see compile_support).
    """
    if compile_support():
        strategy = _eval_frame._FrameExecStrategy(  # type: ignore[union-attr]
            _eval_frame._FrameAction.SKIP,  # type: ignore[union-attr]
            _eval_frame._FrameAction.DEFAULT,  # type: ignore[union-attr]
        )
        _eval_frame.set_code_exec_strategy(function.__code__, strategy)  # type: ignore[union-attr]


def _no_callback(*_: Any) -> None:
    return None


# C callables on purpose: a Python helper called by the root wrapper before compilation is paused
# would be a frame for dynamo to compile. `pause_compilation()` stops dynamo from compiling the
# frames this thread enters and returns its callback; `resume_compilation(callback)` puts it back.
pause_compilation: Callable[[], Any] = (
    functools.partial(_eval_frame.set_eval_frame, None) if _eval_frame is not None else _no_callback
)
resume_compilation: Callable[[Any], Any] = (
    _eval_frame.set_eval_frame if _eval_frame is not None else _no_callback
)


class _ForceEager:
    """`set_stance("force_eager")`, held while at least one sampled forward runs in the process.

    The stance is process-wide and `set_stance` restores the stance it found when it was entered,
    so two threads entering and leaving it in crossed order would leave it on for good. The
    first sampled forward to start sets it and the last to end restores it, under one lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._context: Any = None

    def enter(self) -> None:
        with self._lock:
            if self._holders == 0:
                context = torch.compiler.set_stance("force_eager")
                context.__enter__()
                self._context = context
            self._holders += 1

    def exit(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._context is not None:
                context, self._context = self._context, None
                context.__exit__(None, None, None)


# The one piece of process-wide state here: it mirrors torch's own process-wide stance.
_FORCE_EAGER = _ForceEager()


def call_eagerly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `function` with torch.compile off, compiled modules nested inside included.

    `set_stance("force_eager")` reaches compiled callables inside (per-block compilation); it is
    process-wide while the call lasts (see `_ForceEager`). A `fullgraph=True` caller counts this
    call as a compiled frame, so that skipping compilation on purpose is not reported as "no
    compiled frames". Without torch._dynamo imported nothing can be compiled, and the call is a
    plain one.
    """
    paused = pause_compilation()
    try:
        if "torch._dynamo" not in sys.modules:
            return function(*args, **kwargs)
        _FORCE_EAGER.enter()
        try:
            result = function(*args, **kwargs)
        finally:
            _FORCE_EAGER.exit()
        count_frames = getattr(_eval_frame, "set_fullgraph_compiled_frame_count", None)
        if count_frames is not None:
            count = count_frames(-1)
            count_frames(count + 1 if count >= 0 else count)
        return result
    finally:
        resume_compilation(paused)


def _call_forward(forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Template of `forward_caller`: the frame dynamo compiles for an unsampled root forward."""
    return forward(*args, **kwargs)


def forward_caller() -> Callable[[Callable[..., Any], tuple, dict], Any]:
    """A function calling `forward(*args, **kwargs)` through a frame of its own code object.

    The root wrapper is never compiled, so the frame it calls is where dynamo starts. The class's
    forward cannot be that frame when it lives in torch (`nn.Sequential.forward`): dynamo never
    starts compiling inside torch.nn, and would run it eagerly. This frame is compiled instead,
    with the forward inlined into it, as torch.compile's own wrapper does. Each observer gets a
    fresh code object, so dynamo's per-code cache (and its recompile limit) is not shared
    between observed models.
    """
    code = _call_forward.__code__
    code = code.replace(co_varnames=code.co_varnames)  # a new code object, same bytecode
    return types.FunctionType(code, _call_forward.__globals__, "observed_forward")


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module a `torch.compile(module)` wrapper (OptimizedModule) compiles, else None."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        return module._orig_mod
    return None


def compiled_from_the_top(model: nn.Module) -> bool:
    """True when `model.compile()` ran on a module whose forward lives in torch (nn.Sequential).

    torch.compile then wraps `nn.Module._call_impl` so that dynamo traces it from the top (it never
    starts compiling inside torch.nn), into whatever instance `forward` the module gets later:
    a root proxy installed after that is a graph break. Read from dynamo's trace rules, loaded
    whenever something was compiled.
    """
    if model.__dict__.get("_compiled_call_impl") is None:
        return False
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    check = getattr(trace_rules, "check", None)
    return check is not None and bool(check(type(model).forward))


def named_modules_uncompiled(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`named_modules()` as if nothing were compiled.

    A `torch.compile(module)` wrapper is looked through and the module it wraps takes its name
    (`blocks.0.fc`, not `blocks.0._orig_mod.fc`), so layer names are those of the eager model.
    """
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        inner = compiled_original(module)
        while inner is not None:
            module, inner = inner, compiled_original(inner)
        if id(module) in seen:
            return
        seen.add(id(module))
        yield prefix, module
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}.{name}" if prefix else name)

    yield from walk(model, "")


class ForwardProxy(wrapt.FunctionWrapper):
    """The object installed as a module's instance `forward`.

    `_self_*` attributes stay on the proxy (wrapt's convention) and never reach the module.
    """

    # wrapt reports the wrapped object's class, so the proxy would pass for a bound method; it
    # must not, for torch.compile: OptimizedModule starts compiling at the model's forward frame
    # only when `isinstance(model.forward, MethodType)` is False or the method is user code, and
    # otherwise traces `nn.Module.__call__` from the top, into the root wrapper (a graph break).
    @property
    def __class__(self) -> type:  # type: ignore[override]
        return type(self)

    def __init__(
        self,
        module: nn.Module,
        original: Callable[..., Any],
        had_instance_forward: bool,
        wrapper: Wrapper,
        enabled: Any,
        token: object,
    ) -> None:
        super().__init__(original, wrapper, enabled=enabled)
        self._self_module = module
        self._self_had_instance_forward = had_instance_forward
        self._self_token = token

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        new_module = memo.get(id(self._self_module))
        if self._self_had_instance_forward or new_module is None:
            return copy.deepcopy(self.__wrapped__, memo)
        # copy.deepcopy registers the new module in `memo` before it copies the module's
        # __dict__, so the copy gets the class's forward bound to itself.
        return type(new_module).forward.__get__(new_module)

    def __copy__(self) -> Any:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._self_had_instance_forward:
            return self.__wrapped__.__reduce_ex__(protocol)
        # Unpickling evaluates this before the module's state is set, so it finds the class's
        # forward bound to the new module; no reference to this library ends up in the pickle.
        return (getattr, (self._self_module, "forward"))


def install_proxy(module: nn.Module, wrapper: Wrapper, enabled: Any, owner: object) -> ForwardProxy:
    """Replace `module`'s instance `forward` by a proxy calling `wrapper`, marked with `owner`."""
    had_instance_forward = "forward" in module.__dict__
    original = module.__dict__["forward"] if had_instance_forward else type(module).forward
    if not had_instance_forward:
        original = original.__get__(module, type(module))
    proxy = ForwardProxy(module, original, had_instance_forward, wrapper, enabled, owner)
    module.__dict__["forward"] = proxy
    return proxy


def restore_proxy(module: nn.Module, owner: object) -> bool:
    """Undo `install_proxy`; returns False, changing nothing, if our proxy is no longer reachable.

    Our proxy may sit under another observer's proxy (a submodule and its parent both observed):
    it is then spliced out of that chain, which keeps working. A proxy someone else replaced or
    wrapped after injection stays where it is: clobbering their object would break their code,
    and our proxy is inert once its observer is closed.
    """
    holder: ForwardProxy | None = None
    current = module.__dict__.get("forward")
    while isinstance(current, ForwardProxy):
        if current._self_token is owner:
            replacement = current.__wrapped__
            had_instance_forward = current._self_had_instance_forward
            if holder is not None:
                holder.__wrapped__ = replacement
                holder._self_had_instance_forward = had_instance_forward
            elif had_instance_forward:
                module.__dict__["forward"] = replacement
            else:
                del module.__dict__["forward"]
            return True
        holder, current = current, current.__wrapped__
    return False


def iter_tensors(output: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(tensor_path, tensor)` for every tensor inside a forward's output.

    Walks tuples and lists (`[0]`), mappings (`['key']`), namedtuples and dataclasses (`.field`);
    any other object is passed over untouched. Each object is visited once, so cycles and
    repeated references are safe; a tensor reachable twice is measured at its first path.
    """
    yield from _walk(output, "", set(), 0)


def _walk(obj: Any, path: str, seen: set[int], depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Depth-first walk behind `iter_tensors`."""
    if id(obj) in seen or depth > _MAX_OUTPUT_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        seen.add(id(obj))
        yield path, obj
        return
    if isinstance(obj, str | bytes | int | float | bool) or obj is None:
        return
    if isinstance(obj, Mapping):
        seen.add(id(obj))
        for key, value in obj.items():
            yield from _walk(value, f"{path}[{key!r}]", seen, depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        seen.add(id(obj))
        for name, value in zip(obj._fields, obj, strict=False):
            yield from _walk(value, f"{path}.{name}", seen, depth + 1)
    elif isinstance(obj, tuple | list):
        seen.add(id(obj))
        for index, value in enumerate(obj):
            yield from _walk(value, f"{path}[{index}]", seen, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        seen.add(id(obj))
        for field in dataclasses.fields(obj):
            yield from _walk(
                getattr(obj, field.name, None), f"{path}.{field.name}", seen, depth + 1
            )
