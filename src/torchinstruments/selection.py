"""Which modules are observed (layers) and which of them get histograms (focus layers).

The default rule, meant to be predicted by reading it: the modules that compute, in
`named_modules()` traversal order. That is every leaf module (a module with no children; one
without a forward, such as an empty `ModuleList`, or an empty `nn.Sequential`, computes
nothing and is not one; children in which nothing computes, such as an `nn.ParameterList`
the module indexes, do not count), plus each module that uses some of its children only through what
they hold, never calling them (its methods outside `__init__` read `self.<child>.weight`,
`self.<child>.p` and the like, a parameter slot registered as None such as a bias-free
projection's `bias` included, and nothing else of the child: `parameter_holders`): it hands
their weights or settings to a functional kernel, so it is the layer and those children are
not (its other children keep the rule; so does a held child another module registers too and
may call, as a model calls the embedding a tied output head holds for its weight, under the name
`named_modules()` gives it, and one a module above its holder uses itself, as the model's
`self.encoder.embed(ids)` where the encoder only reads `self.embed.weight`). `nn.MultiheadAttention` does this with `out_proj`,
torchvision's Swin attention with `qkv` and `proj`, Hugging Face's Mamba mixer with `conv1d`
and `dt_proj`, torch's quantized Linear (dynamic or static) and Embedding with the
`_packed_params` holding their packed weights (what such a holder holds includes its own
methods, through which they are read: `_packed`), and its BERT attention (SDPA, or its eager function) with the dropout whose
rate it passes: a leaf-only rule would record nothing of them and name as layers children
that never run. A child that holds no tensor (a dropout) and whose settings `forward` reads
without calling it is held too, though another method calls it: Hugging Face's GPT-2
attention passes `attn_dropout`'s rate to SDPA or its eager function on every call, and calls
the module only in its upcast-and-reorder path (`reorder_and_upcast_attn`, off by default), so
as a layer it would never run, and every default run would warn that it never ran. The rule reads the methods' source, once per class; a class without source
falls back to the leaf rule. A module parametrized with `torch.nn.utils.parametrize`
(`parametrizations.weight_norm`, as Hugging Face's wav2vec2 convolution is, `spectral_norm`,
`orthogonal`) is a layer when its parametrizations are its only children, and they are never
layers: they compute its weights, not activations, and a leaf-only rule would record the
weights as outputs and nothing of the module. TorchScript
modules are never layers, nor the modules inside them (their `forward` cannot be replaced): a
model that holds some is observed around them, and the run names them (`torchscript_note`, in
index.md and a warning). Nor is a module whose class defines `forward` as a property: a
data descriptor is read before the instance `forward` the observer would install, so its calls
cannot be seen (the modules inside it are layers as usual; `property_note`). `selector=`
overrides the rule;
focus layers are the first `max_histogram_modules` layers that `histogram_selector` accepts
(default: all). A `torch.compile(module)` wrapper (OptimizedModule) is looked through: the
module it compiles is offered in its place, under the name it has in the eager model
(`blocks.0.fc`, not `blocks.0._orig_mod.fc`), so a compiled model has the layers and layer
names of the eager one.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from torchinstruments._torch_internals import child_modules, registered_tensor_slots
from torchinstruments.capture import forward_is_property
from torchinstruments.compilation import named_modules_uncompiled
from torchinstruments.reasons import utf8_text
from torchinstruments.records import LayerInfo, module_type
from torchinstruments.rundir.ranges import listed
from torchinstruments.rundir.shell import error_said
from torchinstruments.sampling import as_decision

__all__ = [
    "Selector",
    "check_selector",
    "default_layers",
    "parameter_holders",
    "property_note",
    "select_focus_layers",
    "select_layers",
    "switched_off",
]

Selector = Callable[[str, nn.Module], bool]
_MODULE_STATE = frozenset(vars(nn.Module()))  # what every module holds for torch itself


def check_selector(name: str, selector: object) -> None:
    """A selector is None or a callable `(name, module) -> bool`.

    A class (`selector=nn.Linear`) is callable too, and a one-argument function can be called:
    both would fail only when the selector first runs, with torch's or Python's message about
    something else, so both are refused here, with the form to write instead.
    """
    if selector is None:
        return
    example = f"{name}=lambda name, module: isinstance(module, nn.Linear)"
    if isinstance(selector, type):
        raise TypeError(
            f"{name}={selector.__name__} is a class, not a function (name, module) -> bool: "
            f"write {name}=lambda name, module: isinstance(module, {selector.__name__})"
        )
    if not callable(selector):
        raise TypeError(
            f"{name} must be a function (name, module) -> bool or None, got {selector!r}: "
            f"e.g. {example}"
        )
    try:
        signature = inspect.signature(selector)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    try:
        signature.bind("name", nn.Module())
    except TypeError:
        raise TypeError(
            f"{name}={getattr(selector, '__name__', repr(selector))}{signature} cannot be "
            f"called as {name}(name, module), with the layer's name and module: e.g. {example}"
        ) from None


def parameter_holders(module: nn.Module) -> list[str]:
    """The children `module` uses only through what they hold, never calling them: its own
    methods (outside `__init__`) read `self.<child>.<name>` of the child's parameters, buffers
    or plain settings (a dropout's `p`) and nothing else of the child. Such a module hands
    those to a functional kernel (`nn.MultiheadAttention` its `out_proj`'s weights, a Hugging
    Face BERT attention its dropout's rate), so it is the layer. So is a child holding no
    tensor whose settings the module's `forward` reads without calling it, even where another
    method calls it on a path `forward` rarely takes (GPT-2's `attn_dropout`): the rate goes to
    the kernel on every call, and the child, as a layer, would never run in a default run."""
    children = dict(module.named_children())
    if not children:
        return []
    uses = _attribute_uses(type(module), frozenset(children))
    in_forward = _forward_uses(type(module), frozenset(children))
    return [
        name
        for name, child in children.items()
        if ((read := uses.get(name)) and read <= _held(child))  # None: used otherwise
        or (
            (passed := in_forward.get(name))
            and passed <= _settings(child)
            and _holds_no_tensor(child)
        )
    ]


def _holds_no_tensor(module: nn.Module) -> bool:
    """Whether a module holds no parameter or buffer (a dropout): its settings are all it is."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def _held(module: nn.Module) -> frozenset[str]:
    """What a module holds itself: parameters and buffers (a slot registered as None, such as a
    bias-free projection's `bias`, included), parametrized tensors, and plain settings."""
    names = set(registered_tensor_slots(module))
    if parametrize.is_parametrized(module):
        names |= {name for name, _ in module.get_submodule("parametrizations").named_children()}
    held = frozenset(name for name in names if not name.startswith("_")) | _settings(module)
    return held | _packed(module)


def _packed(module: nn.Module) -> frozenset[str]:
    """What a holder of packed weights holds: torch's quantized Linear keeps its weights in a
    `_packed_params` child (a `torch.ScriptObject` in it, and a forward that returns its input)
    whose packed object, dtype and own methods (`_weight_bias`, `set_weight_bias`) the Linear
    reads to hand the weights to its kernel. Empty for a module holding no packed object (a
    TorchScript module's own `_c` is a `torch.ScriptModule`, not one)."""
    state = vars(module)
    if not any(type(value) is torch.ScriptObject for value in state.values()):
        return frozenset()
    classes = [klass for klass in type(module).__mro__ if klass not in (nn.Module, object)]
    own = {name for klass in classes for name in vars(klass)} - {"forward"}
    return frozenset(own | {name for name in state if name not in _MODULE_STATE})


def _settings(module: nn.Module) -> frozenset[str]:
    """A module's plain settings: its own public attributes that are numbers, strings or None
    (a dropout's `p`)."""
    plain = (bool, int, float, str, type(None))
    return frozenset(
        name
        for name, value in vars(module).items()
        if isinstance(value, plain) and not name.startswith("_")
    )


@functools.lru_cache(maxsize=1024)
def _forward_uses(cls: type, names: frozenset[str]) -> dict[str, frozenset[str] | None]:
    """`_attribute_uses` of the class's `forward` alone (the one `cls` runs): a child whose
    settings it reads without calling the child has that setting handed to a kernel on every
    call, whatever other methods do with the child on another path (Hugging Face's GPT-2
    attention passes its `attn_dropout`'s rate to SDPA or its eager function, and calls it only
    in its upcast-and-reorder path, off by default). Empty where it cannot be read."""
    reads: dict[str, set[str] | None] = {}
    try:
        forward = inspect.getattr_static(cls, "forward", None)
        if forward is None or forward is nn.Module.forward:
            return {}
        for function in _functions(forward):
            if names & _code_names(function.__code__):
                tree = _parsed(function)
                _read_self_attributes(tree, names, reads, init=False)
    except Exception:  # no source (OSError), unparsable, or unreadable members
        return {}
    return {name: None if read is None else frozenset(read) for name, read in reads.items()}


@functools.lru_cache(maxsize=1024)
def _attribute_uses(cls: type, names: frozenset[str]) -> dict[str, frozenset[str] | None]:
    """Per attribute `self.<name>` of `names` in the methods of `cls` and its bases (torch.nn
    Module's and containers' aside): the attributes read on it outside `__init__`, or None where
    it is used otherwise (called, passed, aliased, indexed). Assignments are not uses. Only a
    method whose bytecode names one of `names` is parsed. Empty where such a method's source is
    missing, or the class cannot be read (a member whose `__wrapped__` chain loops, say): the leaf
    rule applies, and injection never fails on a model for its selection."""
    reads: dict[str, set[str] | None] = {}
    try:
        for method, tree in _method_trees(cls, names, init=True):
            _read_self_attributes(tree, names, reads, init=method == "__init__")
    except Exception:  # no source (OSError), unparsable, or unreadable members
        return {}
    return {name: None if read is None else frozenset(read) for name, read in reads.items()}


def _method_trees(cls: type, names: frozenset[str], *, init: bool) -> Iterator[tuple[str, ast.AST]]:
    """Each method of `cls` and its bases (torch.nn Module's and containers' aside) whose
    bytecode names one of `names`, `__init__` only with `init`: its name and parsed source.
    Raises what reading or parsing a source raises."""
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__ == "torch.nn.modules.container":
            continue
        for method, member in vars(klass).items():
            if method == "__init__" and not init:
                continue
            for function in _functions(member):
                if names & _code_names(function.__code__):
                    yield method, _parsed(function)


@functools.lru_cache(maxsize=1024)
def _parsed(function: types.FunctionType) -> ast.AST:
    """A function's parsed source, once (the rules below read a method several times); raises
    what reading or parsing it raises. The trees are only read, never changed."""
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _functions(member: object) -> list[types.FunctionType]:
    """The plain functions behind a class member (a method, a property's accessors, a static
    or class method), unwrapped from their decorators."""
    if isinstance(member, property):
        found: list[object] = [member.fget, member.fset, member.fdel]
    else:
        found = [getattr(member, "__func__", member)]
    unwrapped = (inspect.unwrap(item) for item in found if callable(item))
    return [item for item in unwrapped if isinstance(item, types.FunctionType)]


def _code_names(code: types.CodeType) -> frozenset[str]:
    """The attribute and global names a code object and those nested in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _code_names(constant)
    return frozenset(names)


def _read_self_attributes(
    tree: ast.AST, names: frozenset[str], reads: dict[str, set[str] | None], init: bool
) -> None:
    """Adds one method's uses of `self.<name>` to `reads` (see `_attribute_uses`)."""
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(node.ctx, ast.Store):
            continue
        holder = node.value
        if isinstance(holder, ast.Attribute) and isinstance(holder.value, ast.Name):
            if holder.value.id == "self" and holder.attr in names and not init:
                found = reads.setdefault(holder.attr, set())  # `self.<name>.<attribute>`
                if found is not None:
                    found.add(node.attr)
        elif isinstance(holder, ast.Name) and holder.id == "self" and id(node) not in inner:
            reads.update(dict.fromkeys({node.attr} & names))  # itself: called, passed, aliased


def switched_off(module: nn.Module) -> dict[str, str]:
    """The children `module` calls only under a setting of its own that is now false: each is
    named with that setting (`use_res_connect` for torchvision's MBConv `stochastic_depth`,
    `training` for Inception's `AuxLogits` in eval). Every use of such a child in the class's
    methods (outside `__init__`) is a call `self.<child>(...)`, or of its method (the
    quantizable MobileNetV2's `self.skip_add.add(x, y)`), inside `if self.<setting>:`, or a
    test `self.<child> is None` / `is not None`; a child used any other way is not named, nor
    is one under a setting that is not a plain bool. Read from the source, once per class;
    empty where it cannot be read."""
    children = frozenset(name for name, _ in module.named_children())
    if not children:
        return {}
    found: dict[str, str] = {}
    for child, settings in _guarded_calls(type(module), children).items():
        values = [getattr(module, setting, None) for setting in settings]
        if settings and all(value is False for value in values):
            found[child] = settings[0]
    return found


@functools.lru_cache(maxsize=1024)
def _guarded_calls(cls: type, names: frozenset[str]) -> dict[str, tuple[str, ...]]:
    """Per child of `names` whose every use in the methods of `cls` is a guarded call (see
    `switched_off`): the settings guarding its calls; a child used otherwise is left out."""
    guards: dict[str, set[str] | None] = {}
    try:
        for _, tree in _method_trees(cls, names, init=False):
            _guarded_uses(tree, names, guards)
    except Exception:  # no source (OSError), unparsable, or unreadable members
        return {}
    return {name: tuple(sorted(found)) for name, found in guards.items() if found}


def _self_attribute(node: ast.AST) -> str | None:
    """`x` for a node `self.x`, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr if node.value.id == "self" else None
    return None


def _guarded_uses(tree: ast.AST, names: frozenset[str], guards: dict[str, set[str] | None]) -> None:
    """Adds one method's uses of `self.<name>` to `guards`: the setting of the innermost
    `if self.<setting>:` around each call, None for any other use (see `switched_off`)."""
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        name = _self_attribute(node)
        if name not in names or isinstance(getattr(node, "ctx", None), ast.Store):
            continue
        parent = parents.get(id(node))
        if isinstance(parent, ast.Compare) and all(
            isinstance(op, ast.Is | ast.IsNot) for op in parent.ops
        ):
            continue  # `self.<child> is None`: a test, not a use
        setting = None
        if isinstance(parent, ast.Attribute):  # `self.<child>.<method>(...)`: a call too
            node, parent = parent, parents.get(id(parent))
        if isinstance(parent, ast.Call) and parent.func is node:
            inner: ast.AST = parent
            while (above := parents.get(id(inner))) is not None:
                if isinstance(above, ast.If) and any(inner is item for item in above.body):
                    setting = _self_attribute(above.test)
                    break
                inner = above
        found = guards.setdefault(name, set())
        if setting is None or found is None:
            guards[name] = None
        else:
            found.add(setting)


def _computes(module: nn.Module) -> bool:
    """Whether a leaf computes: not a module without a forward (an empty `ModuleList` or
    `ModuleDict`, a bare holder of parameters), nor an empty `nn.Sequential`, which returns its
    input (ShuffleNetV2's `branch1` in its stride-1 blocks, never called). The class's `forward`
    is read without running a descriptor (TorchScript's raises when read from the class)."""
    forward = inspect.getattr_static(type(module), "forward", None)
    return "forward" in vars(module) or forward not in (nn.Module.forward, nn.Sequential.forward)


def _computes_within(module: nn.Module) -> bool:
    """Whether `module` or a module inside it computes (`_computes`; TorchScript does). A
    module in which none does holds tensors only (`nn.ParameterList`, `nn.ParameterDict`, a
    `ModuleList` of parameter holders): its parent, which indexes or iterates it and computes
    with what it holds, is then a leaf for the rule, as a parent of no children is."""
    return any(
        isinstance(inner, torch.jit.ScriptModule) or _computes(inner) for inner in module.modules()
    )


def torchscript_modules(model: nn.Module) -> list[str]:
    """The outermost TorchScript submodules of `model` (a part of it given to `torch.jit.script`
    or `torch.jit.trace`), in traversal order: they and the modules inside them are never
    layers."""
    found: list[str] = []
    for name, module in named_modules_uncompiled(model):
        inside = any(name.startswith(f"{outer}.") for outer in found)
        if isinstance(module, torch.jit.ScriptModule) and not inside:
            found.append(name)
    return found


def torchscript_note(model: nn.Module) -> tuple[str, ...]:
    """What a run of `model` says about its TorchScript submodules (index.md and a warning at
    inject), empty when it has none: they compute without their outputs being recorded."""
    names = torchscript_modules(model)
    if not names:
        return ()
    count = f"{len(names)} submodule{'s are' if len(names) > 1 else ' is'}"
    return (
        f"TorchScript: {count} TorchScript (torch.jit.script or trace), whose forward cannot be "
        f"replaced, so neither {'they' if len(names) > 1 else 'it'} nor the modules inside have "
        f"rows: {listed(names, quote=True)}; observe the eager modules to record them",
    )


def property_note(model: nn.Module) -> tuple[str, ...]:
    """What a run of `model` says about its modules whose class defines `forward` as a property
    (index.md and a warning at inject), empty when it has none: they compute (the modules
    inside them are observed as any others) without their own outputs being recorded."""
    names = [
        name for name, module in named_modules_uncompiled(model) if forward_is_property(module)
    ]
    if not names:
        return ()
    return (
        "forward as a property: modules whose class defines `forward` as a property (a data "
        "descriptor, which Python reads before the instance `forward` the observer installs) "
        "cannot have their calls observed, so they are never layers (the modules inside them "
        f"are): {listed(names, quote=True)}; define `forward` as a method (it may call what the "
        "property returns) to record them",
    )


def default_layers(model: nn.Module) -> set[str]:
    """Names of the modules the default rule selects (see the module docstring)."""
    chosen: set[str] = set()
    skipped: set[str] = set()  # subtrees of no layers: uncalled children, parametrizations
    modules = dict(named_modules_uncompiled(model))  # one walk, in traversal order
    registrations = _registrations(modules.values())
    for name, module in modules.items():
        parts = name.split(".")
        if any(".".join(parts[:end]) in skipped for end in range(1, len(parts) + 1)):
            continue  # inside a skipped subtree (a lookup per ancestor, not per subtree)
        if isinstance(module, torch.jit.ScriptModule):  # never a layer, nor what it holds
            skipped.add(name)
            continue
        # A child in which nothing computes (a ParameterList, a ModuleList of parameter
        # holders without a forward) only holds what the module computes with.
        children = [child for child, sub in module.named_children() if _computes_within(sub)]
        if parametrize.is_parametrized(module):  # its parametrizations compute its weights
            children.remove("parametrizations")
            skipped.add(f"{name}.parametrizations" if name else "parametrizations")
        if held := parameter_holders(module):  # it computes with their weights: the layer
            children_by_name = dict(child_modules(module))
            skipped.update(
                path
                for child in held
                if not _called_elsewhere(children_by_name[child], module, registrations)
                and not _used_from_above(path := f"{name}.{child}" if name else child, modules)
            )
            chosen.add(name)
        elif not children and _computes(module):
            chosen.add(name)
    return chosen


def _registrations(modules: Iterable[nn.Module]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every place each module is registered as a child of one of `modules` (a model's),
    `(parent, attribute)`, by the child's id: a module shared by two parents has two."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in modules:
        for attribute, child in child_modules(parent):
            found.setdefault(id(child), []).append((parent, attribute))
    return found


def _called_elsewhere(
    child: nn.Module, holder: nn.Module, registrations: dict[int, list[tuple[nn.Module, str]]]
) -> bool:
    """Whether `child`, which `holder` uses only through what it holds, is also the child of
    another module that does not hold it so and may call it (an embedding a tied output head
    holds for its weight, which the model calls under its own name): it keeps the leaf rule."""
    return any(
        parent is not holder and attribute not in parameter_holders(parent)
        for parent, attribute in registrations.get(id(child), ())
    )


def _used_from_above(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether a module above the holder of the child `name` uses that child itself through a
    chain of attributes (the model's `self.encoder.embed(ids)`, where the encoder only reads
    `self.embed.weight`): called there, it keeps the leaf rule."""
    parts = tuple(name.split("."))
    for end in range(len(parts) - 1):  # the root down to the holder's parent
        chain = parts[end:]
        if not all(part.isidentifier() for part in chain):
            continue  # through a container's index (`layers.0`): no attribute chain reaches it
        ancestor = modules.get(".".join(parts[:end]))
        if ancestor is not None and _uses_chain(type(ancestor), chain):
            return True
    return False


def _uses_chain(cls: type, chain: tuple[str, ...]) -> bool:
    """Whether a method of `cls` (outside `__init__`) uses `self.<chain>` itself (calls it,
    passes it on), not only an attribute of it; False where the source cannot be read."""
    return chain in _chains_used(cls, chain[-1])


@functools.lru_cache(maxsize=1024)
def _chains_used(cls: type, last: str) -> frozenset[tuple[str, ...]]:
    """The chains `self.a....<last>` the methods of `cls` (outside `__init__`) use themselves,
    read from the source once per class and name; empty where it cannot be read."""
    found: set[tuple[str, ...]] = set()
    try:
        for _, tree in _method_trees(cls, frozenset((last,)), init=False):
            inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == last
                    and id(node) not in inner
                    and not isinstance(node.ctx, ast.Store)
                    and (chain := _chain_of(node)) is not None
                ):
                    found.add(chain)
    except Exception:  # no source (OSError), unparsable, or unreadable members
        return frozenset()
    return frozenset(found)


def _chain_of(node: ast.Attribute) -> tuple[str, ...] | None:
    """`("a", "b")` for a node `self.a.b`, else None."""
    names: list[str] = []
    current: ast.AST = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    is_self = isinstance(current, ast.Name) and current.id == "self"
    return tuple(reversed(names)) if is_self else None


def select_layers(model: nn.Module, selector: Selector | None) -> list[tuple[nn.Module, LayerInfo]]:
    """Selected modules in `named_modules()` traversal order; default: `default_layers`."""
    default = default_layers(model) if selector is None else set()
    layers = []
    offered = []
    for name, module in named_modules_uncompiled(model):
        offered.append(name)
        chosen = (
            _ask("selector", selector, name, module) if selector is not None else name in default
        )
        # Never a layer: TorchScript, and a forward property, whose calls cannot be seen.
        if (
            chosen
            and not isinstance(module, torch.jit.ScriptModule)
            and not forward_is_property(module)
        ):
            layers.append((module, LayerInfo(utf8_text(name), module_type(module))))
    if not layers:
        # A run that observes nothing would end "complete (0 rows)": refuse it at injection.
        which = "selector matched" if selector is not None else "the default selection found"
        raise ValueError(
            f"{which} no module of the model, so nothing would be observed: pass a selector "
            f"that accepts some of its modules: {listed(offered, quote=True)} (TorchScript modules, "
            "and modules whose forward is a property, are never layers)"
        )
    return layers


def _ask(argument: str, selector: Selector, name: str, module: nn.Module) -> bool:
    """The selector's answer for one module, asked once at inject.

    Its exception is re-raised as a ValueError naming the argument and the module; an answer
    that is not a bool (a NumPy bool or a 0-d bool tensor is, as for a sampler's answers) is
    refused instead of read with `bool()`, which would take "no" for True and raise on a tensor
    of several values.
    """
    where = f"module {name!r} ({type(module).__name__})"
    try:
        answer = selector(name, module)
    except Exception as error:
        raise ValueError(
            f"{argument} raised {error_said(error)} when asked about {where}: it is "
            f"called with every module's name and module and must return a bool for each"
        ) from error
    decision = as_decision(answer)
    if decision is None:
        raise TypeError(
            f"{argument} returned {answer!r} for {where}; it must return a bool (True to "
            "select the module)"
        )
    return decision


def select_focus_layers(
    model: nn.Module,
    layers: Sequence[tuple[nn.Module, LayerInfo]],
    histogram_selector: Selector | None,
    max_histogram_modules: int,
) -> set[str]:
    """Focus layers: the first `max_histogram_modules` observed layers the selector accepts.

    The selector is asked with each module's own name, as `selector` is, not with the name as
    the run writes it (`utf8_text`: a lone surrogate escaped), which a selector written with
    the module's name did not match."""
    names = {id(module): name for name, module in named_modules_uncompiled(model)}
    candidates = [
        info.name
        for module, info in layers
        if histogram_selector is None
        or _ask("histogram_selector", histogram_selector, names.get(id(module), info.name), module)
    ]
    if histogram_selector is not None and not candidates:
        raise ValueError(
            "histogram_selector matched no observed layer: pass one that accepts some of the "
            "observed layers (or None, for the first ones): "
            + listed([info.name for _, info in layers], quote=True)
        )
    return set(candidates[:max_histogram_modules])
