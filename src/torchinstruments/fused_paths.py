"""Modules with a fused fast path that holds selected layers: run layer by layer when sampled.

Design decision: an `nn.TransformerEncoderLayer` in eval, when no gradient is needed (no_grad,
inference_mode, frozen weights), computes the whole block in one fused kernel, skipping the
submodules a run selected as layers (`_torch_internals.has_fused_fast_path`): their outputs
would never be returned, so never measured. Each such module that holds a selected layer gets a
proxy of its own (`FusedPathGuard`, installed with the layers' proxies by
`capture.Proxies.register`; the root itself, by `capture.Proxies.root_fused_path`): in a sampled
forward its fast path is switched off for that call (`_torch_internals.layer_by_layer`: the path
PyTorch takes when a hook is attached), so its layers run and are measured as a hook user sees
them; every other forward keeps the fused kernel, bit-identical. index.md explains this only for
a run that has such a module (`RunInfo.fused_paths`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from torchinstruments._torch_internals import has_fused_fast_path, layer_by_layer
from torchinstruments.records import LayerInfo

__all__ = ["FusedPathGuard", "fused_path_modules"]


class FusedPathGuard:
    """The wrapper behind the proxy of a module with a fused fast path that contains layers.

    In a sampled forward (of this thread, or the one in flight for a thread without a forward of
    its own: see samples.py) the module runs layer by layer, so its selected submodules
    are called and measured; otherwise it is called as is. `observer` is the observer.Observer.
    """

    __slots__ = ("module_ref", "observer")

    def __init__(self, observer: Any, module: nn.Module) -> None:
        self.observer = observer
        self.module_ref = weakref.ref(module)

    def on_call(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        """Call the forward, on its layer-by-layer path during a sampled forward."""
        module = self.module_ref()
        observer = self.observer
        if module is None or (
            observer.current is None and observer.sample_in_flight(count=False) is None
        ):
            return wrapped(*args, **kwargs)
        with layer_by_layer(module):
            return wrapped(*args, **kwargs)


def fused_path_modules(
    root: nn.Module, layers: Sequence[tuple[nn.Module, LayerInfo]]
) -> list[tuple[str, nn.Module]]:
    """The modules (qualified name, module; the root is `""`) that could skip selected layers
    with a fused kernel: sampled forwards run them layer by layer (`FusedPathGuard`), and
    index.md explains that only for a run that has one (`RunInfo.fused_paths`)."""
    selected = {id(module) for module, _ in layers}
    return [
        (name, module)
        for name, module in root.named_modules()
        if has_fused_fast_path(module)
        and any(id(inner) in selected for inner in module.modules() if inner is not module)
    ]
