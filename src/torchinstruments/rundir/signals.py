"""SIGTERM: write what the run holds in memory, then let the signal take its course.

Clusters preempt jobs with SIGTERM (then SIGKILL after a grace period), and torchrun's agent
stops workers the same way. Without a handler, SIGTERM ends the process on the spot, exactly like
SIGKILL: the rows of the last flush interval are lost. With `TermFlush` installed, the run's flush
thread writes every buffered row and flushes the TensorBoard events first, so a SIGTERM loses
nothing measured before it, and then the signal does what it would have done without us.

Design decisions:
- Chained, never swallowed. A Python handler installed before ours (frameworks install their
  own, e.g. to checkpoint) is called with the same arguments; SIG_IGN stays ignored; the default
  action (or a handler installed from C, reported as None) is re-raised: the handler is reset to
  SIG_DFL and the signal sent again, so the process ends as killed by SIGTERM, with the exit
  status its launcher expects.
- The chain holds only live runs, whatever the order runs end in. Each handler links to the one
  it chains to (`_previous`) and to the `TermFlush` installed over it (`_next`). A run that ends
  while its handler is the current one restores the previous handler; one that ends under
  another run's handler is spliced out (the handler above takes its previous as its own). So
  observers removed in another order than injected (first in, first out) leave no handler
  behind, the chain never grows with the number of runs a process went through (at ~1,000 a
  SIGTERM would end in a RecursionError, exit status 1), and an ended run's writer and sink are
  not kept alive by it: an uninstalled handler drops its flush callable at once.
- Python can install signal handlers only from the main thread. An observer injected from
  another thread installs none (SIGTERM then behaves like SIGKILL, within the same bound). A run
  that ends on another thread (`remove_observer` there, or the garbage collector finalizing a
  dropped model on whatever thread allocated) makes its handler inert and splices it out where
  that needs no `signal.signal` (a `TermFlush` sits over it); if it is the current handler it
  stays, inert, chaining straight to its previous, and is taken off at the next install or
  uninstall on the main thread, together with any other inert handler at the top of the chain or
  between live ones. Only a handler that something else (not ours) installed over ours and may
  chain to keeps an inert one in place: it holds nothing but its link.
- Edits of the chain are serialised by one re-entrant lock (a finalizer may end a run while
  the same thread edits it); the handler itself takes no lock. It runs in the main thread
  between two bytecodes, possibly while that thread holds the history writer's lock,
  TensorBoard's, or the one inside `threading.Event`; taking any of them from the handler could
  deadlock. So a helper thread asks the run's flush thread to write everything, and the handler
  only joins the helper with a timeout (`FLUSH_TIMEOUT_S`). If the main thread was interrupted
  inside one of those locks, the wait times out and the run loses what a SIGKILL would have lost
  (at most one flush interval), never more, and never hangs.
- A process forked after injection (a DataLoader worker) inherits the handler but not the flush
  thread, and its copy of the buffer is not its to write: there the handler only chains.
- Known limit: Python runs a handler only when the main thread next runs Python code. A main
  thread blocked in native code (a rank waiting in a collective for a rank that died or hangs)
  never does, so where SIGTERM's default action would end it at once, it now lives on until
  SIGKILL (torchrun's agent sends it after its grace period). Nothing measured is lost: the
  flush thread, which needs no main thread, keeps writing parts meanwhile.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

FLUSH_TIMEOUT_S = 5.0

# Serialises edits of the chain of `TermFlush` handlers (install, uninstall), on any thread.
_CHAIN = [threading.RLock()]  # a list, so the fork handler replaces it without `global`


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class TermFlush:
    """A SIGTERM handler that flushes one run, then chains to the handler installed before it.

    Args:
        flush: writes everything the run buffers; called with a timeout in seconds, returns
            whether it finished in time.
    """

    def __init__(self, flush: Callable[[float], bool]) -> None:
        self._flush: Callable[[float], bool] | None = flush
        self._previous: Any = signal.SIG_DFL  # the handler this one chains to
        self._next: TermFlush | None = None  # the TermFlush installed over this one
        self._active = False
        self._installed = False
        self._pid = os.getpid()

    @property
    def installed(self) -> bool:
        """Whether `install` put this handler in place (and `uninstall` has not run)."""
        return self._installed

    def install(self) -> bool:
        """Become the SIGTERM handler; returns False where Python cannot (not the main thread).

        Inert handlers at the top of the chain (runs ended off the main thread) are taken off
        first, so this one chains to the first live handler under them."""
        if not _on_main_thread():
            return False
        with _CHAIN[0]:
            _settle()
            previous = signal.getsignal(signal.SIGTERM)
            self._previous, self._next = previous, None
            self._pid = os.getpid()
            signal.signal(signal.SIGTERM, self)
            if isinstance(previous, TermFlush):
                previous._next = self
            self._active = self._installed = True
        return True

    def uninstall(self) -> None:
        """Go inert and leave the chain: restore the previous handler if this one is current,
        else splice it out; off the main thread, an inert current handler waits for the next
        main-thread install or uninstall (module docstring)."""
        self._active = False
        self._flush = None  # an ended run's writer and sink are not kept alive by the chain
        with _CHAIN[0]:
            if not self._installed:
                return
            self._installed = False
            above = self._next
            if above is not None:  # a TermFlush over this one: splice this one out
                above._previous = self._previous
                if isinstance(self._previous, TermFlush):
                    self._previous._next = above
                self._next = None
            if _on_main_thread():
                _settle()

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        """Flush (once), then do what the previous handler or the default action would do."""
        flush = self._flush
        if self._active and flush is not None and os.getpid() == self._pid:
            self._active = False
            helper = threading.Thread(
                target=flush, args=(FLUSH_TIMEOUT_S,), name="torchinstruments SIGTERM flush"
            )
            helper.daemon = True
            helper.start()
            helper.join(FLUSH_TIMEOUT_S)
        previous = self._previous
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_IGN:
            return None
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return None


def _settle() -> None:
    """Take inert handlers off the chain: at its top (restoring the first live handler under
    them) and between live ones. Main thread only; the caller holds the chain's lock."""
    current = signal.getsignal(signal.SIGTERM)
    top = current
    while isinstance(top, TermFlush) and not top._installed and top._previous is not None:
        top = top._previous  # a handler installed from C (None) cannot be restored: keep ours
    if top is not current:
        signal.signal(signal.SIGTERM, top)
        if isinstance(top, TermFlush):
            top._next = None
    node = top
    while isinstance(node, TermFlush):  # splice inert ones out from between live ones
        below = node._previous
        if isinstance(below, TermFlush) and not below._installed:
            node._previous = below._previous
            if isinstance(below._previous, TermFlush):
                below._previous._next = node
            below._next = None
            continue
        node = below


def _after_fork_in_child() -> None:
    """A lock another thread held at the fork stays held in the child: start with a new one."""
    _CHAIN[0] = threading.RLock()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["FLUSH_TIMEOUT_S", "TermFlush"]
