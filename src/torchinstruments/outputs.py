"""The output walk: every tensor inside what a layer's forward returned, with its tensor_path.

A forward may return a tensor, or tensors nested in tuples, lists, mappings, namedtuples and
dataclasses; each tensor found is one measured output, named by the path that reaches it
(`[0]`, `['key']`, `.field`). Anything else is passed over untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["iter_tensors"]

_MAX_OUTPUT_DEPTH = 16


def iter_tensors(output: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(tensor_path, tensor)` for every tensor inside a forward's output.

    Walks tuples and lists (`[0]`), mappings (`['key']`), namedtuples and dataclasses (`.field`);
    any other object is passed over untouched. Each object is visited once, so cycles and
    repeated references are safe; a tensor reachable twice is measured at its first path.
    """
    yield from _walk(output, "", set(), 0)


def _walk(obj: Any, path: str, seen: set[int], depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Depth-first walk behind `iter_tensors`."""
    if id(obj) in seen or depth > _MAX_OUTPUT_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        seen.add(id(obj))
        yield path, obj
        return
    if isinstance(obj, str | bytes | int | float | bool) or obj is None:
        return
    if isinstance(obj, Mapping):
        seen.add(id(obj))
        for key, value in obj.items():
            yield from _walk(value, f"{path}[{key!r}]", seen, depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        seen.add(id(obj))
        for name, value in zip(obj._fields, obj, strict=False):
            yield from _walk(value, f"{path}.{name}", seen, depth + 1)
    elif isinstance(obj, tuple | list):
        seen.add(id(obj))
        for index, value in enumerate(obj):
            yield from _walk(value, f"{path}[{index}]", seen, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        seen.add(id(obj))
        for field in dataclasses.fields(obj):
            yield from _walk(
                getattr(obj, field.name, None), f"{path}.{field.name}", seen, depth + 1
            )
