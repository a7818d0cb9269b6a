"""Forked processes: a child of an observing process runs the model unobserved.

`os.fork` copies the parent's memory but only the thread that forked: a lock another thread
held at that moment (the history writer's, TensorBoard's, the sinks') stays held for good in
the child, the run's flush thread, TensorBoard's writer thread and Polars' thread pool do not
exist there, and the run directory is the parent's. A child that went on recording would hang
on one of those (Polars' `write_parquet` waits for a pool that is gone; TensorBoard's event
queue fills with no thread to drain it) or write rows into the parent's run that the parent
does not count.

Design decision: at fork, in the child (`os.register_at_fork(after_in_child=...)`), every live
run is made inert without taking any of its locks or calling any of its threads: the observer
is closed, so its proxies pass every call through and its exit handler finds nothing to do, its
gradient hooks return at once, its sinks are never called again, and the child's copy of the
run lock's descriptor is closed (not unlocked: the lock is the parent's, and `flock` would
release it for the parent too). The child's first root forward warns once. DataLoader workers,
which never call the model, see nothing at all. The parent's run is not affected in any way.

Why the child gets no directory of its own: recording there would need Polars (whose thread
pool does not survive a fork of a process that used it) and new threads in a process whose
other locks are in an unknown state, so `inject_observer` in such a child is refused with a
message that points at the 'spawn' and 'forkserver' start methods, where a child is a fresh
process and can be observed like any other. The refusal is not limited to runs live at the
fork: every run uses Polars (its parts, the merge at removal, the readers of a continued run),
and Polars' pool stays broken in a child of the process that used it, after the run ended too
(a child forked after `remove_observer` hung for ever at its first part). So a child is refused
once any run has opened in an ancestor (`opened_a_run`); a process forked before the first
inject is free to observe, and the message says so.

The one piece of process-wide state in this module mirrors process-wide events: the set of
live runs a fork has to make inert (weak references: a finished run drops out by itself),
whether this process has opened a run, and whether it is a child of one that had.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Protocol


class ForkAware(Protocol):
    """Something a forked child must stop using: made inert by `after_fork_in_child`."""

    def after_fork_in_child(self) -> None:
        """Called in the child right after a fork; must take no lock and start no thread."""
        ...


_LIVE: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_FORKED_FROM_A_RUN = [False]  # a list, so the handler sets it without a `global` statement
_OPENED_A_RUN = [False]  # a run opened here (so Polars' pool was used), or in an ancestor


def track(item: ForkAware) -> None:
    """Have `item` made inert in any process forked from this one while it lives."""
    _LIVE.add(item)


def untrack(item: ForkAware) -> None:
    """Stop tracking `item` (its run ended)."""
    _LIVE.discard(item)


def opened_a_run() -> None:
    """A run opens in this process: a child forked from now on may not open one (Polars)."""
    _OPENED_A_RUN[0] = True


def forked_from_a_run() -> bool:
    """Whether this process was forked from one that had opened a run, live at the fork or
    ended before it (directly or through forks)."""
    return _FORKED_FROM_A_RUN[0]


def forked_child_message(parent_pid: int, directory: object) -> str:
    """The warning of a forked child's first root forward: it records nothing, and why not."""
    return (
        f"this process (pid {os.getpid()}) was forked from the observing process (pid "
        f"{parent_pid}): the model runs unobserved here, nothing this process computes "
        f"is recorded, and the parent's run directory {directory} is not touched. To "
        "observe a child process, start it with the 'spawn' or 'forkserver' method and call "
        "inject_observer in it"
    )


def _after_fork_in_child() -> None:
    """Make every live run of the parent inert in this child; never raises."""
    items = list(_LIVE)
    if items or _OPENED_A_RUN[0]:
        _FORKED_FROM_A_RUN[0] = True
    _LIVE.clear()  # the parent's runs are not this process's to track
    for item in items:
        with contextlib.suppress(Exception):  # a fork handler must not fail the child
            item.after_fork_in_child()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = [
    "ForkAware",
    "forked_child_message",
    "forked_from_a_run",
    "opened_a_run",
    "track",
    "untrack",
]
