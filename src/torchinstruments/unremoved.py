"""A model that never reached `remove_observer`: its run is finished by a finalizer, when the
model is garbage collected or at the process's exit, and index.md says which, and at an exit
that an uncaught exception caused, which exception. So a loop that stopped early (a traceback,
Ctrl-C) never reads like one that ran to its end and was removed.

Design decision: the process's exit is told from a collection by an exit handler registered
right after the first finalizer: exit handlers run last registered first, and `weakref.finalize`
registers its own at its first use, so this one runs before any run is finished at exit. The
exception is `sys.last_value`, which Python sets before exit handlers run, taken only when its
traceback unwound the whole stack (its outermost frame has no caller): the script's own end,
not an exception an interactive shell showed and went on from. `sys.exit()` leaves none: the
note then says only that the run was finished at the exit. A kill that cuts that finish (the
SIGTERM torchrun sends the ranks left when one dies) is named as that finish cut, never as
remove_observer's, by every reader, and `finalize` says it in place of this note
(`rundir.cut_finish`).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Protocol

from torchinstruments.rundir.attempts import UNREMOVED_NOTE
from torchinstruments.rundir.cut_finish import AT_EXIT, COLLECTED
from torchinstruments.rundir.shell import error_said

__all__ = ["finalize_unremoved", "unremoved_note"]


class Unremoved(Protocol):
    """What the finalizer needs of an observer (`observer.Observer`)."""

    closed: bool
    notes: list[str]

    def close(self) -> None: ...


class _Exit:
    """Whether the exit handler was registered, and whether the process is exiting now."""

    registered = False
    exiting = False


def _exiting() -> None:
    _Exit.exiting = True


def finalize_unremoved(root: object, observer: Unremoved) -> weakref.finalize:
    """The finalizer that finishes `observer`'s run, with its note, when `root` is collected or
    the process exits; `detach` it at `remove_observer`."""
    finalizer = weakref.finalize(root, _close_unremoved, observer)
    if not _Exit.registered:  # after weakref's own exit handler: runs before it
        _Exit.registered = True
        atexit.register(_exiting)
    return finalizer


def _close_unremoved(observer: Unremoved) -> None:
    if not observer.closed:
        observer.notes.append(unremoved_note(_Exit.exiting))
    observer.close()


def unremoved_note(exiting: bool) -> str:
    """index.md's note on a run finished without `remove_observer` (`exiting`: at the exit)."""
    if not exiting:
        return (
            f"{UNREMOVED_NOTE}: the run was finished {COLLECTED}; it holds the samples taken "
            "until then."
        )
    error = _uncaught()
    if error is None:
        ended = f"the run was finished {AT_EXIT}"
    else:
        what = error_said(error)
        how = " (Ctrl-C)" if isinstance(error, KeyboardInterrupt) else ""
        ended = f"the process ended with an uncaught {what}{how}, and the run was finished then"
    return f"{UNREMOVED_NOTE}: {ended}; it holds the samples taken until then."


def _uncaught() -> BaseException | None:
    """The exception that ended the script (see the module docstring), else None."""
    error = getattr(sys, "last_value", None)
    trace = error.__traceback__ if isinstance(error, BaseException) else None
    if trace is None or trace.tb_frame.f_back is not None:
        return None
    return error
