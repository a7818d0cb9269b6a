"""A `forward` rebuilt from the proxy's `__func__` after inject_observer still reaches the proxy.

accelerate's `prepare` with mixed precision (`Accelerator(mixed_precision="bf16")`, on the CPU
too), and any code written as it is, replaces the model's instance `forward` with
`MethodType(wrap(model.forward.__func__), model)` (autocast around it, the outputs converted to
float32). wrapt hands attribute reads to the wrapped object, so `__func__` was the model's own
function: the rebuilt forward ran the model without the proxy and the run recorded nothing.

The proxy's `__func__` is instead a function of ours (`through_proxy`): called with the proxy's
module as `self` it calls the proxy, so the rebuilt forward's calls are counted and sampled
inside whatever the rebuilder put around them (autocast, the float32 conversion); called with any
other module (accelerate's `compile_regions` rebinds it to the module it builds) it calls the
module's own function, as before. A proxy whose wrapped forward has no `__func__` (a plain
function set as the instance forward) has none either, as the plain model's has none.

It carries the function's name, docstring and signature (`inspect.signature` of the rebuilt
forward, which the Hugging Face Trainer reads to choose dataset columns, is unchanged) but no
`__wrapped__` while the run lasts: accelerate's `unwrap_model(keep_fp32_wrapper=False)` unwraps a
forward down to its last `__wrapped__`, so it stops at ours and the model stays observed. At
removal (`release`) it lets go of the proxy, calls the function for every module and gains
`__wrapped__`: the model keeps the rebuilder's wrapper, holding no proxy, and unwrapping reaches
the model's own function as it does without the observer. Cost: one Python call more per root
forward through a rebuilt forward; nothing for a model whose forward nobody rebuilt.

Only the root's proxy hands one out (capture.ForwardProxy): a layer's proxy lives for one
sampled forward, and a forward rebuilt through it would still call it in the next one, under
that forward's own proxy. The observer finds `THROUGH_CODE` on the stack for two things: a
compiled root forward that traced the rebuilt forward into the proxy (a graph break, said once:
`compiled_through_note`), and, with capture_direct_forwards=False, whether the rebuilt forward
itself was called by `nn.Module.__call__`.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "THROUGH_CODE",
    "Owner",
    "compiled_through_note",
    "rebound_plainly",
    "rebuilt_from",
    "release",
    "through_proxy",
]

_COPIED = ("__module__", "__name__", "__qualname__", "__doc__")


class Owner:
    """The mark of one observer's proxies (`capture.Proxies`), which also remembers, weakly, the
    functions `through_proxy` handed out for them, so that removal can release each one."""

    __slots__ = ("handed_out",)

    def __init__(self) -> None:
        self.handed_out: list[weakref.ref[_Target]] = []


class _Target:
    """What a handed-out function calls: the proxy and its module (None once released), or the
    module's own function."""

    __slots__ = ("__weakref__", "function", "module", "proxy", "through")

    def __init__(self, proxy: Any, function: Callable[..., Any], module: object) -> None:
        self.proxy = proxy
        self.function = function
        self.module = module
        self.through: Callable[..., Any] | None = None


def through_proxy(
    proxy: Callable[..., Any], function: Callable[..., Any], module: object, owner: object
) -> Callable[..., Any]:
    """The `__func__` of `proxy` (a capture.ForwardProxy on `module`, marked with `owner`,
    wrapping `function` bound to `module`): a function that calls `proxy` when bound to
    `module`, and `function` when bound to any other."""
    target = _Target(proxy, function, module)

    def through(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = target.proxy
        if held is not None and self is target.module:
            return held(*args, **kwargs)
        return target.function(self, *args, **kwargs)

    for name in _COPIED:
        with contextlib.suppress(AttributeError, TypeError):  # a callable object without them
            setattr(through, name, getattr(function, name))
    with contextlib.suppress(TypeError, ValueError):  # none to give: inspect finds none either
        through.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
    target.through = through
    if isinstance(owner, Owner):
        owner.handed_out.append(weakref.ref(target))
    return through


def release(owner: Owner) -> tuple[Callable[..., Any], ...]:
    """At removal: every function handed out for `owner`'s proxies calls the module's own
    function from now on, holds no proxy, and unwraps to that function (`__wrapped__`).
    Returns those functions, for `rebuilt_from`."""
    released = []
    for ref in owner.handed_out:
        target = ref()
        if target is None or target.through is None:
            continue
        target.proxy = target.module = None
        target.through.__wrapped__ = target.function  # type: ignore[attr-defined]
        released.append(target.through)
    owner.handed_out.clear()
    return tuple(released)


def rebuilt_from(forward: object, functions: tuple[Callable[..., Any], ...]) -> bool:
    """Whether `forward` (a module's instance forward) calls one of `functions`, as far as its
    `__func__` and `__wrapped__` tell (accelerate's wrappers set `__wrapped__` at each level):
    then its calls reached the proxy, and removal has nothing to say about it."""
    seen = 0
    while forward is not None and seen < 32:  # a chain that loops ends the walk
        if any(forward is function for function in functions):
            return True
        inner = getattr(forward, "__func__", None)
        forward = inner if inner is not None else getattr(forward, "__wrapped__", None)
        seen += 1
    return False


def rebound_plainly(module: Any, released: tuple[Callable[..., Any], ...]) -> None:
    """At removal, after `release`: an instance `forward` that is one of `released` bound to
    `module` and nothing more (what accelerate's `unwrap_model(keep_fp32_wrapper=False)` builds
    during the run) becomes the module's function bound to it, which unwrapping would have
    given without the observer; it behaves the same, and holds nothing of ours."""
    forward = module.__dict__.get("forward")
    if (
        isinstance(forward, types.MethodType)
        and forward.__self__ is module
        and any(forward.__func__ is function for function in released)
    ):
        function = forward.__func__.__wrapped__  # type: ignore[attr-defined]  # set by `release`
        module.__dict__["forward"] = types.MethodType(function, module)


# The code of every function `through_proxy` hands out (observer.py looks for it on the stack).
THROUGH_CODE: types.CodeType = next(
    const
    for const in through_proxy.__code__.co_consts
    if isinstance(const, types.CodeType) and const.co_name == "through"
)


def compiled_through_note(cls: str) -> str:
    """index.md's note (and a warning) on a root forward rebuilt from the proxy's `__func__`
    and called from compiled code: torch.compile traced the rebuilt forward down to the proxy."""
    return (
        f"the {cls}'s forward was rebuilt after inject_observer from the observer's proxy "
        "(accelerate's prepare with mixed precision: autocast and a float32 conversion of the "
        "outputs around it), and torch.compile traces that rebuilt forward into the proxy: each "
        "compiled root forward has one extra graph break (the wrapper's autocast and conversion "
        "compile apart from the model's forward, which compiles as without the observer; "
        "fullgraph=True traces the model's forward through the proxy instead, unobserved). "
        "Otherwise everything is still recorded. For unchanged graphs, call "
        "inject_observer after accelerator.prepare, on the module it returns"
    )
