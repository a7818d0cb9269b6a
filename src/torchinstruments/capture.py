"""Forward proxies: how calls are intercepted without hooks, and how they are undone.

Each selected module gets its *instance* attribute `forward` replaced by a `wrapt.FunctionWrapper`
around the bound forward it had. `nn.Module.__call__` looks `self.forward` up on the instance, so
`module(x)` reaches the proxy, and a direct `module.forward(x)` reaches it natively. Module hooks
are not used: any hook pushes `nn.Module.__call__` off its fast path (about 1 µs per call here),
while an instance `forward` keeps it on it.

The unsampled path is wrapt's C code alone: the proxy is built with `enabled=<list>.__len__`, so
while the observer's `active` list is empty, wrapt calls the original forward directly without
entering Python (about 20 ns per call here; see bench/overhead.py). Only during a sampled root
forward does the list hold an item and the Python wrapper run.

Removal restores the instance `__dict__` exactly: the key is deleted where there was none, the
previous object is put back by identity where there was one, and a proxy someone else replaced or
wrapped after injection is left in place (the observer is closed, so it is inert for good).

Private torch internals: everything the interception relies on that torch does not promise (the
caller-frame check against `nn.Module._call_impl`, fx's symbolic-tracing flag, the autograd engine's
`queue_callback`, the switch that keeps `nn.TransformerEncoderLayer` off its fused kernel) lives in
this module, one function each, each with its own test in
tests/test_capture.py, so a torch upgrade that moves one of them breaks in one place.

Copies: `copy.deepcopy` and `pickle`/`torch.save` of an observed model give a plain, unobserved
model. The proxy reduces to what was there before injection: the pre-existing instance `forward`,
or else the class's `forward` bound to the copy (so the copy's `__dict__` holds a plain bound
method under `forward`; its behaviour is the class's).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
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


class ForwardProxy(wrapt.FunctionWrapper):
    """The object installed as a module's instance `forward`.

    `_self_*` attributes stay on the proxy (wrapt's convention) and never reach the module.
    """

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


def proxy_reachable(module: nn.Module, owner: object) -> bool:
    """True while `module.forward` still leads to our proxy (possibly under other proxies of this
    library); False once someone replaced or wrapped it after injection."""
    current = module.__dict__.get("forward")
    while isinstance(current, ForwardProxy):
        if current._self_token is owner:
            return True
        current = current.__wrapped__
    return False


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
