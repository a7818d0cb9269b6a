"""Modules of the observed model replaced, moved, removed or added after inject_observer.

The layers are chosen once, at inject (selection.py), and followed as module objects, as plain
hooks registered then would be: a module assigned into the model later (a head swapped for
fine-tuning, a Linear wrapped LoRA-style, `torch.ao.quantization.fuse_modules` or eager
quantization's `prepare_qat`/`convert`, a block appended to a `ModuleList`) is not observed; a
selected module taken out of the model (replaced, deleted) has no rows once it stops running;
one moved under a new name (wrapped by another module) keeps the name it had at inject in its
rows, and one also assigned at a new name (`model.block = model.head`) is one module: its
calls from there are more calls of the same layer. Choosing layers again mid-run would change
a run's catalog (result.json, index.md and every reader assume one set of layers per run, as
`resume=True` does), so the run says it instead: at removal the model is compared with what
inject saw (one walk of its modules, under every name each has), removal warns, and index.md
names each module. Where a name that held a selected layer, or a container of them, now holds
a module of the other kind (`model.block = nn.Linear(...)` in place of a `Sequential` of
layers, or a layer replaced by a container), the note says so in one clause: the lists of
layers taken out and modules added would not name the container. A module's class changing
in place (`torch.nn.utils.parametrize`, which gives the module a generated subclass) is no
change here:
the module is the same object, observed throughout. Nor is a cast (`model.half()`,
`model.to(torch.bfloat16)`): the same modules run, and each row carries its tensor's dtype;
index.md and result.json's `dtypes` say which samples had which (`rundir.dtype_spans`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from torch import nn

from torchinstruments.compilation import named_modules_uncompiled
from torchinstruments.notices import shown
from torchinstruments.reasons import utf8_text
from torchinstruments.records import LayerInfo
from torchinstruments.rundir.ranges import listed
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
        at = dict(named_modules_uncompiled(root, every_name=True))
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet(at.values())
        names = _names_by_module(at)
        self._layers = [
            (info, weakref.ref(module), frozenset(names.get(id(module), (module, [info.name]))[1]))
            for module, info in layers
        ]
        self._selector = selector
        recorded = {info.name for _, info in layers}  # `utf8_text` of the module's names
        self._holders = _layer_holders(at, {name for name in at if utf8_text(name) in recorded})

    def changes_note(self, root: nn.Module) -> Changes | None:
        """The note on the model's modules changed since inject, or None if none did: given how
        to name a module (`layer_span` for index.md, `repr` for the removal's warning), its text.

        Runs in `remove_observer`, which must finish the run whatever the model has become: a
        failure to compare is said instead of raised.
        """
        try:
            return self._changes(root)
        except Exception as error:
            failed = (
                f"comparing the model with the modules inject_observer saw failed ({shown(error)}): "
                "modules added, moved or taken out of the model after inject, if any, are not "
                "named here"
            )
            return lambda named: failed

    def _changes(self, root: nn.Module) -> Changes | None:
        """`changes_note`'s comparison."""
        at = dict(named_modules_uncompiled(root, every_name=True))
        now = _names_by_module(at)
        left: list[_Layer] = []
        moved: list[_Layer] = []
        shared: list[_Layer] = []
        for info, module_ref, before in self._layers:
            module = module_ref()
            names = [] if module is None else now.get(id(module), (module, []))[1]
            layer = (info.name, info.module_type)
            if not names:
                left.append((layer, []))
            elif info.name not in map(utf8_text, names):  # as the layer's name was recorded
                moved.append((layer, names))
            elif new := [name for name in names if name not in before]:
                shared.append((layer, new))
        chosen = self._chooser(root)
        added = [
            (names[0], type(module).__name__)
            for module, names in now.values()
            if module not in self._modules and chosen(names[0], module)
        ]
        replaced = self._replaced(at)
        if not (left or moved or shared or added or replaced):
            return None
        return lambda named: _note(named, left, moved, shared, added, replaced)

    def _replaced(self, now: dict[str, nn.Module]) -> list[tuple[str, str, str, str]]:
        """The names of selected layers and of their containers at inject that now hold
        another module (`now`: the model's modules by every name), of the other kind (a
        container for a leaf, or a leaf for one)."""
        found = []
        for name, (module_ref, was, container) in self._holders.items():
            there = now.get(name)
            if there is None or there is module_ref() or _is_container(there) == container:
                continue
            kind = "a leaf" if container else "a container"
            found.append((name, was, type(there).__name__, kind))
        return found

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


def _is_container(module: nn.Module) -> bool:
    """Whether a module holds child modules."""
    return next(iter(module.children()), None) is not None


def _names_by_module(at: dict[str, nn.Module]) -> dict[int, tuple[nn.Module, list[str]]]:
    """Each module of `at` (the model's modules by every name), with its names in order."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, module in at.items():
        found.setdefault(id(module), (module, []))[1].append(name)
    return found


def _layer_holders(
    at: dict[str, nn.Module], names: set[str]
) -> dict[str, tuple[weakref.ref[nn.Module], str, bool]]:
    """The selected layers and the modules that contain some (the root left out: it is never
    replaced), by name (`at`: the model's modules by every name): the module (weakly), what it
    was (`Linear, a selected layer`, `Sequential, which held selected layers`) and whether it is
    a container."""
    held = {name.rsplit(".", end)[0] for name in names for end in range(1, name.count(".") + 1)}
    return {
        name: (
            weakref.ref(module),
            f"{type(module).__name__}, "
            + ("a selected layer" if name in names else "which held selected layers"),
            _is_container(module),
        )
        for name, module in at.items()
        if name and (name in names or name in held)
    }


Named = Callable[[str], str]  # how a module's name is written: `layer_span` or `repr`
Changes = Callable[[Named], str]  # a note on the changes, given how to name a module
_Layer = tuple[tuple[str, str], list[str]]  # (name, type at inject), names it is now also at


def _note(
    named: Named,
    left: list[_Layer],
    moved: list[_Layer],
    shared: list[_Layer],
    added: list[tuple[str, str]],
    replaced: list[tuple[str, str, str, str]],
) -> str:
    """`ModelAtInject.changes_note`'s text, each module `named`."""

    def at(layers: list[_Layer], how: str) -> list[str]:
        return [
            f"{named(name)} ({kind})" + (f" {how} {', '.join(map(named, names))}" if how else "")
            for (name, kind), names in layers
        ]

    left_, moved_, shared_ = at(left, ""), at(moved, "now at"), at(shared, "also at")
    added_ = [f"{named(name)} ({kind})" for name, kind in added]
    replaced_ = [
        f"{named(name)} ({was}) is now a {now} ({kind})" for name, was, now, kind in replaced
    ]
    parts = []
    if replaced_:
        parts.append(
            "names that now hold a module of the other kind (a container where a selected "
            f"layer was, or a layer where a container of them was): {listed(replaced_, _SHOWN)}"
        )
    if left_:
        parts.append(
            f"selected layers taken out of the model (no rows once they stopped "
            f"running): {listed(left_, _SHOWN)}"
        )
    if moved_:
        parts.append(
            f"selected layers moved (their rows keep the name they had at inject): "
            f"{listed(moved_, _SHOWN)}"
        )
    if shared_:
        parts.append(
            "selected layers now also held at another name (one module: its rows keep the "
            "name it had at inject, its calls from there add call_index values): "
            f"{listed(shared_, _SHOWN)}"
        )
    if added_:
        parts.append(
            f"modules added that the selection would choose now, not observed (no "
            f"rows): {listed(added_, _SHOWN)}"
        )
    return (
        "the model's modules changed after inject_observer; layers are chosen at inject and "
        "followed as those module objects (as hooks registered then would be): "
        + "; ".join(parts)
        + ". To observe the changed model, remove_observer and inject_observer it again, "
        "with a new output_dir"
    )
