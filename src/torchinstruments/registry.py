"""The live observers, by model: kept outside the model, found through torch.compile wrappers.

The registry is a `weakref.WeakKeyDictionary`: it stores nothing on the model and lets an
observed model be garbage collected (its run is then finalized; see observer.py). A model is
found as itself or through the torch.compile wrappers around it or inside it, both ways, so
`remove_observer(torch.compile(model))` finds `model`'s observer and the other way round. The
trainer callbacks read and set what they need of a live observer through the small functions
here (api.py's public functions are the user's), each False or None where the model has none.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path

from torch import nn

from torchinstruments.compilation import compiled_original
from torchinstruments.observer import Observer
from torchinstruments.phases import Phases
from torchinstruments.records import RunCounts

__all__ = [
    "OBSERVERS",
    "UNATTACHED",
    "add_run_note",
    "also_root",
    "follow_step",
    "observed_counts",
    "observer_writing",
    "registered",
    "save_run_now",
    "trainer_phases",
]

OBSERVERS: weakref.WeakKeyDictionary[nn.Module, Observer] = weakref.WeakKeyDictionary()
# Models injected on a rank that attaches nothing: removing them is expected and stays quiet.
UNATTACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _compile_chain(model: nn.Module) -> list[nn.Module]:
    """`model` and the modules its torch.compile wrappers compile (OptimizedModule._orig_mod)."""
    chain = [model]
    inner = compiled_original(model)
    while inner is not None and inner not in chain:
        chain.append(inner)
        inner = compiled_original(inner)
    return chain


def registered(model: nn.Module) -> nn.Module | None:
    """The observed module `model` stands for, seeing through torch.compile wrappers both ways.

    `inject_observer(model); compiled = torch.compile(model)` then `remove_observer(compiled)`
    finds `model`; `inject_observer(torch.compile(model))` then `remove_observer(model)` finds
    the wrapper.
    """
    for candidate in _compile_chain(model):
        if candidate in OBSERVERS:
            return candidate
    for key in list(OBSERVERS):
        if model in _compile_chain(key):
            return key
    return None


def follow_step(model: nn.Module, source: Callable[[], object] | None) -> bool:
    """Read each sample's step from `source()` (a trainer's global step); False without observer.

    For integrations: the step is read when the sample is taken, so a trainer's own counter
    is the one source of truth (no per-batch bookkeeping in the callback).
    """
    key = registered(model)
    if key is None:
        return False
    OBSERVERS[key].step_source = source
    return True


def also_root(model: nn.Module, other: nn.Module) -> bool:
    """Make calls of `other` root forwards of `model`'s run too (until removal); False without
    observer. For integrations: `other` shares `model`'s layers (the module accelerate's
    compile_regions built `model` from, which a Trainer evaluates through)."""
    key = registered(model)
    if key is not None:
        OBSERVERS[key].proxies.install_root(other, OBSERVERS[key].on_root_call)
    return key is not None


def removed_after_exception(model: nn.Module, exception: str) -> bool:
    """Say that `model`'s run is removed because its fit raised `exception` (as index.md names
    it, with the step); False without observer. For integrations: a sample whose backward never
    came is then one the exception cut between its forward and its backward, not one whose
    backward may come after the removal (`samples.no_backward_before_removal_note`)."""
    key = registered(model)
    if key is not None:
        OBSERVERS[key].removed_after = exception
    return key is not None


def trainer_phases(model: nn.Module) -> Phases | None:
    """The observer's `Phases` (which forwards are training ones), or None without observer.

    For integrations: a trainer callback marks its training steps there (phases.py).
    """
    key = registered(model)
    return None if key is None else OBSERVERS[key].phases


def observer_writing(directory: Path) -> nn.Module | None:
    """The module whose live observer in this process writes the run in `directory` (absolute,
    a rank's own where ranks write their own), or None; for a trainer callback whose resumed fit
    continues a run that an earlier fit's observer, left attached, still holds."""
    for model, observer in list(OBSERVERS.items()):
        if observer.directory == directory and not observer.forked:
            return model
    return None


def save_run_now(model: nn.Module) -> bool:
    """Have `model`'s run write its rows and the notes said so far now (waiting a bounded
    time), False without observer or when it did not. For integrations: a note a callback's
    sink keeps (`sinks.protocol.NoteKeeper`) reaches the run state when it is first known, not
    at the flush thread's next round, so a run killed right after keeps it."""
    key = registered(model)
    return key is not None and OBSERVERS[key].sinks.save_now()


def observed_counts(model: nn.Module) -> RunCounts | None:
    """What `model`'s live observer has seen so far, or None without one (for integrations)."""
    key = registered(model)
    return None if key is None else OBSERVERS[key].counts()


def add_run_note(model: nn.Module, note: str) -> bool:
    """Add `note` to the run's index.md (written at removal); False when `model` has no observer.

    For integrations: a trainer callback states there how the fit ended (e.g. that it raised),
    so a run removed on an exception never reads like an ordinary one.
    """
    key = registered(model)
    if key is None:
        return False
    OBSERVERS[key].sinks.add_note(note)
    return True
