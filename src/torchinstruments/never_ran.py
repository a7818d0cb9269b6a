"""What removal says about selected layers that never ran in a sampled forward.

Every such layer is listed in index.md's Layers section. The removal warning names those that
are news: a branch not taken, a module its parent never calls. It leaves out a tied twin: a layer that never ran while another selected layer of the same type,
holding the very same parameters, ran (Hugging Face's T5 and BART keep a `shared` embedding
whose weight their encoder's and decoder's `embed_tokens` hold and which their forward never
calls). The same computation, on the same weights, is recorded at the twin's name, so a warning
on every run of such a model would say nothing a user can act on, and teach them to ignore the
warning that does. A note in index.md names each twin. Same type is required: GPT-2's `lm_head`
holds `wte`'s weight but computes something else, so an `lm_head` that never ran is warned.

It leaves out, too, a layer switched off: one its parent calls only under a plain bool setting
of the parent's own that is false at removal (`selection.switched_off`): torchvision's MBConv
calls its `stochastic_depth` only `if self.use_res_connect`, false in the first block of each
EfficientNet stage, and Inception calls `AuxLogits` only `if self.training`, so neither can run
in those blocks or in eval (nor, inside the quantizable MobileNetV2's `skip_add`, what its
`self.skip_add.add(x, y)` under `if self.use_res_connect` runs). index.md notes each with its
setting. A layer under a setting that
is true, or called in any other way, is warned as before.

A child of an `nn.TransformerEncoderLayer` is warned with the one cause a user cannot guess: in
eval without grad that layer's fused fast path calls no submodule. Sampled forwards switch it off
on calls through the layer's own forward (capture.py), so a child that still never ran was in one
not called, or called past that forward (`nn.TransformerEncoderLayer.forward(layer, x)`): the
warning and index.md say both, and how to get rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import nn

from torchinstruments._torch_internals import has_fused_fast_path
from torchinstruments.compilation import named_modules_uncompiled
from torchinstruments.reasons import utf8_text
from torchinstruments.rundir.ranges import listed, plural
from torchinstruments.rundir.shell import layer_span, literal_span
from torchinstruments.selection import switched_off

__all__ = [
    "cannot_run",
    "fused_clause",
    "never_ran_warning",
    "switched_off_layers",
    "switched_off_note",
    "tied_note",
    "tied_twins",
]

_SHOWN = 20  # names a warning or note lists


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's modules by name as the run records layer names (`utf8_text`)."""
    return {utf8_text(name): module for name, module in named_modules_uncompiled(model)}


def _related(name: str, other: str) -> bool:
    """Whether one of two module names holds the other (or they are the same)."""
    if not name or not other:  # the root holds every module
        return True
    return name == other or other.startswith(f"{name}.") or name.startswith(f"{other}.")


def tied_twins(model: nn.Module, never: Sequence[str], ran: Sequence[str]) -> dict[str, list[str]]:
    """For each layer of `never` that has a tied twin among `ran` (see the module), the twins.

    Twins are distinct modules, neither inside the other, of the same type, and every parameter
    of the idle layer (it has at least one) is held by one of them. One pass over the layers
    that ran maps each parameter to its holders, so a model of many layers costs one walk."""
    modules = _modules(model)
    holders: dict[int, list[str]] = {}
    for name in ran:
        if (module := modules.get(name)) is not None:
            for param in module.parameters():
                holders.setdefault(id(param), []).append(name)
    found: dict[str, list[str]] = {}
    for name in never:
        module = modules.get(name)
        params = [] if module is None else [id(p) for p in module.parameters()]
        if not params:  # None: taken out of the model after injection, said elsewhere
            continue
        twins = {
            other: None
            for param in params
            for other in holders.get(param, ())
            if type(modules[other]) is type(module) and not _related(name, other)
        }
        held = {id(p) for twin in twins for p in modules[twin].parameters()}
        if twins and held.issuperset(params):
            found[name] = list(twins)
    return found


def tied_note(twins: Mapping[str, list[str]]) -> str | None:
    """index.md's note on the tied twins that never ran (None when there are none)."""
    if not twins:
        return None
    each = [f"{layer_span(n)} (as {', '.join(map(layer_span, ts))})" for n, ts in twins.items()]
    return (
        f"Tied weights: {plural(len(twins), 'selected layer')} never ran in a sampled forward, "
        "but a layer of the same type holding the same parameters did, and has the rows of "
        f"that computation: {listed(each, _SHOWN)}. They are not warned about at removal."
    )


def switched_off_layers(model: nn.Module, never: Sequence[str]) -> dict[str, str]:
    """For each layer of `never` that a parent calls only under a false setting (see the
    module), or that lies inside such a module (GoogLeNet's `aux1.fc1`), that setting, as
    `parent.setting`."""
    modules = _modules(model)
    found: dict[str, str] = {}
    offs: dict[str, dict[str, str]] = {}  # per parent, read once
    for name in never:
        parts = name.split(".") if name else []
        for end in range(len(parts), 0, -1):  # the layer, then each module holding it
            parent, child = ".".join(parts[: end - 1]), parts[end - 1]
            if (holder := modules.get(parent)) is None:
                break
            if parent not in offs:
                offs[parent] = switched_off(holder)
            if (setting := offs[parent].get(child)) is not None:
                found[name] = f"{parent}.{setting}" if parent else setting
                break
    return found


def switched_off_note(settings: Mapping[str, str]) -> str | None:
    """index.md's note on the switched-off layers that never ran (None when there are none)."""
    if not settings:
        return None
    each = [
        f"{layer_span(name)} ({literal_span(setting)})"  # a parent's name in it
        for name, setting in settings.items()
    ]
    return (
        f"Switched off: {plural(len(settings), 'selected layer')} never ran in a sampled "
        "forward, and cannot as the model stands: the parent calls each only under a setting "
        f"of its own that is false (named here): {listed(each, _SHOWN)}. They are not "
        "warned about at removal."
    )


def fused_holders(model: nn.Module, never: Sequence[str]) -> dict[str, str]:
    """For each layer of `never` whose parent has a fused fast path, the parent's name (its
    children are what the fused kernel skips; a grandchild such as `self_attn.out_proj` is
    skipped by its own parent)."""
    modules = _modules(model)
    found: dict[str, str] = {}
    for name in never:
        parent = name.rpartition(".")[0]
        if name and parent in modules and has_fused_fast_path(modules[parent]):
            found[name] = parent
    return found


def fused_clause(holders: Mapping[str, str], named: Callable[[str], str] = repr) -> str:
    """What the warning and index.md say of layers that never ran inside an encoder layer,
    each holder `named` as the warning (`repr`) or index.md (`layer_span`) names layers."""
    counts: dict[str, int] = {}
    for holder in holders.values():
        counts[holder] = counts.get(holder, 0) + 1
    shown = ", ".join(
        f"{n} inside nn.TransformerEncoderLayer {named(h)}" for h, n in counts.items()
    )
    return (
        f"{shown}: not called, or called past its forward (as `nn.TransformerEncoderLayer."
        "forward(layer, x)`), where its fused fast path in eval without grad calls no submodule; "
        "for rows, call it as `layer(x)`, or run it in train mode or with grad enabled"
    )


def never_ran_warning(never: Sequence[str], total: int, samples: int, fused: str = "") -> str:
    """The removal warning naming the selected layers that never ran (none a tied twin), with
    `fused_clause` where some lie inside an encoder layer."""
    shown = ", ".join(repr(name) for name in never[:_SHOWN])
    return (
        f"torchinstruments: {len(never)} of {total} selected layers never ran in a sampled "
        f"forward ({plural(samples, 'sample')}), so they have no rows: {shown}"
        + (" ..." if len(never) > _SHOWN else "")
        + (f" ({fused})" if fused else "")
        + " (see the Layers section of index.md)"
    )


def cannot_run(
    model: nn.Module, never: Sequence[str], ran: Sequence[str]
) -> tuple[frozenset[str], tuple[str, ...], str]:
    """The layers among `never` the model cannot run as it stands (tied twins, layers switched
    off by a setting), and index.md's notes naming them: the removal's warning leaves them out.
    Third, the `fused_clause` of the others inside an encoder layer ("" for none), which the
    warning and a note say. Reading the model never fails a removal: where it fails, every such
    layer is warned, without a cause."""
    try:
        twins = tied_twins(model, never, ran)
        off = switched_off_layers(model, [name for name in never if name not in twins])
        fused = fused_holders(
            model, [name for name in never if name not in twins and name not in off]
        )
    except Exception:
        twins, off, fused = {}, {}, {}
    clause = fused_clause(fused) if fused else ""
    fused_note = (
        f"Never ran inside an encoder layer: {fused_clause(fused, layer_span)}." if fused else None
    )
    notes = tuple(
        note for note in (tied_note(twins), switched_off_note(off), fused_note) if note is not None
    )
    return frozenset((*twins, *off)), notes, clause
