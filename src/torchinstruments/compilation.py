"""torch.compile: what the observer does so that compiled code never meets its bookkeeping.

Dynamo compiles the frames a compiled call enters. The root proxy's wrapper is excluded from that
(`exclude_from_compilation`: its frame runs as plain Python, the frames it calls are still
compiled), and it pauses compilation while it does its own bookkeeping, so the sampling decision
is taken in Python at every root forward and an unsampled forward then enters the compiled code
exactly as the plain model does (`ForwardEntry`): the model's own forward is the first frame
dynamo compiles, as for the plain model, and a frame of the observer's own is put in between
only where torch.compile puts one too (a forward that lives in torch, like nn.Sequential's). Layer proxies exist only while a sampled forward runs
(observer.py), and a sampled forward runs with torch.compile off (`call_eagerly`): compiled code
never sees a proxy, so it has the graphs, breaks and guards of the plain model.

Compiled-module naming: a `torch.compile(module)` wrapper is looked through, so layer names and
the model class are those of the eager model (`named_modules_uncompiled`, `compiled_original`).

The dynamo switches themselves are private torch internals and live in `_torch_internals.dynamo`.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from torchinstruments._torch_internals import child_modules
from torchinstruments._torch_internals.dynamo import (
    compile_support,
    compiled_call_impl_installed,
    compiled_forward_installed,
    dynamo_imported,
    dynamo_skips,
    eager_nested_compiles,
    entered_through_wrap_inline,
    exclude_from_compilation,
    optimized_module_original,
    pause_compilation,
    resume_compilation,
    set_fullgraph_frame_count,
    under_fullgraph,
)
from torchinstruments.eager_backward import hold_eager_for_backward
from torchinstruments.rundir.ranges import plural, was_were

__all__ = [
    "CompiledCalls",
    "ForwardEntry",
    "TracedLayers",
    "call_eagerly",
    "compile_notes",
    "compile_support",
    "compiled_from_the_top",
    "compiled_modules",
    "compiled_original",
    "eager_samples_note",
    "exclude_from_compilation",
    "forward_caller",
    "fullgraph_unchecked_warning",
    "named_modules_uncompiled",
    "pause_compilation",
    "resume_compilation",
    "wrapped_before_inject_note",
]


_NO_COMPILE_SUPPORT = (
    f"not recorded: forwards run under torch.compile (torch {torch.version.__version__} cannot keep the "
    "observer's root wrapper out of compiled code, so a compiled model's root forwards are "
    "neither counted nor sampled; eager forwards are recorded as usual)"
)
_COMPILED_FROM_THE_TOP = (
    "model.compile() ran before inject_observer on a {cls}, whose forward lives in torch: "
    "torch.compile then traces nn.Module.__call__ from the top and meets the observer's root "
    "wrapper, so each root forward has one extra graph break (fullgraph=True traces the "
    "model's forward through it instead, unobserved). Otherwise everything is still recorded. "
    "Call model.compile() after inject_observer, or inject into torch.compile(model), for "
    "unchanged graphs"
)
_WRAPPED_BEFORE_INJECT = (
    "torch.compile ran on this {cls} before inject_observer, and its compiled wrapper calls the "
    "{cls}, whose forward lives in torch: torch.compile then traces the {cls}'s call from the "
    "top and meets the observer's root wrapper, so each compiled root forward has one extra "
    "graph break (fullgraph=True traces the model's forward through it instead, unobserved). "
    "Otherwise everything is still recorded. For unchanged graphs, call inject_observer "
    "before torch.compile (or compile the observed module again "
    "after inject_observer and call that), or inject into the compiled wrapper itself"
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


def _one_more_frame(count: int) -> int:
    """dynamo's compiled-frame count with this eager call counted (a negative count is kept)."""
    return count + 1 if count >= 0 else count


def _force_eager_paused() -> None:
    """`_FORCE_EAGER.enter` from anywhere: a backward pass inside a compiled function runs its
    hooks while dynamo's frame callback is set, where torch refuses to change the stance."""
    paused = pause_compilation()
    try:
        _FORCE_EAGER.enter()
    finally:
        resume_compilation(paused)


def _force_eager_ended() -> None:
    """`_FORCE_EAGER.exit` from anywhere (see `_force_eager_paused`)."""
    paused = pause_compilation()
    try:
        _FORCE_EAGER.exit()
    finally:
        resume_compilation(paused)


def call_eagerly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `function` with torch.compile off, compiled modules nested inside included, and
    the backward pass through what it returned (`eager_backward`).

    `set_stance("force_eager")` reaches compiled callables inside (per-block compilation); it is
    process-wide while the call lasts (see `_ForceEager`), and the backward pass uses it too. It
    also runs a higher-order op's body eagerly (`torch.cond`, `torch.while_loop`), so its layers
    are measured, but under autograd torch cannot run such a body so (FakeTensorMode meets the
    layers' real parameters: an error in the user's step, observer or not). With grad enabled the
    call therefore runs under `eager_nested_compiles` instead: compiled callables on this thread
    run eagerly, and a higher-order op still compiles its body, tracing the layers' proxies
    through to their own forwards (capture.LayerProxy): unmeasured, and said. A
    `fullgraph=True` caller counts this
    call as a compiled frame, so that skipping compilation on purpose is not reported as "no
    compiled frames". Before dynamo (torch's compiler) is imported nothing can be compiled, and
    the call is a plain one.
    """
    paused = pause_compilation()
    try:
        if not dynamo_imported():
            return function(*args, **kwargs)
        eager = eager_nested_compiles() if torch.is_grad_enabled() else None
        if eager is not None:
            with eager:
                result = function(*args, **kwargs)
        else:
            _FORCE_EAGER.enter()
            try:
                result = function(*args, **kwargs)
            finally:
                _FORCE_EAGER.exit()
        set_fullgraph_frame_count(_one_more_frame)
        # Its backward pass too: checkpointing recomputes regions of it there (eager_backward.py).
        hold_eager_for_backward(result, _force_eager_paused, _force_eager_ended)
        return result
    finally:
        resume_compilation(paused)


class CompiledCalls:
    """The sampled forwards called from compiled code (each ran eagerly, `call_eagerly`), and
    those of them under `fullgraph=True`.

    Why the latter: without the observer a graph break under fullgraph=True raises at the first
    forward; a sampled one runs eagerly and cannot raise it, so the error comes at the first
    unsampled forward, or never when every forward is sampled. Checking the contract on a
    sampled forward would mean compiling it as well as running it eagerly (the model's side
    effects twice), so the run says it instead: index.md counts them, and removal warns where no
    forward was left unsampled to check it (`fullgraph_unchecked_warning`). A model that keeps
    the contract is not warned about on every run where an unsampled forward checked it.
    """

    def __init__(self) -> None:
        self.total = 0
        self.fullgraph = 0

    def add(self) -> None:
        """Count one sampled forward called from compiled code (compilation paused)."""
        self.total += 1
        if under_fullgraph():
            self.fullgraph += 1


_TRACED_NOTE = "layers called inside a higher-order op (torch.cond, torch.while_loop), unmeasured: "
_TRACED_SHOWN = 20  # layers named in that note (index.md stays bounded)


class TracedLayers:
    """The selected layers whose calls dynamo traced into a graph during sampled forwards
    (capture.LayerProxy, `LayerCapture.traced`).

    Why: a higher-order op compiles its body in eager mode whatever the sampled forward does
    (`torch.cond`, `torch.while_loop` call `torch.compile(fullgraph=True)`), so the layers it
    calls run inside that graph, where no proxy can measure them. The forward goes on and the run
    says it at the end of the sampled forward: a warning at the first, and one index.md note kept
    up to date. Tracing is seen, not each run of the graph (compiled once, it runs again in later
    sampled forwards without being traced), so layers are named, not calls counted.
    """

    def __init__(self) -> None:
        self.names: dict[str, None] = {}  # in the order traced
        self._said = 0
        self._said_once: set[str] = set()  # `root_traced`'s notes said

    def add(self, name: str) -> None:
        """A call of layer `name` was traced (called while dynamo traces: never raises)."""
        self.names[name] = None

    def say(self, notes: list[str], warn_once: Callable[[str, str], None]) -> None:
        """Say the layers traced since last said (`notes`: the observer's index.md notes)."""
        if len(self.names) == self._said:
            return
        self._said = len(self.names)
        names = list(self.names)
        shown = ", ".join(f"`{name}`" for name in names[:_TRACED_SHOWN])
        more = f" and {len(names) - _TRACED_SHOWN} more" if len(names) > _TRACED_SHOWN else ""
        note = (
            f"{_TRACED_NOTE}{shown}{more}. The op compiles its body even in eager mode, and "
            "dynamo traced these layers' calls into that graph, where they run without rows in "
            "every sampled forward that makes them (a layer called only there shows 0 sampled "
            "forwards in the Layers table). Call them outside the op to measure them"
        )
        for index, said in enumerate(notes):
            if said.startswith(_TRACED_NOTE):
                notes[index] = note
                return
        notes.append(note)
        warn_once("traced", note)

    def root_traced(
        self, notes: list[str], warn_once: Callable[[str, str], None], how: str = "traced"
    ) -> None:
        """Dynamo traced a call of the root into a graph of another model's code, where a graph
        break would raise (capture.RootProxy): said once, as dynamo traces it (no sampled
        forward ends to say it then). Such root forwards run inside the graph at each of its
        calls, not counted, not sampled, unseen by the observer: that they exist is all it knows.
        `how` "transform": dynamo met the root inside a torch.func transform it traced and ran
        that transform as Python instead (`_torch_internals.dynamo.trace_through`), said once.
        """
        note = _IN_A_TRANSFORM if how == "transform" else _ROOT_TRACED
        if note in self._said_once:
            return
        self._said_once.add(note)
        notes.append(note)
        warn_once(f"root {how}", note)


_ROOT_TRACED = (
    "the observed model was called inside code that torch.compile traced as one graph (the "
    "body of another model's higher-order op, torch.cond or torch.while_loop, which compiles "
    "its body even in eager mode; a function marked torch.compiler.nested_compile_region, "
    "which compiled code traces as one graph; a caller compiled with fullgraph=True; strict "
    "torch.export), "
    "where the "
    "observer's root wrapper cannot run: dynamo traced the model's own forward into that "
    "graph, so those root forwards were neither counted nor sampled, and they have no rows. "
    "Call the model outside the op (or without fullgraph=True) to observe it, or inject the "
    "observer into the model that calls it"
)


_IN_A_TRANSFORM = (
    "torch.compile met the observed model inside a torch.func transform (grad, vmap, jacrev, "
    "...): dynamo cannot break a graph inside a transform, and the observer's root wrapper "
    "must run as Python, so the compiled code around the model in the transform ran as Python "
    "at each call, sampled or not (a transform in the compiled code: dynamo broke the graph at "
    "the transform's call and ran the whole transform so; a compiled function called inside "
    "a transform: that function). Without the observer it compiles. The model's forwards "
    "there are counted, sampled and measured as usual; unsampled, they run compiled only "
    'under the "eager" backend (the other backends run code inside a transform as Python)'
)


def fullgraph_unchecked_warning(
    calls: CompiledCalls, root_forwards: int, samples: int
) -> str | None:
    """Removal's warning where every root forward was sampled and some ran under
    torch.compile(fullgraph=True): the promise of one graph was never checked; else None."""
    if not calls.fullgraph or root_forwards > samples:
        return None
    return (
        f"torchinstruments: every root forward was sampled ({plural(samples, 'sample')}), and "
        f"{plural(calls.fullgraph, 'sampled forward')} {was_were(calls.fullgraph)} called under "
        "torch.compile(fullgraph=True): a sampled forward runs eagerly (measuring it turns "
        "torch.compile off), so fullgraph=True was never checked in this run, and a graph break "
        "in the model raised nothing. Run the compiled model without the observer, or with a "
        "sampler that leaves forwards unsampled, to know it compiles as one graph (index.md "
        "says so)"
    )


def _call_forward(forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Template of `forward_caller`: the frame dynamo compiles for an unsampled root forward."""
    return forward(*args, **kwargs)


def forward_caller() -> Callable[[Callable[..., Any], tuple, dict], Any]:
    """A function calling `forward(*args, **kwargs)` through a frame of its own code object.

    The root wrapper is never compiled, so the frame it calls is where dynamo starts. The class's
    forward cannot be that frame when it lives in torch (`nn.Sequential.forward`): dynamo never
    starts compiling inside torch.nn, and would run it eagerly. This frame is compiled instead,
    with the forward inlined into it, as torch.compile's own wrapper does (only there: see
    `ForwardEntry`). Each observer gets a
    fresh code object, so dynamo's per-code cache (and its recompile limit) is not shared
    between observed models.
    """
    code = _call_forward.__code__
    code = code.replace(co_varnames=code.co_varnames)  # a new code object, same bytecode
    return types.FunctionType(code, _call_forward.__globals__, "observed_forward")


class ForwardEntry:
    """How an unsampled root forward enters compiled code: as torch.compile enters the plain model.

    torch.compile starts compiling at the model's own forward when dynamo may compile there (the
    user's code), and only for a forward dynamo never starts in (one in torch, nn.Sequential's)
    does it add a frame of its own that inlines it (`wrap_inline`). The root wrapper does the
    same: it calls the forward itself, or through `forward_caller`'s frame. A frame in between
    where torch.compile has none would cost nothing without a graph break, but a break inside the
    model would break that frame too (one more break, one more compiled frame). The answer is
    read from dynamo's trace rules the first time the forward is called while compiling, and
    kept: the root proxy's forward never changes.
    """

    def __init__(self) -> None:
        self.call_forward = forward_caller()
        self._through_caller: bool | None = None

    def through_caller(self, forward: Callable[..., Any]) -> bool:
        """Whether `forward`, called while compiling, must be entered through `call_forward`."""
        decided = self._through_caller
        if decided is None:
            skips = dynamo_skips(forward)
            if skips is None:  # trace rules not loaded: the caller's frame compiles either way
                return True
            decided = self._through_caller = skips
        return decided


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module a `torch.compile(module)` wrapper (OptimizedModule) compiles, else None."""
    return optimized_module_original(module)


def compiled_from_the_top(model: nn.Module) -> bool:
    """True when `model.compile()` ran on a module whose forward lives in torch (nn.Sequential).

    torch.compile then wraps `nn.Module._call_impl` so that dynamo traces it from the top (it never
    starts compiling inside torch.nn), into whatever instance `forward` the module gets later:
    a root proxy installed after that is a graph break. Read from dynamo's trace rules, loaded
    whenever something was compiled.
    """
    if not compiled_call_impl_installed(model):
        return False
    return bool(dynamo_skips(type(model).forward))


def wrapped_before_inject_note(root: nn.Module | None, root_call: types.CodeType) -> str | None:
    """index.md's note (and a warning) that the compiled wrapper calling the root costs a graph
    break at every compiled root forward, or None; asked once per observer, at the first root
    forward called from compiled code (`root_call`: the root wrapper's code, on the stack).

    `torch.compile(seq)` before `inject_observer(seq)`, for a module whose forward lives in torch:
    the wrapper then traces `seq(...)` from the top (dynamo's `wrap_inline` frame) into the root
    proxy. Nothing on `seq` points to its wrapper, so inject cannot tell; the call's frames
    can. `model.compile()` before inject is said at inject already (`compiled_from_the_top`).
    """
    if root is None or compiled_from_the_top(root) or not entered_through_wrap_inline(root_call):
        return None
    return _WRAPPED_BEFORE_INJECT.format(cls=type(root).__name__)


def compiled_modules(root: nn.Module) -> list[str]:
    """Names of the modules in `root` (itself included, as "") that torch.compile compiles: a
    `torch.compile(module)` wrapper, a module `module.compile()` ran on, or one whose instance
    `forward` is a compiled function (`module.forward = torch.compile(module.forward)`).

    Named as the layers are (`_eager_name`), each name once: a wrapper and the module it wraps
    are one module of the eager model.
    """
    names: list[str] = []
    for name, module in root.named_modules():
        if (
            compiled_original(module) is not None
            or compiled_call_impl_installed(module)
            or compiled_forward_installed(module)
        ):
            eager = _eager_name(root, name)
            if eager not in names:
                names.append(eager)
    return names


def _eager_name(root: nn.Module, name: str) -> str:
    """`name` (a path of `root.named_modules()`) without the `_orig_mod` steps of the
    torch.compile wrappers on it: `_orig_mod.blocks.0` -> `blocks.0`, as
    `named_modules_uncompiled` names it."""
    kept: list[str] = []
    module = root
    for part in name.split(".") if name else []:
        if not (part == "_orig_mod" and compiled_original(module) is not None):
            kept.append(part)
        module = dict(child_modules(module))[part]
    return ".".join(kept)


def eager_samples_note(
    root: nn.Module | None,
    samples: int,
    calls: CompiledCalls | None,
    compiled_at_inject: Sequence[str] = (),
) -> str | None:
    """index.md's note that a compiled model's sampled forwards ran eagerly, or None.

    Said because it changes what the rows describe: a sampled forward runs with torch.compile
    off (`call_eagerly`), so its rows, and the model's outputs and gradients on that step, are
    those of the eager model, and fullgraph=True went unchecked on them (`CompiledCalls`).
    Eager random ops consume the random number generator otherwise than inductor's kernels
    (which draw seeds for their own generator), so a model that draws random numbers (dropout)
    continues, after a sample, another stream than an unobserved run: the later unsampled steps
    differ too, which the note says. `calls`: the samples whose root forward was called from
    compiled code (the root compiled); the modules compiled inside `root` are read now
    (per-block compilation, which `call_eagerly` turns off too); without `root` (a live run's
    note, read each flush round, where walking the model would cost its size each time), the
    modules `compiled_at_inject` names (the root observed through its torch.compile wrapper
    runs no sample through compiled code, so `calls` alone would leave the note out).
    """
    called_compiled = 0 if calls is None else calls.total
    if samples == 0:
        compiled: list[str] = []
    else:
        compiled = list(compiled_at_inject) if root is None else compiled_modules(root)
    if samples == 0 or (called_compiled == 0 and not compiled):
        return None
    how = []
    if called_compiled:
        how.append(
            f"{called_compiled} of the {plural(samples, 'sample')} {was_were(called_compiled)} "
            "called through compiled code"
        )
    if compiled:
        names = ", ".join("the root" if not n else repr(n) for n in compiled[:10])
        how.append(f"compiled modules: {names}{' ...' if len(compiled) > 10 else ''}")
    return (
        f"torch.compile: sampled forwards ran eagerly ({'; '.join(how)}): torch.compile was off "
        "while each ran, nested compiled modules included, so their rows are those of an eager "
        "run of the same steps, and on those steps the model's outputs and gradients are eager "
        "numerics, which can differ from the compiled ones in the last bits; unsampled forwards "
        "ran the compiled code. Random ops (dropout) draw differently eagerly than in a graph "
        "inductor compiled: where the model draws random numbers, a sampled step's draws "
        "(dropout masks) are not the compiled step's, and the later steps continue another "
        "random number stream than an unobserved run, so their outputs differ from it too."
        + _fullgraph_sentence(0 if calls is None else calls.fullgraph)
    )


def _fullgraph_sentence(unchecked: int) -> str:
    """What the eager-samples note adds where samples were called under fullgraph=True."""
    if not unchecked:
        return ""
    return (
        f" {plural(unchecked, 'sampled forward')} {was_were(unchecked)} called under "
        "torch.compile(fullgraph=True), which is not checked on a forward that runs eagerly: "
        "a graph break there raises only at the next unsampled forward (the first sample "
        "takes it one forward later than without the observer), never while every forward "
        "is sampled."
    )


def named_modules_uncompiled(
    model: nn.Module, *, every_name: bool = False
) -> Iterator[tuple[str, nn.Module]]:
    """`named_modules()` as if nothing were compiled.

    A `torch.compile(module)` wrapper is looked through and the module it wraps takes its name
    (`blocks.0.fc`, not `blocks.0._orig_mod.fc`), so layer names are those of the eager model.
    `every_name`: a module held at several places comes under each of its names (as
    `remove_duplicate=False`), not only its first; a module inside itself is not entered again.
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
        for name, child in child_modules(module):
            yield from walk(child, f"{prefix}.{name}" if prefix else name)
        if every_name:  # `seen` holds the path from the root: only cycles are cut
            seen.discard(id(module))

    yield from walk(model, "")


def compile_notes(model: nn.Module) -> tuple[str, ...]:
    """What torch.compile changes for this model's run (index.md and a warning at inject)."""
    if not compile_support():
        return (_NO_COMPILE_SUPPORT,)
    if compiled_from_the_top(model):
        return (_COMPILED_FROM_THE_TOP.format(cls=type(model).__name__),)
    return ()
