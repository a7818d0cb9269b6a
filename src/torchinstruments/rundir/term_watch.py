"""SIGTERM while the main thread runs no Python: write the rows from another thread, then let the
signal end the process as it would have without the library.

Python runs a signal handler only when the main thread next runs Python code. A main thread
blocked in native code (a rank waiting in a collective for a rank that raised or hangs, a gloo
call on a peer that is gone, a blocking read in C, a long torch op) does not, so once the
library's SIGTERM handler (`rundir.signals`) is in place, a SIGTERM that would have ended such a
process at once (the default action) leaves it running until a SIGKILL, or for ever where none
follows.

Design decision: CPython's C-level signal handler, which runs on whichever thread the kernel
picks, writes the signal's number to the wakeup fd (`signal.set_wakeup_fd`). A watcher thread
reads it. On a SIGTERM it gives the main thread `GRACE_S` to start a handler of the library; it
acts only if none started and the main thread's frame did not move meanwhile (it ran no Python,
so no Python handler could run). A main thread that runs Python handles every SIGTERM itself,
through the handler chain, exactly as before: the watcher then does nothing. When it acts, it
calls `on_stuck` (rundir.signals: every live run writes its buffered rows, then the process ends
with SIGTERM's default action where that is what SIGTERM would have done without the library;
see `end_with_default`).

Costs and limits:
- The wakeup fd is process-wide and has one owner. One already set when the first run starts
  (asyncio's `add_signal_handler`, trio) is left in place and no watcher runs: a SIGTERM then
  waits for the main thread, as documented. One set over ours later receives the bytes instead:
  the same (`trio.run` started then warns that it collided with another library's wakeup fd).
  Python cannot read back `warn_on_full_buffer`, so an fd put back after a look at it
  gets Python's default (warn when full).
- Every signal with a Python handler (SIGINT too) writes a byte; all but SIGTERM are dropped.
- A forked child closes its copies of the pipe and unsets the wakeup fd first thing
  (`forget_in_child`), so a SIGTERM to the child does not reach the parent's watcher; one that
  lands in the microseconds before that hook runs is acted on by the parent only if the parent's
  main thread, too, ran no Python for `GRACE_S` (a wrongly ended parent needs both at once).
"""

from __future__ import annotations

import contextlib
import ctypes  # at import, on the main thread: the watcher never imports while it may be stuck
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

__all__ = ["GRACE_S", "TermWatcher", "end_with_default"]

# How long the main thread has to start a Python handler before the watcher takes the SIGTERM.
# A main thread that runs Python starts one within microseconds; one blocked in C never does.
GRACE_S = 1.0
_LOOK_S = 0.05  # how often the watcher looks at the main thread during the grace
_STOP = 0  # the byte that ends the watcher (no signal has the number 0)


class TermWatcher:
    """Reads the wakeup fd on a daemon thread and calls `on_stuck` for a SIGTERM that the main
    thread cannot handle (module docstring).

    Args:
        on_stuck: what to do then; runs on the watcher thread.
        progress: (handlers of ours started so far, handlers of ours running now, when the
            last one started, `time.monotonic`); read only, the main thread counts them
            (rundir.signals).
    """

    def __init__(
        self, on_stuck: Callable[[], None], progress: Callable[[], tuple[int, int, float]]
    ) -> None:
        self._on_stuck = on_stuck
        self._progress = progress
        self._read = self._write = -1
        self._stopping = False
        self._main = threading.main_thread().ident
        self._thread: threading.Thread | None = None
        self._frame_of: Callable[[int | None], FrameType | None] = lambda _: None

    def start(self) -> bool:
        """Point the wakeup fd at a pipe of ours and start the thread; main thread only.

        Returns False, with everything left as it was, where another wakeup fd is set or
        Python refuses one (not POSIX, not the main thread)."""
        if os.name != "posix":
            return False
        # CPython's frames, read where private names live; imported here, on the main thread
        # of a process that observes (torch is loaded), never by the watcher while the main
        # thread might hold the import lock
        from torchinstruments._torch_internals import innermost_frame

        self._frame_of = innermost_frame
        read, write = os.pipe()  # close-on-exec: a program exec'd from here inherits neither
        os.set_blocking(write, False)  # the C handler must never block on it
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read)
            os.close(write)
            return False
        if previous != -1:  # someone else's (an event loop): theirs, not ours to take
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return False
        self._read, self._write = read, write
        thread = threading.Thread(target=self._run, name="torchinstruments SIGTERM watcher")
        thread.daemon = True
        thread.start()
        self._thread = thread
        return True

    def stop(self) -> None:
        """Unset the wakeup fd if it is still ours and end the thread; main thread only.

        Waits for the thread (it reads the stop byte at once, unless it is taking a SIGTERM:
        then at most `GRACE_S`), so a run's removal leaves no thread and no fd of it behind."""
        self._unset_wakeup_fd()
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._write, bytes([_STOP]))  # the thread closes both ends
        if self._thread is not None:
            self._thread.join(GRACE_S)

    def forget_in_child(self) -> None:
        """In a forked child (whose copy has no thread): unset the wakeup fd if ours and close
        the child's copies of the pipe, so its signals never reach the parent's watcher."""
        self._unset_wakeup_fd()
        self._stopping = True
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _unset_wakeup_fd(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, self._write):  # set over ours since: leave theirs
                signal.set_wakeup_fd(current)

    def _run(self) -> None:
        """Read signal numbers until stopped; take each SIGTERM (never raises)."""
        try:
            while True:
                try:
                    data = os.read(self._read, 512)
                except OSError:
                    return
                if not data or (self._stopping and _STOP in data):
                    return
                if signal.SIGTERM in data:
                    with contextlib.suppress(Exception):
                        self._take()
        finally:
            for fd in (self._read, self._write):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _take(self) -> None:
        """Call `on_stuck` unless the main thread starts a handler of ours or runs Python within
        `GRACE_S`. A handler of ours running now, or started in the `GRACE_S` before the byte
        was read (the main thread may take the signal before this thread wakes), has it."""
        started, running, last = self._progress()
        if running or time.monotonic() - last < GRACE_S:
            return
        frame, lasti = self._main_frame()
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            time.sleep(_LOOK_S)
            now_started, now_running, _ = self._progress()
            if now_started != started or now_running:
                return  # the handler path has it
            now, now_lasti = self._main_frame()
            if now is not frame or now_lasti != lasti:
                return  # the main thread runs Python: a pending handler runs there
        del frame
        self._on_stuck()

    def _main_frame(self) -> tuple[FrameType | None, int]:
        """The main thread's innermost Python frame and its last instruction (None: it has none)."""
        frame = self._frame_of(self._main)
        return frame, -1 if frame is None else frame.f_lasti


def end_with_default(signum: int) -> bool:
    """End the process with `signum`'s default action from any thread: reset its handler to
    SIG_DFL through the C library (Python's `signal.signal` works only on the main thread) and
    send it again, so the exit status is the one of a process killed by it.

    Returns False where the C library could not be reached (the process goes on)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        reset = libc.signal
        reset.argtypes = (ctypes.c_int, ctypes.c_void_p)
        reset.restype = ctypes.c_void_p
        if reset(signum, None) == ctypes.c_void_p(-1).value:  # SIG_DFL is NULL; SIG_ERR is -1
            return False
    except (OSError, AttributeError):
        return False
    os.kill(os.getpid(), signum)
    return True
