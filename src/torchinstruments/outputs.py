"""The output walk: every tensor inside what a layer's forward returned, with its tensor_path.

A forward may return a tensor, or tensors nested in tuples, lists, mappings, namedtuples and
dataclasses; each tensor found is one measured output, named by the path that reaches it
(`[0]`, `['key']`, `.field`). Anything else is passed over untouched. The named tuples torch's
own functions return (`torch.return_types`: `torch.max(x, dim)`, `topk`, `sort`,
`linalg.eigh`, which PyTorch documents as named tuples, struct sequences underneath) are named
by field as namedtuples are (`.values`, `.indices`), the accessor users write for them.

A tensor, or a container holding tensors, reached again at a second path of the same output
(Hugging Face's `hidden_states[-1]` is `last_hidden_state`; a forward returning `(y, y)`) is one
tensor with one gradient: it is measured once, at the first path, and the run says which path
has no rows of its own and where they are (one warning per layer, and a note in index.md), so
a query for the second path that finds nothing has its answer. Every object visited is held
until the walk ends, so the id of one freed on the way cannot be taken for a later one.

A mapping key is named by its `repr`, and two different keys may read alike (objects whose
`repr` is their class's name): their tensors would share one tensor_path, so one series would
mix two tensors, and a gradient could be read as the other's. A path already given in that
output gets `#1` (`#2`, ...) appended, and the run says which (once per layer). A key whose
`repr` holds a memory address (an object or function without a `repr` of its own) is named
without it (`[<__main__.Key object>]`): the address changes with every process, and a run
continued after a restart must name the same tensor the same way.

Design decision: the walk never looks inside an object of another kind (a Hugging Face `Cache`,
a `torch.distributions.Distribution`, a NumPy array, a `SimpleNamespace`, a `deque`): reading an
arbitrary object's attributes or iterating it could run user code, and its tensors have no path
a user could predict. But an object passed over may hold the very tensors a user wants, so the
walk says so (design: what is not recorded is said): each object that is not a plain value
(`None`, a string, a number, an enum member, a dtype or device, a class) is reported with its
path and type through `passed_over`, which the observer turns into one warning per layer and
type (the first path seen: a list of a thousand distributions is one warning), and a note in
index.md. The same goes for an output nested deeper than
`_MAX_OUTPUT_DEPTH` levels, which the walk does not follow, and for an object that raises when
read (a dataclass's property, a mapping's `items`, an `isinstance` check): what was read before
keeps its rows, the walk goes on with the rest of the output, and only that object's unread
tensors are missing.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from torchinstruments.notices import shown
from torchinstruments.reasons import utf8_text
from torchinstruments.rundir.shell import layer_span, literal_span

__all__ = ["iter_tensors", "passed_over_message"]

_MAX_OUTPUT_DEPTH = 16
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # in the default repr of objects and functions
# Values that hold no tensor: passed over without a word.
_PLAIN = (
    str,
    bytes,
    numbers.Number,
    enum.Enum,
    type,
    range,
    slice,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)

PassedOver = Callable[[str, str, str], None]  # (key, warning, note): `RecordingFailures`


def _names(note: bool) -> tuple[Callable[[str], str], Callable[[str], str]]:
    """How a message names a layer and a tensor path: `repr` in a warning, in index.md's note
    a code span of its literal (`layer_span`): `*`, `_` or `<x>` in a name (a `ModuleDict`'s
    key, a dict output's key) rendered as Markdown there."""
    if note:
        return layer_span, literal_span
    return repr, repr


def iter_tensors(
    output: Any, layer: str = "", passed_over: PassedOver | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(tensor_path, tensor)` for every tensor inside a forward's output.

    Walks tuples and lists (`[0]`), mappings (`['key']`), namedtuples and dataclasses (`.field`);
    any other object is passed over untouched, and, unless it is a plain value, reported to
    `passed_over` as the output of `layer` (see the module docstring). Each object is visited
    once, so cycles and repeated references are safe; a tensor reachable twice is measured at
    its first path, and the second path is reported to `passed_over`.
    """
    if isinstance(output, torch.Tensor):  # most layers: nothing to walk, nothing to alias
        yield "", output
        return
    yield from _walk(output, "", _Seen(), 0, layer, passed_over)


def passed_over_message(layer: str, path: str, what: str, note: bool = False) -> str:
    """What a run says of an object of kind `what` at `path` in `layer`'s output (its warning,
    or index.md's `note`)."""
    lay, pat = _names(note)
    where = f"at tensor_path {pat(path)} (the first place seen)" if path else "as its whole output"
    return (
        f"layer {lay(layer)} returned {what} {where}, which the output walk does not enter (it "
        "enters tuples, lists, mappings, named tuples and dataclasses, "
        f"{_MAX_OUTPUT_DEPTH} levels deep): tensors inside it, if any, have no rows"
    )


class _Seen:
    """What the walk reached, by id: each object (held, so its id stays its own) and its first
    path; the containers found to hold tensors (known once their walk ended: a cycle back into
    one is not an alias); how many tensors it has found so far."""

    __slots__ = ("holding", "paths", "tensors", "visits")

    def __init__(self) -> None:
        self.visits: dict[int, tuple[Any, str]] = {}
        self.holding: set[int] = set()
        self.paths: set[str] = set()  # the tensor_paths given so far
        self.tensors = 0


def _walk(
    obj: Any, path: str, seen: _Seen, depth: int, layer: str, passed_over: PassedOver | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Depth-first walk behind `iter_tensors`."""
    if obj is None:
        return
    visit = seen.visits.get(id(obj))
    if visit is not None:
        tensor = isinstance(obj, torch.Tensor)
        if tensor or id(obj) in seen.holding:
            _report_alias(layer, path, visit[1], tensor, passed_over)
        return
    try:  # free when nothing raises: no frame of its own on the sampled path
        if depth > _MAX_OUTPUT_DEPTH:  # a tensor too: not followed, so not measured
            if not isinstance(obj, _PLAIN):
                what = f"an object nested deeper than {_MAX_OUTPUT_DEPTH}"
                _report(layer, path, what, passed_over)
            return
        if isinstance(obj, torch.Tensor):
            if path in seen.paths:
                path = _another_path(path, seen.paths, layer, passed_over)
            seen.paths.add(path)
            seen.visits[id(obj)] = (obj, path)
            seen.tensors += 1
            yield path, obj
            return
        if isinstance(obj, _PLAIN):
            return
        seen.visits[id(obj)] = (obj, path)
        walk_deeper = depth + 1
        found = seen.tensors
        if isinstance(obj, Mapping):
            for key, value in obj.items():
                deeper = f"{path}[{_key_name(key)}]"
                yield from _walk(value, deeper, seen, walk_deeper, layer, passed_over)
        elif isinstance(obj, tuple) and (names := _field_names(obj)) is not None:
            for name, value in zip(names, obj, strict=False):
                yield from _walk(value, f"{path}.{name}", seen, walk_deeper, layer, passed_over)
        elif isinstance(obj, tuple | list):
            for index, value in enumerate(obj):
                yield from _walk(value, f"{path}[{index}]", seen, walk_deeper, layer, passed_over)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for field in dataclasses.fields(obj):
                value = getattr(obj, field.name, None)
                deeper = f"{path}.{field.name}"
                yield from _walk(value, deeper, seen, walk_deeper, layer, passed_over)
        else:
            kind = type(obj)
            _report(layer, path, f"a {kind.__module__}.{kind.__qualname__}", passed_over)
        if seen.tensors > found:  # reached again elsewhere: an alias
            seen.holding.add(id(obj))
    except Exception as error:  # what was read before keeps its rows, the rest of the walk goes on
        if passed_over is not None:
            what = f"{type(obj).__module__}.{type(obj).__qualname__}"
            passed_over(
                f"unreadable:{layer}:{what}",
                *(_unreadable(layer, path, what, error, note) for note in (False, True)),
            )


def _field_names(obj: tuple) -> tuple[str, ...] | None:
    """The field names of a named tuple: a namedtuple's `_fields`, or a struct sequence's
    (`torch.return_types`, which have no `_fields`) `__match_args__`, its visible fields,
    exactly those iteration yields; None for any other tuple."""
    names = getattr(obj, "_fields", None)
    if names is None and hasattr(type(obj), "n_sequence_fields"):
        names = getattr(type(obj), "__match_args__", None)
    return names


def _key_name(key: Any) -> str:
    """A mapping key as a path names it: its `repr`, less any memory address in it (a string's
    own text is kept as it is), as text UTF-8 files hold (a user's `__repr__` may return lone
    surrogates: every row of the tensor failed its history part, and TensorBoard's events)."""
    text = utf8_text(repr(key))
    if " at 0x" not in text or isinstance(key, str | bytes):
        return text
    return _ADDRESS.sub("", text)


def _another_path(path: str, given: set[str], layer: str, passed_over: PassedOver | None) -> str:
    """A path for a second tensor that reads as `path` (keys alike): the first `path#n` free."""
    number = 1
    while f"{path}#{number}" in given:
        number += 1
    renamed = f"{path}#{number}"
    if passed_over is not None:
        said = [
            f"layer {lay(layer)} returned two different tensors at tensor_path {pat(path)} "
            f"(mapping keys that read alike, the first such path seen): the later one's rows "
            f"are at {pat(renamed)}"
            for lay, pat in map(_names, (False, True))
        ]
        passed_over(f"same path:{layer}", *said)
    return renamed


def _report_alias(
    layer: str, path: str, first: str, tensor: bool, passed_over: PassedOver | None
) -> None:
    """Tell `passed_over` (if any) of an object reached again at `path`, once per layer."""
    if passed_over is not None:
        what = "tensor" if tensor else "object, with its tensors,"
        said = [
            f"layer {lay(layer)} returned the same {what} at tensor_path {pat(path)} as at "
            f"{pat(first)} (the first such path seen): it is measured once, so the rows of "
            f"{pat(path)} are those of {pat(first)}"
            for lay, pat in map(_names, (False, True))
        ]
        passed_over(f"aliased:{layer}", *said)


def _unreadable(layer: str, path: str, kind: str, error: Exception, note: bool) -> str:
    """What a run says of an object in `layer`'s output whose entries raised when read (its
    warning, or index.md's `note`)."""
    lay, pat = _names(note)
    where = f"at tensor_path {pat(path)} (the first place seen)" if path else "as its whole output"
    return (
        f"layer {lay(layer)} returned a {kind} {where} that raised when the output walk read it: "
        f"{shown(error)}; tensors inside it not read by then have no rows (the rest of the "
        "output is recorded)"
    )


def _report(layer: str, path: str, what: str, passed_over: PassedOver | None) -> None:
    """Tell `passed_over` (if any) of an object the walk did not enter, once per kind."""
    if passed_over is not None:
        key = f"passed over:{layer}:{what}"  # one per layer and type: a list of them says one
        passed_over(key, *(passed_over_message(layer, path, what, note) for note in (False, True)))
