"""The key a trainer's checkpoint keeps one observer's state under.

Design decision: the key is built from the callback's own arguments (`output_dir`, `module`),
never from the objects of one process, so a restarted job, which builds the same callbacks,
finds each observer's run again; two observers of one trainer (two parts of the model) get two
keys, and the default callback keeps the plain class name, as checkpoints always had it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["state_key"]


def state_key(
    owner: str, output_dir: str | os.PathLike[str] | None, module: str | Callable[..., Any] | None
) -> str:
    """`owner` for the defaults, else `owner{'output_dir': ..., 'module': ...}`.

    A callable `module` is named by its `__qualname__` (a partial or a callable object: its
    class's), which a restarted process gives again, unlike its id.
    """
    if output_dir is None and module is None:
        return owner
    if module is None or isinstance(module, str):
        named = module
    else:
        named = getattr(module, "__qualname__", type(module).__qualname__)
    where = None if output_dir is None else os.fspath(output_dir)
    return f"{owner}{{'output_dir': {where!r}, 'module': {named!r}}}"
