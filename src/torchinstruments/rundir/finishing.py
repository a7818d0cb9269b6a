"""Removal's finish of a run (the merge, result.json, the state file, index.md) on a thread of its own.

Design decision: on a file system that stopped answering, each of those writes (and the reads
of the merge) blocks in the kernel, and no Python code can interrupt it: removal on the user's
thread would never return. So removal runs them on a daemon thread and waits while each step
returns within its bound (`Finishing.wait`); a step that has not returned by then is given up,
removal returns and says which files were not written, and the thread is left to end by itself
if the write ever returns. The thread keeps the run's lock until then (`after`), so no
`finalize` and no resume writes the directory beside it; the lock ends with the process at the
latest, and a reader is told that a live process holds it. A step's bound is the caller's
(`sinks.directory`: a flush interval, at least 10 s, more for a merge of many rows), since a
slow disk that still answers must not be given up. The cost: one short-lived thread per
removal. Where no thread can be started (removal from an exit handler: Python 3.12 refuses new
threads there), the finish runs on the removing thread, unbounded, as it did before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Finishing"]

T = TypeVar("T")


class Finishing(Generic[T]):
    """Runs `work(step)` on a daemon thread, then `after()`; `work` calls `step(name)` as it
    begins each step, so `wait` can bound each step on its own.

    Args:
        work: the finish; returns its report.
        after: run on the thread once `work` has ended, however it ended (releases the lock).
        name: the thread's name.
    """

    def __init__(
        self, work: Callable[[Callable[[str], None]], T], after: Callable[[], None], name: str
    ) -> None:
        self._cond = threading.Condition()
        self._step = "starting"  # the step in progress; its start, monotonic
        self._since = time.monotonic()
        self._done = False
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(work, after), name=name, daemon=True
        )
        try:
            self._thread.start()
        except RuntimeError:  # no thread can start (an exit handler, Python 3.12): run it here
            self._run(work, after)

    @property
    def step(self) -> str:
        """The step in progress (the name `work` gave it last)."""
        return self._step

    @property
    def done(self) -> bool:
        """Whether the work and `after` have ended (the run's lock is released)."""
        return self._done

    def _begin(self, step: str) -> None:
        with self._cond:
            self._step, self._since = step, time.monotonic()
            self._cond.notify_all()

    def _run(self, work: Callable[[Callable[[str], None]], T], after: Callable[[], None]) -> None:
        try:
            self._result = work(self._begin)
        except BaseException as error:  # raised to the waiter, on its thread
            self._error = error
        finally:
            try:
                after()
            finally:
                with self._cond:
                    self._done = True
                    self._cond.notify_all()

    def wait(self, bound: Callable[[str], float]) -> T | None:
        """The work's result once it returned; None when a step ran `bound(step)` seconds
        without returning (the thread is left as it is). What `work` raised is raised here.
        """
        with self._cond:
            while not self._done:
                left = self._since + bound(self._step) - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, threading.TIMEOUT_MAX))  # a bound may be inf
        if self._error is not None:
            raise self._error
        return self._result
