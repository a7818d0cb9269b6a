"""Which modules are observed (layers) and which of them get histograms (focus layers).

The default rule, meant to be predicted by reading it: the modules that compute, in
`named_modules()` traversal order. That is every leaf module (a module with no children), plus
each module whose children are parameter holders it never calls as modules, in which case the
module is the layer and those children are not. The one such module in torch is
`nn.MultiheadAttention` (and subclasses that keep its `forward`): it passes `out_proj.weight` to
the functional attention kernel and never calls `out_proj`, so a leaf-only rule would record
nothing of attention, and `out_proj` would be a layer that never runs. A module parametrized
with `torch.nn.utils.parametrize` (`parametrizations.weight_norm`, as Hugging Face's wav2vec2
convolution is, `spectral_norm`, `orthogonal`) is a layer when its parametrizations are its only
children, and they are never layers: they compute its weights, not activations, and a leaf-only
rule would record the weights as outputs and nothing of the module. TorchScript modules are
never layers (their `forward` cannot be replaced). `selector=` overrides the rule; focus layers
are the first `max_histogram_modules` layers that `histogram_selector` accepts (default: all). A
`torch.compile(module)` wrapper (OptimizedModule) is looked through: the module it compiles is
offered in its place, under the name it has in the eager model (`blocks.0.fc`, not
`blocks.0._orig_mod.fc`), so a compiled model has the layers and layer names of the eager one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from torchinstruments.compilation import named_modules_uncompiled
from torchinstruments.records import LayerInfo

__all__ = [
    "Selector",
    "check_selector",
    "default_layers",
    "holds_uncalled_children",
    "select_focus_layers",
    "select_layers",
]

Selector = Callable[[str, nn.Module], bool]


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


def holds_uncalled_children(module: nn.Module) -> bool:
    """True for a module whose children are parameter holders its forward never calls."""
    return (
        isinstance(module, nn.MultiheadAttention)
        and type(module).forward is nn.MultiheadAttention.forward
    )


def default_layers(model: nn.Module) -> set[str]:
    """Names of the modules the default rule selects (see the module docstring)."""
    chosen: set[str] = set()
    skipped: list[str] = []  # subtrees of no layers: uncalled children, parametrizations
    for name, module in named_modules_uncompiled(model):
        if any(name == top or name.startswith(f"{top}.") for top in skipped):
            continue
        children = [child for child, _ in module.named_children()]
        if holds_uncalled_children(module):
            skipped += [f"{name}.{child}" if name else child for child in children]
            chosen.add(name)
            continue
        if parametrize.is_parametrized(module):  # its parametrizations compute its weights
            children.remove("parametrizations")
            skipped.append(f"{name}.parametrizations" if name else "parametrizations")
        if not children:
            chosen.add(name)
    return chosen


def select_layers(model: nn.Module, selector: Selector | None) -> list[tuple[nn.Module, LayerInfo]]:
    """Selected modules in `named_modules()` traversal order; default: `default_layers`."""
    default = default_layers(model) if selector is None else set()
    layers = []
    offered = []
    for name, module in named_modules_uncompiled(model):
        offered.append(name)
        chosen = selector(name, module) if selector is not None else name in default
        if chosen and not isinstance(module, torch.jit.ScriptModule):
            layers.append((module, LayerInfo(name, type(module).__name__)))
    if not layers:
        # A run that observes nothing would end "complete (0 rows)": refuse it at injection.
        which = "selector matched" if selector is not None else "the default selection found"
        raise ValueError(
            f"{which} no module of the model, so nothing would be observed: pass a selector "
            f"that accepts some of its modules: {_listed(offered)} (TorchScript modules are "
            "never layers)"
        )
    return layers


def _listed(names: Sequence[str], limit: int = 20) -> str:
    """Names for an error message: the first `limit`, quoted, then how many more."""
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


def select_focus_layers(
    layers: Sequence[tuple[nn.Module, LayerInfo]],
    histogram_selector: Selector | None,
    max_histogram_modules: int,
) -> set[str]:
    """Focus layers: the first `max_histogram_modules` observed layers the selector accepts."""
    candidates = [
        info.name
        for module, info in layers
        if histogram_selector is None or histogram_selector(info.name, module)
    ]
    if histogram_selector is not None and not candidates:
        raise ValueError(
            "histogram_selector matched no observed layer: pass one that accepts some of the "
            "observed layers (or None, for the first ones): "
            + _listed([info.name for _, info in layers])
        )
    return set(candidates[:max_histogram_modules])
