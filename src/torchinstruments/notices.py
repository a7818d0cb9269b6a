"""Library warnings, pointed at the user's line.

Design decision: a warning raised deep in the library (a sink, a gradient hook, the history
writer) would name that library line (`sinks/dispatch.py:40`), which tells a user nothing. `warn` walks
the stack past the frames of this package and of the code between the user and it (torch, wrapt,
and the trainers whose callbacks run it: Lightning, transformers, accelerate) and names the first
frame beyond them: the user's `model(x)`, `loss.backward()`, `trainer.fit(...)` or
`remove_observer(model)`. `skip_file_prefixes` (Python 3.12) does the same, but the library
supports 3.11. A warning raised on a thread that runs only library code (the flush timer) names
the library line it came from. The cost is one frame walk per warning, and warnings are rare
(most are said once).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_BETWEEN = ("torch", "wrapt", "lightning", "pytorch_lightning", "transformers", "accelerate")


def _skipped() -> tuple[str, ...]:
    """Folders whose frames stand between the user and the library (those imported now)."""
    folders = [_PACKAGE]
    for name in _BETWEEN:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            folders.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(folders)


def user_stacklevel() -> int:
    """The `stacklevel` of the first frame outside the library (and torch, wrapt, trainers),
    counted from the caller of `warn`; that caller's own level when every frame is inside."""
    import inspect  # here, not at import: the command line imports this module and never warns

    skipped = _skipped()
    here = inspect.currentframe()  # this function; its caller is `warn`, whose caller is level 2
    frame = None if here is None or here.f_back is None else here.f_back.f_back
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
        level += 1
    return 2 if frame is None else level


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """`warnings.warn(message, category)` at the user's line (see the module docstring).

    Never raises: where a filter turns the warning into an exception (`-W error`, pytest's
    `filterwarnings = error`), or the caller's way of showing warnings raises (a
    `warnings.showwarning` hook, or, under `logging.captureWarnings(True)`, a handler or filter
    of the caller's `py.warnings` logger), it is written to stderr in the warning's own format
    instead. The library warns from inside its bookkeeping (a gradient hook, a sink, the flush
    thread), where an exception would end a thread of its own or cut a sample's end short in the
    user's step: the warning's news (rows lost, a sink given up) would come with more loss than
    it reports. A raising handler broke the user's step and left `remove_observer` half done
    (the run never finished).

    The message is written by `printable`: whatever a warning quotes (a path, a name, an
    error's message) never reaches a terminal or a log as a line break or an escape."""
    message = printable(message)
    level = user_stacklevel()
    try:
        warnings.warn(message, category, stacklevel=level)
    except Warning:
        _write(
            f"{message} [written, not raised: a warnings filter makes it an error]", category, level
        )
    except Exception as error:  # the caller's showwarning hook or logging handler raised
        said = f"{message} [written here: showing the warning raised {printable(shown(error))}]"
        _write(said, category, level)


def _write(said: str, category: type[Warning], level: int) -> None:
    """`said` to stderr in a warning's format, at the frame `warn` names; quietly nothing where
    stderr cannot take it (closed, or None under pythonw)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(warnings.formatwarning(said, category, *_frame_at(level + 1)))


def _frame_at(level: int) -> tuple[str, int]:
    """File and line of the frame `warnings.warn(..., stacklevel=level)` names, from `warn`."""
    import inspect

    frame = inspect.currentframe()  # this function; `warn` is level 1 of the stack it counts
    for _ in range(level):
        frame = None if frame is None else frame.f_back
    return ("sys", 1) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


# How many kinds of recording failure index.md lists one by one.
SHOWN_KINDS = 20


class RecordingFailures:
    """Failures that change what the run records (a gradient not measured, a sample not written,
    a sampler that raised), each kind warned once and kept for index.md's notes: a warning alone
    scrolls away, and the run must say what it did not record (design: never an empty or
    partial run that looks complete). Called as `warn_once(key, message)` is, in its place;
    `message` says what failed and what is missing because of it; `note`, where given, says the
    same for index.md (layers named as its Layers section names them, warnings by `repr`).
    """

    def __init__(self, warn_once: Callable[[str, str], None]) -> None:
        self._warn_once = warn_once
        self._said: dict[str, str] = {}  # the first message of each kind, in the order seen

    def __call__(self, key: str, message: str, note: str | None = None) -> None:
        self._warn_once(key, message)
        self._said.setdefault(key, message if note is None else note)

    def notes(self) -> tuple[str, ...]:
        """index.md's notes: each kind's first message (later ones of a kind are not counted),
        the first `SHOWN_KINDS` kinds (a kind per layer could otherwise fill the page)."""
        said = list(self._said.values())
        shown = tuple(
            f"{message} (warned when it first happened; later failures of this kind are not "
            "counted)."
            for message in said[:SHOWN_KINDS]
        )
        more = len(said) - SHOWN_KINDS
        if more > 0:
            shown += (f"{more} more kinds of recording failure were warned (see the warnings).",)
        return shown


def printable(text: str) -> str:
    """`text` with each character that is not printable written as its escape (`\\n`,
    `\\x1b`, `\\udcff`), the others as they are: the last guard of every warning and of
    index.md's notes, whatever they quote. Where a text from outside is quoted on purpose, it is
    written unambiguously first (`rundir.shell.literal_if_unclear`); this makes sure that a
    text quoted raw by any other path cannot forge a line or rewrite the screen."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def repr_of(value: object) -> str:
    """`repr(value)`, or its type's name where that raises: a sampler, its answer or a sink
    quoted in a warning or in index.md must not raise in the user's step or at inject."""
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__} (its repr raised)>"


def shown(error: BaseException) -> str:
    """`repr(error)` for a warning, or its type's name where its own repr raises (an error that
    a tensor subclass raised): a warning about a failure must not fail in the user's step."""
    try:
        return repr(error)
    except Exception:
        return f"{type(error).__name__}(its message could not be read)"


__all__ = [
    "SHOWN_KINDS",
    "RecordingFailures",
    "printable",
    "repr_of",
    "shown",
    "user_stacklevel",
    "warn",
]
