"""Forward proxies: how calls are intercepted without hooks, and how they are undone.

Each selected module gets its *instance* attribute `forward` replaced by a `wrapt.FunctionWrapper`
around the bound forward it had. `nn.Module.__call__` looks `self.forward` up on the instance, so
`module(x)` reaches the proxy, and a direct `module.forward(x)` reaches it natively. Module hooks
are not used: any hook pushes `nn.Module.__call__` off its fast path (about 1 µs per call here),
while an instance `forward` keeps it on it.

Between root forwards only the root carries a proxy; the selected layers get theirs when a
sampled root forward starts and lose them when it ends (observer.py), so an unsampled forward
costs one Python call at the root and nothing per layer, and compiled code never meets a layer
proxy (compilation.py) but where a higher-order op (`torch.cond`) compiles its body inside a
sampled forward: dynamo then traces the proxy as the layer's own forward (`LayerProxy`), as it
does the root's where it cannot break the graph at it (`RootProxy`). During a sampled forward
the layer proxies are built with `enabled=<list>.__len__`: another thread's unsampled forward
passing through them stays in wrapt's C code (about 20 ns per call; bench/overhead.py).

A sampled forward's end may be cut by a KeyboardInterrupt (observer.py heals it at the thread's
next root forward): taking the layers' proxies off is keyed by the sample that put them on, so
finishing a cut end twice changes nothing, and removal takes off whatever is still on.

Removal restores the instance `__dict__` exactly: the key is deleted where there was none, the
previous object is put back by identity where there was one, and a proxy someone else replaced or
wrapped after injection is left in place (the observer is closed, so it is inert for good).

The private torch internals this relies on (the caller-frame check, tracing flags, the
fused-path switch) live in `_torch_internals`; torch.compile's side lives in `compilation`, and
the walk over what a forward returned in `outputs`.

Copies: `copy.deepcopy` and `pickle`/`torch.save` of an observed model give a plain, unobserved
model. The proxy reduces to what was there before injection: the pre-existing instance `forward`,
or else the class's `forward` bound to the copy. A deep copy that `copy.deepcopy` reconstructs
(every module whose class has no `__deepcopy__` of its own) then drops that bound method again
(a `__setstate__` of the copy's own, set on the copy under construction and gone once its state
is set), so it is exactly a deep copy of the unobserved model: no `forward` of its own (no
reference cycle: an EMA copy per step is freed at once), and `torch.save` of it loads with
`weights_only=True`. An unpickled copy keeps the bound method under `forward` (its behaviour is
the class's): the pickle can only name it through `getattr`, which `torch.load(weights_only=True)`
refuses, so a whole-module `torch.save` of an observed model loads with `weights_only=False`
(save its `state_dict`, a deep copy, or the model after `remove_observer` otherwise).
Pickled to start a process with 'spawn' or 'forkserver' (`multiprocessing`, a DataLoader worker
whose dataset holds it, `torch.multiprocessing.spawn`), the proxy warns: the child's copy runs
unobserved, and only the parent can say so (a fork is `forks`'s case).
A shallow `copy.copy` copies the module's `__dict__` as it is, without calling anything of the
proxy: the copy shares the root's proxy, so its calls run the original's forward (on the
original's attributes) and count in the original's run. That cannot be told apart without
inspecting the caller's frame on every root forward; make copies with `copy.deepcopy`, or
before `inject_observer` or after `remove_observer`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from types import CodeType, MethodType
from typing import Any

import wrapt
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from torchinstruments._torch_internals import (
    called_through_module_call,
    caller_of_code_is_module_call,
    layer_by_layer,
    pickled_for_a_new_process,
    ran_by_a_backward,
)
from torchinstruments._torch_internals.dynamo import trace_through
from torchinstruments.fused_paths import FusedPathGuard, fused_path_modules
from torchinstruments.left_in_place import Forward
from torchinstruments.notices import warn
from torchinstruments.rebuilt_forwards import (
    Owner,
    rebound_plainly,
    rebuilt_from,
    release,
    through_proxy,
)
from torchinstruments.records import LayerInfo, module_type
from torchinstruments.rundir.shell import layer_span

# index.md's note on layers whose class changed after injection (`LayerCapture.retype`).
RETYPED = (
    "layers whose class changed after injection (a lazy module becomes its concrete class at "
    "its first call): their rows and result.json give the class when measured: "
)
_RETYPED_SHOWN = 20  # layers named in that note (index.md stays bounded)

__all__ = [
    "SENT_TO_A_NEW_PROCESS",
    "ForwardProxy",
    "LayerCapture",
    "Proxies",
    "WarnOnce",
    "Wrapper",
    "by_module_call",
    "forward_is_property",
    "install_proxy",
    "restore_proxy",
]

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

SENT_TO_A_NEW_PROCESS = (
    "torchinstruments: an observed model is pickled for a process started with 'spawn' or "
    "'forkserver': there it is a plain copy and runs unobserved (nothing it computes is recorded "
    "in this run); to observe it, call inject_observer in that process, with an output_dir of "
    "its own"
)


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
        self._self_through: Callable[..., Any] | None = None  # `__func__`, made once read
        self._self_root = enabled is None  # the root's proxy, the only one always enabled
        self._self_wrapper_owner: Any = getattr(wrapper, "__self__", None)  # capture/observer

    # wrapt would hand out the wrapped method's function, and a forward rebuilt from it
    # (accelerate's mixed precision) would skip the proxy: the root's calls it
    # (rebuilt_forwards.py). A layer's proxy lives for one sampled forward: a forward rebuilt
    # through it would still call it in the next one, under that one's own proxy (twice measured).
    @property
    def __func__(self) -> Callable[..., Any]:
        function = self.__wrapped__.__func__  # type: ignore[attr-defined]  # AttributeError: none
        if not self._self_root:
            return function
        if self._self_through is None:
            owner = self._self_token
            self._self_through = through_proxy(self, function, self._self_module, owner)
        return self._self_through

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        new_module = memo.get(id(self._self_module))
        if self._self_had_instance_forward or new_module is None:
            return copy.deepcopy(self.__wrapped__, memo)
        # copy.deepcopy registers the new module in `memo` before it copies the module's
        # __dict__, so the copy gets the class's forward bound to itself, and then drops it.
        bound = bound_class_forward(new_module)
        # Copied by `copy._reconstruct` (no `__deepcopy__` of its class, which may never call
        # `__setstate__`, e.g. torch.fx's GraphModule), whose state is being copied now, and
        # set right after: drop the bound method then.
        if not new_module.__dict__ and getattr(type(new_module), "__deepcopy__", None) is None:
            new_module.__dict__["__setstate__"] = _set_state_without(new_module, bound)
        return bound

    def __copy__(self) -> Any:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        if pickled_for_a_new_process():
            warn(SENT_TO_A_NEW_PROCESS)  # said here: the child's copy cannot say it was observed
        if self._self_had_instance_forward:
            # The module's own forward is pickled as pickle would pickle it without us: a
            # function by reference (its own __reduce_ex__ would refuse it), any other object
            # by its reduction, shared through the memo. `getitem` is a builtin, not ours.
            return (operator.getitem, ((self.__wrapped__,), 0))
        # Unpickling evaluates this before the module's state is set, so it finds the class's
        # forward bound to the new module; no reference to this library ends up in the pickle.
        return (getattr, (self._self_module, "forward"))


class LayerProxy(ForwardProxy):
    """A selected layer's proxy (one sampled forward), which dynamo traces as the layer's forward:
    a higher-order op compiles its body in eager mode (`torch.cond`, `torch.while_loop`), and
    dynamo cannot trace wrapt's C `__call__` (an error in the user's step). Traced, the call runs
    unmeasured, which the run says (`LayerCapture.traced`); run, it is wrapt's call, unchanged."""


class RootProxy(ForwardProxy):
    """The root's proxy; dynamo traces it as the root's forward only where it cannot break the
    graph at it (another model's `torch.cond` body, `fullgraph=True`): root forwards neither
    counted nor sampled, said (`TracedLayers.root_traced`); elsewhere it breaks there."""


def _traced(proxy: ForwardProxy, how: str) -> None:
    """Dynamo traces a call of `proxy` (`trace_through`, `how`): its layer, or the root, said."""
    owner = proxy._self_wrapper_owner  # a LayerCapture, or the observer
    if isinstance(owner, LayerCapture):
        owner.traced()
    elif isinstance(proxy, RootProxy) and owner is not None and not owner.closed:
        owner.traced.root_traced(owner.notes, owner.warn_once, how)


trace_through(LayerProxy, _traced)
trace_through(RootProxy, _traced, where_unbreakable=True)


def _set_state_without(module: nn.Module, bound: Any) -> Callable[[dict[str, Any]], None]:
    """An instance `__setstate__` that `copy.deepcopy` calls on the copy under construction
    (instance attributes come before the class's): it removes itself, sets the state as the
    class does, and takes out the `bound` forward the proxy's copy put in it, so the copy's
    `__dict__` is what a deep copy of the unobserved module holds (no `forward`, no cycle)."""

    def set_state(state: dict[str, Any]) -> None:
        module.__dict__.pop("__setstate__", None)
        type(module).__setstate__(module, state)
        if module.__dict__.get("forward") is bound:
            del module.__dict__["forward"]

    return set_state


def install_proxy(
    module: nn.Module,
    wrapper: Wrapper,
    enabled: Any,
    owner: object,
    reuse: ForwardProxy | None = None,
) -> ForwardProxy:
    """Replace `module`'s instance `forward` by a proxy calling `wrapper`, marked with `owner`:
    `reuse` (the one installed last time) where it wraps what would be wrapped now (the class's
    forward, unchanged, bound to `module`), else a new one."""
    had_instance_forward = "forward" in module.__dict__
    if not had_instance_forward and reuse is not None and _wraps_class_forward(reuse, module):
        module.__dict__["forward"] = reuse
        return reuse
    original = module.__dict__["forward"] if had_instance_forward else bound_class_forward(module)
    kind = RootProxy if enabled is None else LayerProxy  # the root's: enabled is None
    proxy = kind(module, original, had_instance_forward, wrapper, enabled, owner)
    module.__dict__["forward"] = proxy
    return proxy


def bound_class_forward(module: nn.Module) -> Callable[..., Any]:
    """`module`'s class `forward` as `module.forward` gives it without an instance one: the
    class's attribute as stored, through its descriptor (a function bound, a staticmethod's
    function as it is, a classmethod bound to the class), or, a callable object that is not a
    descriptor, as it is. Read through the class (`type(module).forward`), a staticmethod
    gave its function, which was then bound to the module: every call passed the module as
    an extra first argument and raised TypeError in the user's step."""
    forward = inspect.getattr_static(type(module), "forward")
    return forward.__get__(module, type(module)) if hasattr(type(forward), "__get__") else forward


def forward_is_property(module: nn.Module) -> bool:
    """Whether `module`'s class holds `forward` as a data descriptor (a `property`, anything
    with `__set__` or `__delete__`): Python reads that before the instance `__dict__`, so a
    proxy installed there is never called, and the module's calls cannot be observed."""
    kind = type(inspect.getattr_static(type(module), "forward", None))
    return hasattr(kind, "__set__") or hasattr(kind, "__delete__")


def _wraps_class_forward(proxy: ForwardProxy, module: nn.Module) -> bool:
    """Whether `proxy` wraps `module`'s class's current `forward` as `bound_class_forward`
    gives it: a method bound to `module` cheaply, else (a staticmethod, a classmethod, whose
    bound methods are new at each lookup but equal, a callable object) by comparison."""
    if proxy._self_had_instance_forward:
        return False
    wrapped = proxy.__wrapped__
    if getattr(wrapped, "__self__", None) is module:
        return getattr(wrapped, "__func__", None) is type(module).forward
    now = bound_class_forward(module)
    return now is wrapped or (isinstance(now, MethodType) and now == wrapped)


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


WarnOnce = Callable[[str, str], None]


class Proxies:
    """Every proxy one observer puts on a model, and how each comes off again.

    The root's proxy stays from injection to removal. The layers' proxies (and fused-path guards)
    are registered once and installed per sampled forward: the first of several concurrent
    sampled forwards installs them and the last to end removes them, under one lock.

    Args:
        warn_once: reports a layer whose `forward` was replaced during a sampled forward.
    """

    def __init__(self, warn_once: WarnOnce) -> None:
        self._warn_once = warn_once
        self._token = Owner()  # marks our proxies among other observers' ones
        self._installed: list[weakref.ref[nn.Module]] = []
        # (module, layer name or "" for a fused-path guard, wrapper), installed per sampled forward;
        # the proxy each had last, reused while it wraps the same forward: building 3,000 proxies
        # (their dicts, bound methods) per sampled forward cost about 13 ms, and so many objects
        # living through the forward made Python's full collections more frequent.
        self._layers: list[tuple[weakref.ref[nn.Module], str, Wrapper]] = []
        self._last: list[ForwardProxy | None] = []
        self._lock = threading.Lock()
        self._holders: set[object] = set()  # the sampled forwards in flight that installed them
        self._left_in_place: list[Forward] = []  # layers whose proxy a replacement kept
        self._fused_root: weakref.ref[nn.Module] | None = None  # see `root_fused_path`

    def after_fork_in_child(self) -> None:
        """In a forked child: a lock of its own, since another thread of the parent may have
        held this one at the fork (a sampled forward's start or end), and `restore` takes it."""
        self._lock = threading.Lock()

    def register(
        self,
        observer: Any,
        root: nn.Module,
        layers: Sequence[tuple[nn.Module, LayerInfo]],
        focus: set[str],
    ) -> LayerCapture | None:
        """Register a `LayerCapture` per selected layer (`focus`: the focus layers' names) and a
        `FusedPathGuard` on every module that could skip selected layers with a fused kernel
        (the root, if it is one: `root_fused_path`); `observer` is the observer.Observer.
        Returns the root's capture where the root is itself a layer: the root's own proxy
        measures it, so it gets none here."""
        root_capture = None
        for module, info in layers:
            capture = LayerCapture(observer, module, info, info.name in focus)
            if module is root:
                root_capture = capture
            else:
                self.add_layer(module, info.name, capture.on_call)
        for _, module in fused_path_modules(root, layers):
            if module is root:
                self._fused_root = weakref.ref(root)
            else:
                self.add_layer(module, "", FusedPathGuard(observer, module).on_call)
        return root_capture

    def root_fused_path(self) -> contextlib.AbstractContextManager[None]:
        """Around a sampled root forward: the root's own fused fast path off, where it would skip
        selected layers (a bare nn.TransformerEncoderLayer observed itself). A guard proxy cannot
        do that for the root: it would go on top of the root's proxy, once the call is entered."""
        root = None if self._fused_root is None else self._fused_root()
        return contextlib.nullcontext() if root is None else layer_by_layer(root)

    def install_root(self, module: nn.Module, wrapper: Wrapper) -> None:
        """Install the root's proxy, which stays until `restore`."""
        install_proxy(module, wrapper, None, self._token)
        self._installed.append(weakref.ref(module))

    def follow_class_forward(self, module: nn.Module) -> Callable[..., Any]:
        """Make our proxy on `module` (the root's, which wraps its class's `forward` bound to it)
        wrap the one the class has now, and return that. The root's proxy stays for the whole
        run, so without this a class `forward` replaced after injection (a torch.fx
        GraphModule's `recompile()`, which sets it on the module's own class;
        `type(model).forward = ...`; a new `__class__`) would never run: the model would keep
        computing the old one until removal. The proxy is found from the module, never held:
        the observer holding it would keep a dropped model alive (`weakref.finalize` holds the
        observer)."""
        bound = bound_class_forward(module)
        current = module.__dict__.get("forward")
        while isinstance(current, ForwardProxy):  # ours, or another's (a chain) holding ours
            if current._self_token is self._token:
                current.__wrapped__ = bound
                break
            current = current.__wrapped__
        return bound

    def add_layer(self, module: nn.Module, name: str, wrapper: Wrapper) -> None:
        """Register a layer's proxy (`name` "" for a guard); installed by `install_layers`."""
        self._layers.append((weakref.ref(module), name, wrapper))
        self._last.append(None)

    def install_layers(self, enabled: Any, holder: object) -> None:
        """Put every layer's proxy on when the first concurrent sampled forward (`holder`) starts."""
        with self._lock:
            first = not self._holders
            self._holders.add(holder)
            if not first:
                return
            last = self._last
            for index, (module_ref, _, wrapper) in enumerate(self._layers):
                module = module_ref()
                if module is not None:
                    last[index] = install_proxy(module, wrapper, enabled, self._token, last[index])

    def restore_layers(self, holder: object) -> None:
        """Take the layers' proxies off when the last concurrent sampled forward ends; `holder`
        is that forward's sample. Idempotent: a holder that is not (or no longer) one changes
        nothing, so a sample's end cut by an interrupt can be finished later."""
        with self._lock:
            if holder not in self._holders:
                return
            self._holders.discard(holder)
            if not self._holders:
                self._take_layers_off()

    def _take_layers_off(self) -> None:
        """Restore every layer's forward (the caller holds the lock)."""
        for module_ref, name, _ in reversed(self._layers):
            module = module_ref()
            if module is not None and not restore_proxy(module, self._token):
                # Replaced or wrapped during the forward: left in place, inert once closed.
                self._left_in_place.append(("layer", name) if name else ("", type(module).__name__))
                self._warn_once(
                    f"replaced:{name}",
                    f"the forward of {name or type(module).__name__!r} was replaced during a "
                    "sampled forward; the replacement is kept, with the observer's proxy "
                    "inside it (inert after removal)",
                )

    def restore(self) -> tuple[Forward, ...]:
        """Undo the root's proxy, and the layers' where a sampled forward left them on (removed
        during it, or its end cut by an interrupt); returns the forwards whose proxy was left in
        place, because someone replaced or wrapped it (see `left_in_place_note`)."""
        with self._lock:
            if self._holders:
                self._holders.clear()
                self._take_layers_off()
        released = release(self._token)  # forwards rebuilt from a proxy's `__func__` skip it
        left_in_place: list[Forward] = []
        for module_ref in reversed(self._installed):
            module = module_ref()
            if module is None:
                continue
            _let_go(module, self._token)
            if not restore_proxy(module, self._token) and not rebuilt_from(
                module.__dict__.get("forward"), released
            ):
                left_in_place.append(("root", type(module).__name__))
            rebound_plainly(module, released)
        self._installed.clear()
        self._last = [None] * len(self._last)  # the layers' modules are not held after removal
        return (*left_in_place, *dict.fromkeys(self._left_in_place))


def _let_go(module: nn.Module, owner: object) -> None:
    """Put what our proxy wraps wherever `module`'s own attributes other than `forward` hold the
    proxy: accelerate keeps the forward it rebuilds from as `_original_forward`, and would have
    kept the model's own forward there without the observer."""
    for key, value in list(module.__dict__.items()):
        if key != "forward" and isinstance(value, ForwardProxy) and value._self_token is owner:
            module.__dict__[key] = value.__wrapped__


class LayerCapture:
    """The wrapper behind one selected layer's proxy; runs only during sampled forwards.

    `observer` is the observer.Observer (its `record_output`, recording.py's, measures what the
    layer returned), and a sample is a samples.Sample; neither is imported here, both live above
    this module.
    """

    __slots__ = ("focus", "info", "lazy", "module_ref", "observer")

    def __init__(self, observer: Any, module: nn.Module, info: LayerInfo, focus: bool) -> None:
        self.observer = observer
        self.module_ref = weakref.ref(module)
        self.info = info
        self.focus = focus
        self.lazy = isinstance(module, LazyModuleMixin)  # its class may change: read per call

    def on_call(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        """Assign the call_index, run the forward, measure what it returned, return it as is.

        A call the autograd engine makes during a backward pass (checkpointing recomputing a
        block, inside a forward that runs `torch.autograd.grad` itself) is torch's recomputation
        of a call already measured, not a call of the layer: it runs unobserved.
        """
        if ran_by_a_backward():
            return wrapped(*args, **kwargs)
        observer = self.observer
        sample = observer.current
        if sample is None:  # no sampled forward of this thread: maybe another thread's
            return self.borrowed_call(wrapped, args, kwargs)
        if not observer.capture_direct_forwards and not called_through_module_call():
            return wrapped(*args, **kwargs)
        return self.measured_call(sample, wrapped, args, kwargs)

    def measured_call(
        self,
        sample: Any,
        wrapped: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        borrowed: bool = False,
    ) -> Any:
        """One call of this layer inside `sample`: its call_index, where it raised, what it
        returned. A `borrowed` call (another thread's, `borrowed_call`) is recorded only while
        `sample` is still in flight (`samples.InFlight.record`)."""
        if self.lazy and (module := self.module_ref()) is not None:
            if (now := module_type(module)) != self.info.module_type:  # materialised
                self.retype(now)
            self.lazy = isinstance(module, LazyModuleMixin)
        call_index = sample.next_call_index(self.info.name)
        try:
            output = wrapped(*args, **kwargs)
        except BaseException as error:
            sample.layer_raised(self.info, self.mode, call_index, error)
            raise
        if not borrowed:
            sample.returned.add(self.info.name)
            self.observer.record_output(sample, self, call_index, output)
            return output

        def record() -> None:
            sample.returned.add(self.info.name)
            self.observer.record_output(sample, self, call_index, output)

        self.observer.in_flight.record(sample, record)
        return output

    def borrowed_call(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A call on a thread without a sampled forward of its own: measured in the one sampled
        forward in flight, if there is exactly one (see samples.py), else run as is."""
        observer = self.observer
        if not observer.capture_direct_forwards and not called_through_module_call(3):
            return wrapped(*args, **kwargs)
        sample = observer.sample_in_flight(count=True)
        if sample is None:
            return wrapped(*args, **kwargs)
        return self.measured_call(sample, wrapped, args, kwargs, borrowed=True)

    def traced(self) -> None:
        """Dynamo traced a call of this layer into a graph (a higher-order op's body): that call
        runs unmeasured, and the run says so (`compilation.TracedLayers`)."""
        self.observer.traced.add(self.info.name)

    def retype(self, now: str) -> None:
        """The layer's class changed since injection (`nn.LazyLinear` becomes `nn.Linear` at its
        first call): its rows give the class it has when measured, and index.md says so once
        per layer (its Layers table keeps the class at injection)."""
        before, self.info = self.info.module_type, LayerInfo(self.info.name, now)
        note = f"{layer_span(self.info.name)} ({before} at injection, {now} when measured)"
        notes = self.observer.notes
        for i, said in enumerate(notes):
            if said.startswith(RETYPED):
                if note not in said and said.count(" when measured)") < _RETYPED_SHOWN:
                    notes[i] = f"{said}, {note}"
                return
        notes.append(f"{RETYPED}{note}")

    def mode(self) -> str:
        """`train` or `eval`, read from the module at call time."""
        module = self.module_ref()
        return "train" if module is None or module.training else "eval"


def by_module_call(root_ref: Callable[[], nn.Module | None] | None) -> bool:
    """Whether the root forward now starting came through `nn.Module.__call__` (for
    capture_direct_forwards=False; `root_ref`: the root's weak reference): the root proxy's
    caller, or, where the root's `forward` is no longer the proxy but calls it (one rebuilt from
    the proxy's `__func__`, rebuilt_forwards.py; a wrapper the user set after inject), that
    forward's own caller. Called by the observer's classification of a root call."""
    # called_through_module_call, by_module_call, _begin_root_forward, on_root_call: the
    # proxy's caller is at depth 4 (wrapt's frames, where it has any, skipped).
    if called_through_module_call(4):
        return True
    root = root_ref() if root_ref is not None else None
    forward = None if root is None else root.__dict__.get("forward")
    if forward is None or isinstance(forward, ForwardProxy):  # the proxy: called directly
        return False
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return isinstance(code, CodeType) and caller_of_code_is_module_call(code)
