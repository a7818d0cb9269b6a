"""The key a trainer's checkpoint keeps one observer's state under.

Design decision: the key is built from the callback's own arguments (`output_dir`, `module`),
never from the objects of one process, so a restarted job, which builds the same callbacks,
finds each observer's run again; two observers of one trainer (two parts of the model) get two
keys, and the default callback keeps the plain class name, as checkpoints always had it.

A lambda or a function defined inside another has no name of its own to tell it by: a GAN's
`module=lambda m: m.generator` and `module=lambda m: m.discriminator` are both `<lambda>`, so
their observers had one key (Lightning refused the Trainer, "more than one stateful callback";
the Hugging Face Trainer kept one run for both, which a resumed train() gave both to continue).
Such a callable is named by its qualified name and what its source reads, which a restarted
process gives again: the names its code loads (`generator`), and its literals, defaults and
closure values (`m.blocks[1]`'s 1), read from its instructions (`dis`). Two that read the same are the same selection. So are
`operator.attrgetter('generator')` (its repr) and a `functools.partial` (its function's name and
its literal arguments: its repr holds an address), and a callable object (its class's name and
its literal attributes: two objects of one class choosing two parts had one key). A function
defined at a module's top level keeps its qualified name alone, as checkpoints had it.
"""

from __future__ import annotations

import dis
import os
from collections.abc import Callable, Iterable
from functools import partial
from operator import attrgetter, itemgetter, methodcaller
from types import CodeType
from typing import Any

__all__ = ["state_key"]


def state_key(
    owner: str, output_dir: str | os.PathLike[str] | None, module: str | Callable[..., Any] | None
) -> str:
    """`owner` for the defaults, else `owner{'output_dir': ..., 'module': ...}`.

    A callable `module` is named by its `__qualname__` (a partial or a callable object: its
    class's), which a restarted process gives again, unlike its id; a lambda or a nested
    function also by what it reads, a partial or a callable object by its literal arguments
    or attributes (`callable_name`).
    """
    if output_dir is None and module is None:
        return owner
    named = module if module is None or isinstance(module, str) else callable_name(module)
    where = None if output_dir is None else os.fspath(output_dir)
    return f"{owner}{{'output_dir': {where!r}, 'module': {named!r}}}"


def callable_name(module: Callable[..., Any]) -> str:
    """A callable's name for the key: `<lambda>[generator]` for `lambda m: m.generator`."""
    if isinstance(module, partial):  # its repr names the function by its address
        keywords = [f"{k}={v}" for k, w in module.keywords.items() for v in _literals([w])]
        read = [callable_name(module.func), *_literals(module.args), *keywords]
        return f"partial[{', '.join(read)}]"
    if isinstance(module, attrgetter | itemgetter | methodcaller):
        return repr(module)  # operator.attrgetter('generator'): what it reads, as written
    name = getattr(module, "__qualname__", None)
    if not isinstance(name, str):  # a callable object: its class, and what it holds
        return _object_name(module)
    code = getattr(module, "__code__", None)
    if code is None or "<" not in name:  # a top-level function: its name tells it apart
        return name
    cells = getattr(module, "__closure__", None) or ()
    read = [
        *_code_reads(code),
        *_literals(getattr(module, "__defaults__", None) or ()),
        *_literals(_cell_contents(cells)),
    ]
    return f"{name}[{', '.join(read)}]"


def _object_name(module: object) -> str:
    """A callable object's name for the key: its class's, with its literal attributes
    (`NetLayer[index=0]`); one without any (or without a `__dict__`) keeps its class's name."""
    held = getattr(module, "__dict__", None)
    kind = type(module).__qualname__
    if not isinstance(held, dict):
        return kind
    read = [f"{k}={v}" for k, w in held.items() if isinstance(k, str) for v in _literals([w])]
    return f"{kind}[{', '.join(read)}]" if read else kind


def _code_reads(code: CodeType) -> list[str]:
    """The names and literals a code object loads, in order, with those of the code inside it
    (a comprehension's, a nested lambda's). Read from its instructions, not `co_consts`: from
    Python 3.14 a small int (`m.blocks[1]`'s 1) is an instruction's argument, not a constant.
    Its parameters' names (`LOAD_FAST`) say nothing of what it selects."""
    read: list[str] = []
    for instruction in dis.get_instructions(code):
        loaded, name = instruction.argval, instruction.opname
        if isinstance(loaded, CodeType):
            read.extend(_code_reads(loaded))
        elif name.startswith("LOAD") and not name.startswith("LOAD_FAST"):
            if name in ("LOAD_CONST", "LOAD_SMALL_INT"):
                read.extend(_literals([loaded]))
            elif isinstance(loaded, str):
                read.append(loaded)
    return read


def _literals(values: Iterable[object]) -> list[str]:
    """The reprs of the strings and numbers among `values` (None and code objects say nothing
    of the selection, and None comes and goes between Python versions)."""
    return [repr(v) for v in values if isinstance(v, str | int | float)]


def _cell_contents(cells: Iterable[Any]) -> list[object]:
    """What a closure's cells hold (an empty cell: nothing)."""
    held = []
    for cell in cells:
        try:
            held.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            continue
    return held
