"""torch.compile's private side: dynamo's frame-evaluation switches (from torch._C, without
importing torch._dynamo, which takes seconds), and what dynamo's own modules say once loaded.

Split from the package's other internals because compilation.py and the root wrapper are its
only users, and every name here moves with dynamo rather than with nn.Module or autograd. The
same rule holds: one adapter each, with why and the torch version it was checked on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch
import wrapt
from torch import nn

__all__ = [
    "called_within",
    "compile_support",
    "compiled_call_impl_installed",
    "compiled_forward_installed",
    "dynamo_imported",
    "dynamo_skips",
    "eager_nested_compiles",
    "entered_through_wrap_inline",
    "exclude_from_compilation",
    "graph_break_allowed",
    "opaque_to_compilation",
    "optimized_module_original",
    "pause_compilation",
    "resume_compilation",
    "set_fullgraph_frame_count",
    "trace_through",
    "under_fullgraph",
]

try:
    from torch._C._dynamo import eval_frame as _eval_frame
except ImportError:  # pragma: no cover - a torch built without dynamo
    _eval_frame = None


def compile_support() -> bool:
    """Whether this torch can exclude one frame from compilation while compiling its callees.

    Checked on torch 2.15.0 (`torch._C._dynamo.eval_frame.set_code_exec_strategy`).
    """
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


def opaque_to_compilation(function: Callable[..., Any]) -> None:
    """Make dynamo run `function` and everything it calls as plain Python, also where it would
    inline `function` into a graph it traces: compiled autograd traces the tensor hooks of a
    backward pass into the backward's graph.

    Marks the code object (`set_code_exec_strategy(SKIP, SKIP)`: the frame and the frames it
    calls are never compiled) and the function as `torch.compiler.disable` marks the functions
    it wraps (`_torchdynamo_disable`, which dynamo reads where it would inline one: it breaks the
    graph there and calls the function), without a wrapper (which costs every call) and without
    importing torch._dynamo; a no-op where this torch lacks it (see compile_support). Checked on
    torch 2.15.0.
    """
    if compile_support():
        strategy = _eval_frame._FrameExecStrategy(  # type: ignore[union-attr]
            _eval_frame._FrameAction.SKIP,  # type: ignore[union-attr]
            _eval_frame._FrameAction.SKIP,  # type: ignore[union-attr]
        )
        _eval_frame.set_code_exec_strategy(function.__code__, strategy)  # type: ignore[union-attr]
        function._torchdynamo_disable = True  # type: ignore[attr-defined]


def _no_callback(*_: Any) -> None:
    return None


# C callables on purpose: a Python helper called by the root wrapper before compilation is paused
# would be a frame for dynamo to compile. `pause_compilation()` stops dynamo from compiling the
# frames this thread enters and returns its callback; `resume_compilation(callback)` puts it back.
# Checked on torch 2.15.0 (`torch._C._dynamo.eval_frame.set_eval_frame`).
pause_compilation: Callable[[], Any] = (
    functools.partial(_eval_frame.set_eval_frame, None) if _eval_frame is not None else _no_callback
)
resume_compilation: Callable[[Any], Any] = (
    _eval_frame.set_eval_frame if _eval_frame is not None else _no_callback
)


def set_fullgraph_frame_count(adjust: Callable[[int], int]) -> None:
    """Replace dynamo's count of compiled frames under `fullgraph=True` by `adjust(count)`.

    Why: an eager call inside a `fullgraph=True` caller must count as a compiled frame, or dynamo
    reports "no compiled frames". A no-op where this torch lacks the counter. Checked on 2.15.0.
    """
    count_frames = getattr(_eval_frame, "set_fullgraph_compiled_frame_count", None)
    if count_frames is not None:
        count = count_frames(-1)
        count_frames(adjust(count))


def under_fullgraph() -> bool:
    """Whether the running compiled call is a `fullgraph=True` one (dynamo counts its compiled
    frames, from 0; elsewhere the count is -1). False where this torch lacks the counter.

    Why: a sampled forward runs eagerly, so that call's no-graph-break promise goes unchecked
    there, which the run says. Checked on 2.15.0."""
    count_frames = getattr(_eval_frame, "set_fullgraph_compiled_frame_count", None)
    if count_frames is None:
        return False
    count = count_frames(-1)
    count_frames(count)
    return count >= 0


def dynamo_imported() -> bool:
    """Whether torch._dynamo was imported (nothing can have been compiled before that).

    Why: importing it takes seconds, so the library only ever looks it up. Checked on 2.15.0.
    """
    return "torch._dynamo" in sys.modules


def eager_nested_compiles() -> contextlib.AbstractContextManager[Any] | None:
    """A context in which this thread's torch.compile'd callables run their function eagerly,
    except the compilations of higher-order ops (dynamo's `_use_eager_on_nested_compile`); None
    where this torch lacks it (or dynamo is not loaded).

    Why not `set_stance("force_eager")` for a sampled forward: the stance turns off the
    compilation that `torch.cond` (and `torch.while_loop`) need in eager mode, and their branches
    then fail under autograd (FakeTensorMode meets the layers' real parameters), even without the
    observer. Checked on torch 2.15.0 (`torch._dynamo.eval_frame`, read at its `compile_wrapper`).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    eager = getattr(eval_frame, "_use_eager_on_nested_compile", None)
    return None if eager is None else eager()


def optimized_module_original(module: nn.Module) -> nn.Module | None:
    """The module a `torch.compile(module)` wrapper (OptimizedModule) compiles, else None.

    Why: layer names and the model class are those of the eager model. Reads
    `torch._dynamo.eval_frame.OptimizedModule` and its `_orig_mod`; checked on torch 2.15.0.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        return module._orig_mod
    return None


def compiled_call_impl_installed(model: nn.Module) -> bool:
    """Whether `model.compile()` ran on `model` (it sets the instance's `_compiled_call_impl`).

    Checked on torch 2.15.0.
    """
    return model.__dict__.get("_compiled_call_impl") is not None


def compiled_forward_installed(module: nn.Module) -> bool:
    """Whether `module`'s instance `forward` is a torch.compile'd function
    (`module.forward = torch.compile(module.forward)`).

    Why: such a forward runs eagerly in a sampled forward, as a compiled module does. A compiled
    function carries `_torchdynamo_inline` (what dynamo inlines in its place), which
    `torch.compiler.disable` wrappers lack; read through a proxy wrapping it. Checked on torch
    2.15.0.
    """
    forward = module.__dict__.get("forward")
    return getattr(forward, "_torchdynamo_inline", None) is not None and not getattr(
        forward, "_torchdynamo_disable", False
    )


def dynamo_skips(function: Callable[..., Any]) -> bool | None:
    """Whether dynamo's trace rules skip `function` (dynamo never starts compiling there).

    None when `torch._dynamo.trace_rules` is not loaded (it is whenever something was compiled).
    Checked on torch 2.15.0 (`trace_rules.check`).
    """
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    check = getattr(trace_rules, "check", None)
    if check is None:
        return None
    return bool(check(function))


# The frames between a module's caller and its instance `forward`: nn.Module.__call__'s own, and
# wrapt's where its pure-Python fallback runs (no C extension).
_MODULE_CALL_CODES: frozenset[CodeType] = frozenset(
    {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}
)
_WRAPT_DIRECTORY = os.path.dirname(wrapt.__file__)


def entered_through_wrap_inline(below: CodeType) -> bool:
    """Whether the innermost frame running `below` was called, through nn.Module.__call__, by a
    frame of dynamo's `wrap_inline` helper (`torch._dynamo.external_utils`, its `inner`): a
    compiled wrapper of the module itself, not a compiled function calling `below` directly
    (`module.forward = torch.compile(module.forward)`: the break of any compiled caller).

    Why: `torch.compile(module)` on a module whose forward lives in torch (nn.Sequential) compiles
    that extra frame, which traces `module(...)` from the top; a root proxy installed on the
    module after that is met inside the traced call, a graph break at every compiled forward.
    Nothing on the module points to the wrapper, so only the call shows it. Dynamo runs the frame
    with a code object of its own, so `inner` is matched by file, name and first line, not by
    identity; False where `external_utils` is not loaded (nothing was compiled). Checked on torch
    2.15.0 (`external_utils.wrap_inline`, used by `OptimizedModule._initialize`).
    """
    external_utils = sys.modules.get("torch._dynamo.external_utils")
    wrap_inline = getattr(external_utils, "wrap_inline", None)
    if wrap_inline is None:
        return False
    inner = wrap_inline(_no_callback).__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not below:
        frame = frame.f_back
    frame = frame.f_back if frame is not None else None
    through_module_call = False
    while frame is not None and (
        frame.f_code in _MODULE_CALL_CODES or frame.f_code.co_filename.startswith(_WRAPT_DIRECTORY)
    ):
        through_module_call = through_module_call or frame.f_code in _MODULE_CALL_CODES
        frame = frame.f_back
    return through_module_call and frame is not None and _same_code(frame.f_code, inner)


def called_within(code: CodeType, frames: int) -> bool:
    """Whether one of the `frames` frames above the caller runs `code` (or dynamo's transformed
    copy of it).

    Why: observer.py tells a compiled root forward that reached the root proxy through a forward
    rebuilt from the proxy's `__func__` (rebuilt_forwards.py: accelerate's mixed precision): dynamo
    traced that forward and broke its graph at the proxy. Relies on CPython frames
    (`sys._getframe`); dynamo runs a frame it compiled with a code object of its own, so the code
    is matched by file, name and first line. Checked on torch 2.15.0, CPython 3.11.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(frames):
        if frame is None:
            return False
        if _same_code(frame.f_code, code):
            return True
        frame = frame.f_back
    return False


def _same_code(running: CodeType, original: CodeType) -> bool:
    """Whether `running` (dynamo's transformed copy, or the code itself) is `original`'s."""
    return (running.co_filename, running.co_name, running.co_firstlineno) == (
        original.co_filename,
        original.co_name,
        original.co_firstlineno,
    )


def trace_through(
    proxy_type: type, traced: Callable[[Any, str], None], where_unbreakable: bool = False
) -> None:
    """Make dynamo trace a call of a `proxy_type` instance as a call of what it wraps
    (`__wrapped__`), and call `traced(proxy, "traced")` while it traces one (never raising into
    it). `where_unbreakable`: only where a graph break would raise (`graph_break_allowed`
    False); where dynamo may break the graph it breaks it at the proxy, as it did without this,
    and the proxy runs as Python; inside a torch.func transform it inlines (`grad`, `vmap`) the
    break moves out to the transform's call, which then runs as Python, and in a frame entered
    inside a transform running so the whole frame runs as Python (`_transform_levels`): either
    is said with `traced(proxy, "transform")`.

    Why: a higher-order op compiles its body in eager mode (`torch.cond`), and dynamo cannot
    trace a wrapt proxy's C `__call__` (an error in the user's step); this way the layers it calls
    run inside that graph as their own forwards, unmeasured, and the run can say so. It costs a
    proxy's call nothing outside dynamo. Dynamo traces the attribute `__original_fn` of an object
    marked `__script_if_tracing_wrapper` (what `torch.jit._script_if_tracing` sets), reading it
    for real (several times) while it traces, and again, untraced, in the guards of the graph
    (each call of it), or to build a guard (`_read_for_a_guard`): there it is `__wrapped__`,
    as traced. Checked on torch 2.15.0
    (`variables/builder.py`, `variables/functions.py` `WrapperUserFunctionVariable`).
    """

    def original(proxy: Any) -> Any:
        allowed = graph_break_allowed() if where_unbreakable else False
        if allowed and not _read_for_a_guard():
            began_in, now_in = _transform_levels()
            if now_in:
                with contextlib.suppress(Exception):  # saying it must not break the trace
                    traced(proxy, "transform")
            _break_graph(type(proxy).__name__, whole_frame=began_in > 0)
        if allowed is False:
            with contextlib.suppress(Exception):  # saying it must not break the trace
                traced(proxy, "traced")
        return proxy.__wrapped__

    setattr(proxy_type, "__script_if_tracing_wrapper", True)
    setattr(proxy_type, "__original_fn", property(original))


# Where dynamo's sources read a value (`Source.get_value`: an attribute read, or an `eval` of
# the source's name).
_SOURCE_FILES = (os.path.join("_dynamo", "source.py"), os.path.join("torch", "_guards.py"))


def _read_for_a_guard() -> bool:
    """Whether dynamo reads the attribute to find the value a guard of its graph checks
    (`Source.get_value`, directly or through the `eval` of the source's name), not to trace a
    call: `torch.compiler.nested_compile_region` reads it so, once the region is traced, in
    the caller's context, where a graph break would be allowed and raised from inside that
    read (an InternalTorchDynamoError in the user's step). The value is what was traced:
    `__wrapped__`. Checked on torch 2.15.0 (`torch/_dynamo/source.py`, `torch/_guards.py`,
    `OutputGraph.resolve_source_value`, `variables/invoke_subgraph.py`)."""
    frame: FrameType | None = sys._getframe(2)  # above this helper and `original`
    for _ in range(2):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "get_value" and code.co_filename.endswith(_SOURCE_FILES):
            return True
        frame = frame.f_back
    return False


def _transform_levels() -> tuple[int, int]:
    """The torch.func transforms (`grad`, `vmap`, `jacrev` levels) around the frame dynamo
    compiles now: running when it entered the frame (its output graph keeps them,
    `functorch_layers`), and now, with those dynamo inlines into the frame up to here (it
    enters their levels as it traces them); (0, 0) where this torch's tracer cannot be read.

    Why: dynamo cannot break a graph inside a transform it inlines; it breaks at the
    transform's call instead and runs the transform as Python, the model's forward in it
    compiled only by the "eager" backend (the others run a frame entered inside a transform as
    Python). A graph break in a frame entered so makes a resume function whose inputs are the
    transform's wrapped tensors, which dynamo cannot turn into fake ones (an AssertionError in
    the user's step): that frame is run as Python instead. Checked on torch 2.15.0
    (`OutputGraph.functorch_layers`, `torch._C._functorch.get_interpreter_stack`).
    """
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    tx = getattr(getattr(convert, "tls", None), "current_tx", None)
    try:
        began = len(tx.output.functorch_layers)  # type: ignore[union-attr]
        return began, len(torch._C._functorch.get_interpreter_stack() or ())
    except Exception:  # another torch: a graph break at the proxy, as before
        return 0, 0


def graph_break_allowed() -> bool | None:
    """Whether dynamo, tracing on this thread, may break the graph where it is now (None: it is
    not tracing): not under `fullgraph=True` or `error_on_graph_break`, nor inside the body of a
    higher-order op that refuses a break in it (`torch.cond`, `torch.while_loop`, which compile
    their bodies with fullgraph=True even in eager mode; torch.utils.checkpoint's op and a
    custom autograd.Function fall back to eager instead). False where this torch's tracer
    cannot be read (a break would raise).

    Checked on torch 2.15.0 (`symbolic_convert.tls.current_tx`, its `one_graph`,
    `error_on_graph_break` and `output.current_tracer`, whose `parent` chain is the bodies being
    traced, each with its op as `source_target`; `higher_order_ops._hop_name_to_variable_class`
    and their `_ALLOW_FALLBACK_TO_EAGER`).
    """
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    tx = getattr(getattr(convert, "tls", None), "current_tx", None)
    if tx is None:
        return None
    try:
        if tx.one_graph or tx.error_on_graph_break:
            return False
        hops = sys.modules["torch._dynamo.variables.higher_order_ops"]
        variables = hops._hop_name_to_variable_class
        tracer = tx.output.current_tracer
        while tracer.parent is not None:
            target = tracer.source_target
            if isinstance(target, str):  # an op dynamo traces by a variable of its own
                variable = _hop_variable_named(hops, target)
            else:
                variable = variables.get(getattr(target, "__name__", None))
            if not getattr(variable, "_ALLOW_FALLBACK_TO_EAGER", False):
                return False
            tracer = tracer.parent
    except Exception:  # another torch: as if the break would raise
        return False
    return True


def _hop_variable_named(hops: Any, name: str) -> type | None:
    """The variable class of `higher_order_ops` whose `_HOP_NAME` is `name`, or None: a custom
    `torch.autograd.Function`'s forward is traced with the name itself as the body's
    `source_target` ("autograd.Function", `AutogradFunctionApplyVariable`), and a break in it
    falls back to eager at the `apply` call, where the observed model is then measured.
    Checked on torch 2.15.0."""
    for value in vars(hops).values():
        if isinstance(value, type) and getattr(value, "_HOP_NAME", None) == name:
            return value
    return None


def _break_graph(kind: str, whole_frame: bool = False) -> None:
    """Raise dynamo's graph break (`torch._dynamo.exc.unimplemented`) while it traces a call of
    an object of class `kind`; `whole_frame`: not a break but the frame run as Python, every
    time (its code marked so: `skip_frame` kept through the inlined calls up to it), as dynamo
    marks a frame entered inside a transform under any other backend than "eager" (marked once,
    not traced again at each call; the mark outlives the observer, as dynamo's does). Checked
    on torch 2.15.0."""
    from torch._dynamo.exc import unimplemented  # loaded: dynamo is tracing

    unimplemented(
        gb_type="call to an observer's root proxy",
        context=kind,
        explanation="torchinstruments' root wrapper runs as Python: it counts and samples the "
        "observed model's root forwards",
        hints=[],
        skip_frame=whole_frame,
        preserve_skip_frame_after_inline=whole_frame,
    )
