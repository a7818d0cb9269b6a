"""Modules of the observed model replaced, moved, removed or added after inject_observer.

The layers are chosen once, at inject (selection.py), and followed as module objects, as plain
hooks registered then would be: a module assigned into the model later (a head swapped for
fine-tuning, a Linear wrapped LoRA-style, `torch.ao.quantization.fuse_modules` or eager
quantization's `prepare_qat`/`convert`, a block appended to a `ModuleList`) is not observed; a
selected module taken out of the model (replaced, deleted) has no rows once it stops running;
one moved under a new name (wrapped by another module) keeps the name it had at inject in its
rows. Choosing layers again mid-run would change a run's catalog (result.json, index.md and
every reader assume one set of layers per run, as `resume=True` does), so the run says it
instead: at removal the model is compared with what inject saw (one walk of its modules),
removal warns, and index.md names each module. A module's class changing in place
(`torch.nn.utils.parametrize`, which gives the module a generated subclass) is no change here:
the module is the same object, observed throughout. Nor is a cast (`model.half()`,
`model.to(torch.bfloat16)`): the same modules run, and each row carries its tensor's dtype;
index.md and result.json's `dtypes` say which samples had which (`rundir.dtype_spans`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from torch import nn

from torchinstruments.compilation import named_modules_uncompiled
from torchinstruments.records import LayerInfo
from torchinstruments.sampling import as_decision
from torchinstruments.selection import Selector, default_layers

__all__ = ["ModelAtInject"]

_SHOWN = 20  # names listed per kind of change (index.md stays bounded on any model)


class ModelAtInject:
    """The model's modules and selected layers as inject_observer saw them, held weakly.

    Args:
        root: the model given to inject_observer (a torch.compile wrapper is looked through).
        layers: the selected layers, with their names at inject.
        selector: the run's selector (None: the default rule), asked again about added modules.
    """

    def __init__(
        self,
        root: nn.Module,
        layers: Sequence[tuple[nn.Module, LayerInfo]],
        selector: Selector | None,
    ) -> None:
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet(
            module for _, module in named_modules_uncompiled(root)
        )
        self._layers = [(info, weakref.ref(module)) for module, info in layers]
        self._selector = selector

    def changes_note(self, root: nn.Module) -> str | None:
        """index.md's note on the model's modules changed since inject, or None if none did.

        Runs in `remove_observer`, which must finish the run whatever the model has become: a
        failure to compare is said instead of raised.
        """
        try:
            return self._changes(root)
        except Exception as error:
            return (
                f"comparing the model with the modules inject_observer saw failed ({error!r}): "
                "modules added, moved or taken out of the model after inject, if any, are not "
                "named here"
            )

    def _changes(self, root: nn.Module) -> str | None:
        """`changes_note`'s comparison."""
        now = {id(module): (name, module) for name, module in named_modules_uncompiled(root)}
        left, moved = [], []
        for info, module_ref in self._layers:
            module = module_ref()
            found = None if module is None else now.get(id(module))
            if found is None:
                left.append(f"{info.name!r} ({info.module_type})")
            elif found[0] != info.name:
                moved.append(f"{info.name!r} ({info.module_type}) now at {found[0]!r}")
        chosen = self._chooser(root)
        added = [
            f"{name!r} ({type(module).__name__})"
            for name, module in now.values()
            if module not in self._modules and chosen(name, module)
        ]
        if not (left or moved or added):
            return None
        parts = []
        if left:
            parts.append(
                f"selected layers taken out of the model (no rows once they stopped "
                f"running): {_listed(left)}"
            )
        if moved:
            parts.append(
                f"selected layers moved (their rows keep the name they had at inject): "
                f"{_listed(moved)}"
            )
        if added:
            parts.append(
                f"modules added that the selection would choose now, not observed (no "
                f"rows): {_listed(added)}"
            )
        return (
            "the model's modules changed after inject_observer; layers are chosen at inject and "
            "followed as those module objects (as hooks registered then would be): "
            + "; ".join(parts)
            + ". To observe the changed model, remove_observer and inject_observer it again, "
            "with a new output_dir"
        )

    def _chooser(self, root: nn.Module) -> Callable[[str, nn.Module], bool]:
        """Whether the run's selection would choose a module now: the default rule on the
        model as it is, or the selector (an exception or a non-bool answer: not chosen; this
        runs at removal, where it must not raise)."""
        if self._selector is None:
            names = default_layers(root)
            return lambda name, module: name in names
        selector = self._selector

        def chosen(name: str, module: nn.Module) -> bool:
            try:
                return as_decision(selector(name, module)) is True
            except Exception:
                return False

        return chosen


def _listed(names: list[str]) -> str:
    """The first `_SHOWN` names, then how many more."""
    more = f" ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
