"""Which modules are observed (layers) and which of them get histograms (focus layers).

The default rule, meant to be predicted by reading it: every leaf module (a module with no
children) is a layer, in `named_modules()` traversal order. TorchScript modules are never layers
(their `forward` cannot be replaced). `selector=` overrides the rule; focus layers are the first
`max_histogram_modules` layers that `histogram_selector` accepts (default: all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from torchinstruments.records import LayerInfo

Selector = Callable[[str, nn.Module], bool]


def check_selector(name: str, selector: object) -> None:
    """A selector is None or a callable `(name, module) -> bool`."""
    if selector is not None and not callable(selector):
        raise TypeError(
            f"{name} must be a callable (name, module) -> bool or None, got {selector!r}"
        )


def is_default_layer(name: str, module: nn.Module) -> bool:
    """The default selection rule (see the module docstring)."""
    return not any(module.children())


def select_layers(model: nn.Module, selector: Selector | None) -> list[tuple[nn.Module, LayerInfo]]:
    """Selected modules in `named_modules()` traversal order; default: `is_default_layer`."""
    chooser = selector if selector is not None else is_default_layer
    layers = []
    for name, module in model.named_modules():
        if chooser(name, module) and not isinstance(module, torch.jit.ScriptModule):
            layers.append((module, LayerInfo(name, type(module).__name__)))
    return layers


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
            "histogram_selector matched no observed layer; observed layers are: "
            + ", ".join(repr(info.name) for _, info in layers[:20])
            + (" ..." if len(layers) > 20 else "")
        )
    return set(candidates[:max_histogram_modules])
