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
- The handler itself takes no lock. It runs in the main thread between two bytecodes, possibly
  while that thread holds the history writer's lock, TensorBoard's, or the one inside
  `threading.Event`; taking any of them from the handler could deadlock. So a helper thread asks
  the run's flush thread to write everything, and the handler only joins the helper with a
  timeout (`FLUSH_TIMEOUT_S`). If the main thread was interrupted inside one of those locks, the
  wait times out and the run loses what a SIGKILL would have lost (at most one flush interval),
  never more, and never hangs.
- A process forked after injection (a DataLoader worker) inherits the handler but not the flush
  thread, and its copy of the buffer is not its to write: there the handler only chains.
- Python can install signal handlers only from the main thread: an observer injected from another
  thread installs none (SIGTERM then behaves like SIGKILL, within the same bound).
- Removal restores the previous handler if ours is still installed; if something replaced ours
  meanwhile (and may chain to it), ours only becomes inert: it chains without flushing.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

FLUSH_TIMEOUT_S = 5.0


class TermFlush:
    """A SIGTERM handler that flushes one run, then chains to the handler installed before it.

    Args:
        flush: writes everything the run buffers; called with a timeout in seconds, returns
            whether it finished in time.
    """

    def __init__(self, flush: Callable[[float], bool]) -> None:
        self._flush = flush
        self._previous: Any = signal.SIG_DFL
        self._active = False
        self._installed = False
        self._pid = os.getpid()

    @property
    def installed(self) -> bool:
        """Whether `install` put this handler in place (and `uninstall` has not run)."""
        return self._installed

    def install(self) -> bool:
        """Become the SIGTERM handler; returns False where Python cannot (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.getsignal(signal.SIGTERM)
        self._pid = os.getpid()
        signal.signal(signal.SIGTERM, self)
        self._active = self._installed = True
        return True

    def uninstall(self) -> None:
        """Restore the previous handler if ours is still current; otherwise only go inert."""
        self._active = False
        if not self._installed:
            return
        self._installed = False
        if threading.current_thread() is not threading.main_thread():
            return  # cannot touch handlers here; ours stays, inert, and only chains
        if signal.getsignal(signal.SIGTERM) is self:
            signal.signal(signal.SIGTERM, self._previous)

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        """Flush (once), then do what the previous handler or the default action would do."""
        if self._active and os.getpid() == self._pid:
            self._active = False
            helper = threading.Thread(
                target=self._flush, args=(FLUSH_TIMEOUT_S,), name="torchinstruments SIGTERM flush"
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


__all__ = ["FLUSH_TIMEOUT_S", "TermFlush"]
