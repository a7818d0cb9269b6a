"""inject_observer's first touches of the run directory, each waited for only so long.

Design decision: at inject the run looks for an earlier run in the directory, takes its lock,
and writes result.json (the catalog), the state file, index.md and the disk reserve. On a file
system that stopped answering each of those blocks in the kernel for good, and no Python code
can interrupt it: inject_observer would never return, and the training script would hang
before its first step without a word. So they run on a thread of their own
(`rundir.finishing.Finishing`), each step waited for at most `wait_s`, the bound removal waits
for its own writes of the same files (`sinks.directory.removal_wait_s`: a flush interval, at
least 10 s), so a slow disk that still answers is not refused.

A step that fails, or one that has not returned by then, makes inject_observer raise an error
naming output_dir, before the model is changed: a directory that cannot hold the run is refused
at inject like a bad argument, where going on would record a run that cannot be written (its
every row lost, its state never on disk) behind a warning a long job may never show. The user
learns it at once and passes another output_dir. What this inject wrote is deleted again (the
run never started), or for a continued run its state file and index.md are written back as the
earlier attempts left them (the refused attempt is none of the run's: left listed in progress,
the next resume=True would count it as killed, with no rows), and the lock is released. A step given up goes on in its thread, which holds the lock until
the write returns and then does the same; meanwhile this process's refusals of the directory
name that write (`rundir.stuck_writes`). With resume=True, completing the earlier attempt first
(`rundir.resume`, which runs `finalize`) is bounded the same way (`run_within`), each of its steps
as removal bounds its own; nothing of it is undone, since it is the earlier attempt's own
completion. The cost: one short-lived thread per inject (two with resume=True).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from torchinstruments.rundir import stuck_writes
from torchinstruments.rundir.finishing import Finishing
from torchinstruments.rundir.layout import LOCK_FILE
from torchinstruments.rundir.lock import RunLock
from torchinstruments.rundir.shell import error_said

__all__ = ["CHECK_STEP", "open_within", "run_within"]

T = TypeVar("T")

# The first step's name: the look for an earlier run (a listing, no write).
CHECK_STEP = "the listing of output_dir"


class _GivenUpError(Exception):
    """The waiter gave the opening up: its thread stops at its next step."""


class _Opening:
    """The work of one opening and what the waiter and its thread share: which files it wrote,
    whether the waiter gave it up, and whether it completed."""

    def __init__(
        self,
        directory: Path,
        lock: RunLock,
        check: Callable[[], None],
        writes: Sequence[tuple[str, Callable[[], None]]],
        fresh: bool,
        released: Callable[[], None],
        restore: Callable[[], None] | None,
    ) -> None:
        self._directory = directory
        self._restore = restore
        self._lock = lock
        self._check = check
        self._writes = writes
        self._fresh = fresh
        self._released = released
        self._guard = threading.Lock()
        self._abandoned = False
        self._completed = False
        self._undone = False
        self._written: list[str] = []  # files this opening put in place
        self._current: str | None = None  # the file being written

    def work(self, step: Callable[[str], None]) -> None:
        """Check, lock, write; on any failure (or once given up) undo what it did."""

        def begin(name: str, *, a_file: bool = True) -> None:
            with self._guard:
                if self._abandoned:
                    raise _GivenUpError
                if self._current is not None:
                    self._written.append(self._current)
                self._current = name if a_file else None
            step(name)

        try:
            begin(CHECK_STEP, a_file=False)
            self._check()
            begin(LOCK_FILE, a_file=False)  # the lock file is left in place, as after any run
            self._directory.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
            for name, write in self._writes:
                begin(name)
                write()
        except BaseException:
            self._undo()
            raise
        with self._guard:
            if self._current is not None:
                self._written.append(self._current)
                self._current = None
            if not self._abandoned:
                self._completed = True
                return
        self._undo()  # it returned after the waiter gave it up

    def abandon(self) -> bool:
        """Give the opening up. True when it had completed already (then it stands); else its
        thread undoes it once its step returns."""
        with self._guard:
            if self._completed:
                return True
            self._abandoned = True
            return False

    def undo_completed(self) -> None:
        """Undo an opening that completed, on the caller's thread (the caller did not take it:
        a KeyboardInterrupt while it waited)."""
        self._undo()

    def not_written(self, step: str) -> tuple[str, ...]:
        """The files not put in place when the opening is at `step`."""
        names = [name for name, _ in self._writes]
        return tuple(names[names.index(step) :]) if step in names else (step, *names)

    def _undo(self) -> None:
        """Delete the files this opening wrote (a new run's), or put back the state the earlier
        attempts left (a continued run's, `restore`: else the state file this opening wrote
        would list its attempt in progress, and the next resume=True would count it as killed,
        an attempt with no rows); release the lock."""
        with self._guard:
            if self._undone:
                return
            self._undone = True
            written = list(self._written)
        try:
            if self._fresh and self._lock.held:
                for name in reversed(written):
                    path = self._directory / name
                    with contextlib.suppress(OSError):  # a folder only if it is empty
                        path.rmdir() if path.is_dir() else path.unlink()
            elif self._lock.held and self._restore is not None and written:
                with contextlib.suppress(OSError):  # as it fails, the next resume=True says so
                    self._restore()
        finally:
            self._lock.release()
            self._released()


def open_within(
    directory: Path,
    lock: RunLock,
    check: Callable[[], None],
    writes: Sequence[tuple[str, Callable[[], None]]],
    wait_s: float,
    *,
    fresh: bool,
    released: Callable[[], None],
    restore: Callable[[], None] | None = None,
) -> None:
    """Run `check()`, take `lock`, then each of `writes` on a thread, each step waited for at
    most `wait_s`.

    Args:
        directory: the run directory (output_dir).
        lock: its lock, held on return.
        check: refuses a directory that holds a run (a listing; it raises as it likes).
        writes: the first files, in order: (file name, the function that writes it).
        wait_s: how long each step is waited for.
        fresh: a new run (its files are deleted when the opening fails), not a continued one.
        released: called once the lock is released after a failure (forks stop tracking it).
        restore: a continued run's: writes back the state file and index.md as the earlier
            attempts left them, when the opening fails or is given up after writing any.

    Raises:
        TimeoutError: a step had not returned after `wait_s` (the message names output_dir).
        OSError: a step failed (the same kind as the failure; the message names output_dir).
        Whatever `check` or the lock raise (FileExistsError, RunLockedError), as they raise it.
    """
    opening = _Opening(directory, lock, check, writes, fresh, released, restore)
    finishing = Finishing(opening.work, _nothing, f"torchinstruments open {directory}")
    try:
        done = finishing.wait(lambda step: wait_s)
    except OSError as error:
        if finishing.step == CHECK_STEP:
            raise
        raise _failed(directory, finishing.step, error, fresh) from error
    except BaseException:  # a KeyboardInterrupt while it waited: the opening is not taken
        if opening.abandon():
            opening.undo_completed()
        raise
    if done is None and not opening.abandon():
        step = finishing.step
        raise _given_up(
            directory,
            stuck_writes.StuckWrite(
                "inject_observer's opening of the run",
                finishing,
                wait_s,
                opening.not_written(step),
                _AFTER_GIVE_UP[fresh],
            ),
            step if step == CHECK_STEP else f"writing {step} there",
            "That write goes on in a thread of this process, which holds the directory's lock "
            "until it returns",
        )


def run_within(
    directory: Path,
    work: Callable[[Callable[[str], None]], T],
    bound: Callable[[str], float],
    what: str,
    advice: str,
) -> T:
    """`work(step)` on a thread, each step waited for at most `bound(step)`: its result, or
    what it raised. For inject's steps that are not its own writes (resume=True completing the
    earlier attempt with `finalize`), which nothing undoes.

    Raises:
        TimeoutError: a step had not returned in time (the message names output_dir); the
            thread goes on, and this process's refusals of the directory name it meanwhile.
    """
    finishing = Finishing(work, _nothing, f"torchinstruments open {directory}")
    done = finishing.wait(bound)
    if done is not None:
        return done
    step = finishing.step
    raise _given_up(
        directory,
        stuck_writes.StuckWrite(what, finishing, bound(step), (step,), advice),
        f"{what}, at {step},",
        "That step goes on in a thread of this process",
    )


def _given_up(
    directory: Path, stuck: stuck_writes.StuckWrite, doing: str, going_on: str
) -> TimeoutError:
    """Record `stuck` (this process's refusals of `directory` name it until its thread ends)
    and return the error inject_observer raises: `doing` had not returned in time."""
    stuck_writes.record(directory, stuck)
    return TimeoutError(
        f"inject_observer: output_dir={str(directory)!r} does not answer: {doing} had "
        f"not returned after {stuck.waited_s:g} s (a file system that stopped answering?). The "
        "model is not observed (nothing of it was changed); pass an output_dir on a disk "
        f"that answers, or check this one. {going_on}; {stuck.advice}"
    )


_AFTER_GIVE_UP = {
    True: "once it returns, the files this inject wrote there are deleted, the lock is "
    "released, and the directory takes a new run.",
    False: "once it returns, the run's state file and index.md are put back as the earlier "
    "attempts left them (this attempt is not one of the run's), the lock is released, and "
    "resume=True continues the run there.",
}


def _failed(directory: Path, step: str, error: OSError, fresh: bool) -> OSError:
    """The error inject_observer raises when the opening failed at `step` with `error`: the
    same kind of OSError, its message naming output_dir and what to do."""
    undone = " and what this inject wrote there was deleted" if fresh else ""
    message = (
        f"inject_observer: output_dir={str(directory)!r} cannot hold the run: {step} could not "
        f"be written there ({error_said(error)}). The model is not observed "
        f"(nothing of it was changed){undone}; pass an output_dir this process can write "
        "(its permissions, free space)."
    )
    return OSError(error.errno, message) if error.errno is not None else OSError(message)


def _nothing() -> None:
    """The opening's `after`: what it does at its end, it does in `work` (`_Opening._undo`)."""
