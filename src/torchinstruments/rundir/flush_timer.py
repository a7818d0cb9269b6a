"""The history's flush thread: it writes buffered rows when they are due, whatever the model does.

Why a thread, and the time bound it keeps, are `rundir.writer`'s module docstring: a run that
stops sampling (a long evaluation, a stalled data loader, a hang before a crash) must still
write its buffered rows within `flush_seconds`. This module is the thread alone: it sleeps until
the writer says a flush is due or until poked, and nothing raised in a round ends it.

Design decision: the run's last flush (`finish`, at removal) is this thread's too, and the
removing thread waits for it only while its rounds return: once a round has run `stall_s`
without returning (a part write to a network file system that stopped answering blocks in the
kernel, and no Python code can interrupt it), the wait ends and the thread is left to end by
itself if the write ever returns. A write on the removing thread itself would block it just as
long, so removal never writes a part there. The cost: the thread, stuck, outlives the run (a
daemon, it never keeps the process alive).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from queue import Empty, SimpleQueue

from torchinstruments.notices import warn
from torchinstruments.rundir.shell import error_said

__all__ = ["FlushTimer", "earliest_due"]

# Seconds the flush thread waits after a round that raised, before the next one.
_AFTER_ERROR_S = 0.05
# How often `finish` reads the progress of a round in flight (its parts land without a notice).
_PROGRESS_POLL_S = 0.25


class FlushTimer:
    """Calls `flush(False)` on a daemon thread whenever `due()` says a flush is due, and
    `flush(True)` on request.

    See the module docstring for why a thread. The thread waits for exactly the time `due()`
    returns, or until `poke()` (rows arrived) or `flush_now()`. It waits on a `SimpleQueue`, not
    a `threading.Event`: the training thread pokes it at every sample, and a KeyboardInterrupt
    that lands inside `Event.set` (a Python-level `Condition`) can leave the event's lock held,
    hanging both threads for good; `SimpleQueue.put` is one C call.

    Args:
        due: seconds until the next flush is due (<= 0: now), or None when nothing is buffered.
        flush: writes what is due (False) or everything buffered (True, a `flush_now`); must
            not raise (it reports its own failures).
        name: the thread's name.
    """

    def __init__(
        self, due: Callable[[], float | None], flush: Callable[[bool], None], name: str
    ) -> None:
        self._due = due
        self._flush = flush
        self._wake: SimpleQueue[None] = SimpleQueue()  # an item: wake up
        self._stopping = False
        self._cond = threading.Condition()
        self._requested = 0  # flush_now requests made and served, under _cond
        self._served = 0
        self._wake_at: float | None = None  # when the waiting thread wakes on its own
        # monotonic: when the round in progress began (None: none is), when the last one ended
        self._round_since: float | None = None
        self._round_ended = time.monotonic()
        self._last: int | None = None  # the request after which the thread ends (`finish`)
        self._warned = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Rows were added: recompute when the next flush is due, unless the thread already
        wakes by then (waking it for nothing costs the training thread a GIL hand-over)."""
        wake_at = self._wake_at
        if wake_at is not None:
            due = self._due()
            if due is not None and time.monotonic() + due >= wake_at:
                return
        self._wake.put(None)

    def flush_now(self, timeout: float) -> bool:
        """Have the thread flush everything now; wait up to `timeout` s. True if it did."""
        with self._cond:
            self._requested += 1
            ticket = self._requested
        self._wake.put(None)
        with self._cond:
            return self._cond.wait_for(lambda: self._served >= ticket, timeout)

    def finish(self, stall_s: float, progress: Callable[[], object] = lambda: None) -> bool:
        """Have the thread flush everything one last time, then end it.

        Waits while the thread makes progress: gives up once neither a round returned nor
        `progress()` changed (a part landed) for `stall_s`, or no round has started `stall_s`
        after the last one ended or after this call. A round that keeps writing is no stall: one
        round writes full chunks for as long as they arrive, which can be longer than `stall_s`
        while the training thread outpaces it (a Ctrl-C in a Polars call slows it, two cores
        shared). The thread is then left as it is (stopping: it ends when that round returns).

        Returns:
            True when the last flush ran and the thread ended; False when the wait was given up.
        """
        asked = time.monotonic()
        seen, moved = progress(), asked
        with self._cond:
            self._requested += 1
            ticket = self._last = self._requested  # no round after it: nothing waits on one
        self._wake.put(None)
        with self._cond:
            while self._served < ticket:
                now = time.monotonic()
                if (latest := progress()) != seen:
                    seen, moved = latest, now
                since = self._round_since
                since = max(asked, self._round_ended) if since is None else since
                left = max(since, moved) + stall_s - now
                if left <= 0:
                    break
                self._cond.wait(min(left, _PROGRESS_POLL_S))
            served = self._served >= ticket
        self._stopping = True
        self._wake.put(None)
        if served and threading.current_thread() is not self._thread:
            self._thread.join()
        return served

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._turn()
            except BaseException as error:  # never let the thread die: the time bound needs it
                self._say(error)
                self._sleep(_AFTER_ERROR_S)

    def _turn(self) -> None:
        """One round: flush when due or asked, else sleep until due or poked."""
        self._wake_at = None  # until the wait below: every poke wakes the thread
        while True:  # forget the pokes so far: `due()` below sees their rows
            try:
                self._wake.get_nowait()
            except Empty:
                break
        if self._stopping:
            return
        with self._cond:
            requested = self._requested
        due = self._due()
        if requested > self._served or (due is not None and due <= 0):
            self._round_since = time.monotonic()
            try:
                self._flush(requested > self._served)
            finally:
                with self._cond:
                    self._served = requested
                    if self._last is not None and requested >= self._last:
                        self._stopping = True  # the last flush ran: no round may follow it
                    self._round_since = None
                    self._round_ended = time.monotonic()
                    self._cond.notify_all()
            return
        if due is not None:
            self._wake_at = time.monotonic() + due
        self._sleep(due)

    def _sleep(self, seconds: float | None) -> None:
        """Wait `seconds` (None: for ever) or until poked."""
        with contextlib.suppress(Empty):
            self._wake.get(timeout=seconds)

    def _say(self, error: BaseException) -> None:
        """Warn once that a round raised (the thread goes on)."""
        if self._warned:
            return
        self._warned = True
        warn(
            f"torchinstruments: the history flush thread ({self._thread.name}) caught "
            f"{error_said(error)}; it goes on, and buffered rows stay in memory "
            "until a part write succeeds. (Reported once.)"
        )


def earliest_due(*dues: Callable[[], float | None]) -> float | None:
    """A flush thread's `due`: the soonest of `dues` (None: none of them is due)."""
    times = [t for t in (due() for due in dues) if t is not None]
    return min(times) if times else None
