"""A root forward whose body runs after it returned: a generator (or coroutine) `forward`.

Calling a generator function runs none of its body: the model's forward returns a generator at
once, and its layers run as the caller iterates it (a streaming model yielding one output per
chunk), after the sampled forward ended and its layers' proxies came off. Those calls are inside
no root forward, so they are neither counted nor observed, as plain hooks see it too: the
root's forward hook fires on the generator, before any layer ran. Left unsaid, index.md would
list those layers as never run, with causes (a branch not taken, a module never called) that
are not this one. Design decision: a sample is one root forward (design.md), so the run does
not follow the iteration; it says so, once (a warning and a note in index.md), and how to get
rows. Cost: one `isinstance` per sampled forward; nothing on unsampled ones.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

__all__ = ["say_deferred"]

_KINDS = {
    types.GeneratorType: "a generator",
    types.AsyncGeneratorType: "an async generator",
    types.CoroutineType: "a coroutine",
}
_SAID = "the model's forward returned "


def deferred_note(output: Any, sample_id: int) -> str | None:
    """What the run says of a root forward that returned `output`, if its body runs later."""
    kind = _KINDS.get(type(output))
    if kind is None:
        return None
    return (
        f"{_SAID}{kind} (first in sample {sample_id}): its body runs as the caller consumes "
        "it, after the root forward returned, so the layer calls it makes are in no root "
        "forward: they are not observed, and those layers have no rows from them. For rows, "
        "observe the module the generator calls once per item (inject_observer on it), or "
        "have the forward return its outputs (a list)"
    )


def say_deferred(
    output: Any, sample_id: int, notes: list[str], warn_once: Callable[[str, str], None]
) -> None:
    """Note (index.md) and warn once where a sampled root forward returned a deferred body."""
    if type(output) not in _KINDS or any(note.startswith(_SAID) for note in notes):
        return
    note = deferred_note(output, sample_id)
    if note is not None:
        notes.append(note)
        warn_once("deferred forward", note)
