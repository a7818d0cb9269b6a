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
- A handler installed over ours that calls ours (Lightning's, installed after the observer
  attached at `on_fit_start`, calls the Python handler it found and ends the fit itself with
  `SIGTERMException`) decides what SIGTERM does: ours then flushes and returns, never re-raising
  the default action. Without the library that handler would have found the default action,
  which is not callable and so never called, and the fit would have ended Lightning's way; a
  re-raise from ours would kill the process in its place (exit status 143, the run left
  unfinished). The default action is re-raised only where the signal reached ours through
  handlers of ours alone.
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
  thread, and its copy of the buffer is not its to write: there the handler only chains, and at
  the fork the child's SIGTERM handler goes back to the one the chain ends at (the handler the
  process had before the library's; kept where that is one installed from C), so a child
  blocked in native code ends at a SIGTERM as it would have without the library.
- Python runs a handler only when the main thread next runs Python code. A main thread blocked
  in native code (a rank waiting in a collective for a rank that raised or hangs) never does, so
  where SIGTERM's default action would end it at once, it would live on until SIGKILL. While a
  handler of ours is installed, a watcher thread (`rundir.term_watch`, one per process, started
  at the first install and stopped on the main thread once no run is live) takes such a SIGTERM:
  every live run writes its buffered rows from that thread (`_on_stuck`), then, where the chain
  ends at the default action (SIG_DFL, or a handler installed from C, which the chain treats
  alike), the process ends with it, exit status as without the library. Where it ends at a
  Python handler (a framework's, installed before ours or over it), that handler could not have
  run without the library either: the process lives on with its rows on disk, and the handler
  runs when the main thread next runs Python. SIG_IGN stays ignored. A main thread that runs
  Python is left to the handler path alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from torchinstruments.notices import warn
from torchinstruments.rundir.term_watch import GRACE_S, TermWatcher, end_with_default

FLUSH_TIMEOUT_S = 5.0

# The process's SIGTERM disposition is process-wide state, and so is what mirrors it here (lists,
# so the fork handler replaces them without `global`):
# serialises edits of the chain of `TermFlush` handlers (install, uninstall), on any thread;
_CHAIN = [threading.RLock()]
# the handlers installed and not uninstalled (weak: the chain, not this set, keeps them);
_LIVE: list[weakref.WeakSet[TermFlush]] = [weakref.WeakSet()]
# the watcher of SIGTERMs the main thread cannot handle (`rundir.term_watch`), while one runs;
_WATCH: list[TermWatcher | None] = [None]


@dataclasses.dataclass
class _Handling:
    """Handlers of ours started so far, running now, and when the last started
    (`time.monotonic`), noted on the main thread for the watcher (which only reads them)."""

    started: int = 0
    running: int = 0
    last_started: float = -math.inf


_HANDLING = [_Handling()]


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
            _LIVE[0].add(self)
            if _WATCH[0] is None:
                watcher = TermWatcher(_on_stuck, _progress)
                _WATCH[0] = watcher if watcher.start() else None
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
            _LIVE[0].discard(self)
            above = self._next
            if above is not None:  # a TermFlush over this one: splice this one out
                above._previous = self._previous
                if isinstance(self._previous, TermFlush):
                    self._previous._next = above
                self._next = None
            if _on_main_thread():
                _settle()
                _stop_watching_if_idle()

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        """Flush (once), then do what the previous handler or the default action would do."""
        handling = _HANDLING[0]  # the watcher leaves this SIGTERM to us (main thread: no lock)
        handling.started += 1
        handling.running += 1
        handling.last_started = time.monotonic()
        try:
            return self._handle(signum, frame)
        finally:
            handling.running -= 1

    def _handle(self, signum: int, frame: FrameType | None) -> Any:
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
        if previous == signal.SIG_IGN or not self._reached_through_ours():
            return None  # ignored; or a handler over ours called us and decides (docstring)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return None

    def _reached_through_ours(self) -> bool:
        """Whether the process's SIGTERM handler leads to this one through handlers of ours
        only (False: a handler installed over ours, a framework's, called this one)."""
        node = signal.getsignal(signal.SIGTERM)
        while isinstance(node, TermFlush):
            if node is self:
                return True
            node = node._previous
        return False


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


def _stop_watching_if_idle() -> None:
    """Stop the watcher once no run is live and the SIGTERM handler is not ours (main thread,
    under the chain's lock): the wakeup fd is unset again if it is still ours."""
    watcher = _WATCH[0]
    if watcher is None or _LIVE[0] or isinstance(signal.getsignal(signal.SIGTERM), TermFlush):
        return
    _WATCH[0] = None
    watcher.stop()


def _progress() -> tuple[int, int, float]:
    """Handlers of ours started so far, running now, and when the last started (the watcher)."""
    handling = _HANDLING[0]
    return handling.started, handling.running, handling.last_started


def _chain_end(handler: Any) -> Any:
    """The handler the chain from `handler` ends at: the first one that is not ours."""
    while isinstance(handler, TermFlush):
        handler = handler._previous
    return handler


def _on_stuck() -> None:
    """A SIGTERM the main thread cannot handle (it runs no Python; `rundir.term_watch`), on
    the watcher thread: every live run writes its buffered rows, then SIGTERM does what it would
    have done without the library (module docstring)."""
    pid = os.getpid()
    runs = [h for h in list(_LIVE[0]) if h._pid == pid]
    late = 0  # runs whose flush did not finish in time (the main thread holds a lock it needs)
    for handler in runs:
        flush = handler._flush
        if flush is not None and not flush(FLUSH_TIMEOUT_S):
            late += 1
    locked = _CHAIN[0].acquire(timeout=FLUSH_TIMEOUT_S)  # held only for an edit's instant
    try:
        end = _chain_end(signal.getsignal(signal.SIGTERM))
    finally:
        if locked:
            _CHAIN[0].release()
    if end == signal.SIG_IGN:
        return
    written = f"the buffered rows of {len(runs) - late} run(s) were written from another thread"
    if late:
        written += (
            f"; {late} run(s) could not write theirs within {FLUSH_TIMEOUT_S:g} s and lose "
            "at most their last flush interval, as at a SIGKILL"
        )
    blocked = (
        f"torchinstruments: SIGTERM arrived while the main thread ran no Python for "
        f"{GRACE_S:g} s (blocked in native code: a collective waiting for another rank, a "
        f"C call), so no Python signal handler could run there; {written}"
    )
    if callable(end):
        with contextlib.suppress(Exception):  # warnings turned into errors: still nothing raised
            warn(
                f"{blocked}. The program's own SIGTERM handler (installed before "
                "torchinstruments' or over it) runs when the main thread next runs Python, as "
                "it would without torchinstruments; until then the process goes on"
            )
        return
    with contextlib.suppress(Exception):
        warn(f"{blocked}. The process now ends with SIGTERM's default action, as without it")
    if not end_with_default(signal.SIGTERM):
        with contextlib.suppress(Exception):
            warn(
                "torchinstruments: the C library's signal() could not be reached to end the "
                "process; it ends when the main thread next runs Python, or at SIGKILL"
            )


def _after_fork_in_child() -> None:
    """In a forked child: a new lock (one another thread held at the fork stays held), no
    watcher (its thread is the parent's; the child's signals must not reach it), no live run,
    and SIGTERM's handler back to the one the chain ends at, unless a handler installed from C
    (which Python cannot put back) or one installed over ours holds it."""
    _CHAIN[0] = threading.RLock()
    _LIVE[0] = weakref.WeakSet()
    _HANDLING[0] = _Handling()
    watcher, _WATCH[0] = _WATCH[0], None
    if watcher is not None:
        watcher.forget_in_child()
    with contextlib.suppress(ValueError, OSError):
        current = signal.getsignal(signal.SIGTERM)
        end = _chain_end(current)
        if isinstance(current, TermFlush) and end is not None:
            signal.signal(signal.SIGTERM, end)


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["FLUSH_TIMEOUT_S", "TermFlush"]
