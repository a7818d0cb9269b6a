"""A spare core: plain CPU tensors measured on a worker thread while the training step goes on.

Design decision: when the process may run on more cores than torch's intra-op threads use
(`torch.get_num_threads()`, times the node's ranks under torchrun, below the cores in
`os.sched_getaffinity`: `torch.set_num_threads(1)` on a machine of several), a sampled
forward's plain CPU tensors, and the gradients into them, are copied on the training thread and
measured on one worker thread per observer while the forward or backward goes on. Records are
still built where they were, at the end of the forward and of the backward: the sinks, the order
of the rows and the values (the same function on the same entries, so the same bits) do not
change, only the thread that computes them. There the training thread measures, last first,
the copies the worker has not begun (`results`), so it never waits for a tensor nobody is
measuring. The copy is what makes this safe: a later in-place operation (a `ReLU(inplace=True)`
after the layer, an optimizer step) changes the tensor, never the copy.

When torch already uses every core (its default), nothing is moved: a worker would take a core
from torch's own threads and slow every parallel op, so each tensor is measured on the training
thread as before (no copy). The cores are read again whenever torch's thread count changes, so
a `torch.set_num_threads` in the middle of a run is followed.

Cost and bounds: a copy is one read and one write of the tensor, about a tenth of measuring it
while its memory is reused, as much as measuring it when fresh pages must be mapped (above
`LARGEST_COPY` entries, which are measured where they are, as are those below `SMALLEST_COPY`). Copies wait in memory until
measured, at most `MAX_BYTES_IN_FLIGHT` (256 MiB); a tensor beyond it is measured on the
training thread at once, so memory stays bounded however far the worker falls behind. The
worker is a daemon thread started at the first tensor it takes and stopped when the observer
closes. The step's CPU time summed over threads is not reduced (the copies add to it);
bench/sampled.py prints it next to the wall time. Small tensors would gain nothing: the
worker's Python between NumPy calls contends for the GIL with the training thread's.

A process forked while tensors wait has no worker: there a waiting tensor is measured by the
thread that asks for it (forks.py makes such a child's run inert, so it seldom asks).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

__all__ = [
    "LARGEST_COPY",
    "MAX_BYTES_IN_FLIGHT",
    "SMALLEST_COPY",
    "Deferred",
    "SpareCore",
    "results",
    "spare_core_count",
]

T = TypeVar("T")
U = TypeVar("U")

MAX_BYTES_IN_FLIGHT = 256 * 2**20
# Tensors of fewer or more entries are measured where they are. Below, measuring takes less
# than the worker's wake-up and the GIL's hand-overs cost (about 0.1 to 0.7 ms a pass here);
# above, the copy takes fresh pages from the system (about 2.2 ns an entry for 1e7 float32, as
# much as measuring them) and seldom has anything left in the pass to overlap with.
SMALLEST_COPY, LARGEST_COPY = 2**16, 2**22


def spare_core_count(threads: int) -> int:
    """Cores this process may run on beyond `threads` (torch's intra-op threads) for each of the
    node's ranks (`LOCAL_WORLD_SIZE`, as torchrun sets it, which also gives each rank one thread
    by default: its ranks share the cores every one of them sees)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        cores = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(0, cores - threads * ranks)


class Deferred(Generic[T]):
    """One tensor's measurement on a copy: computed by the worker, or by the thread that asks
    for it first (`claim`); `result()` waits for it."""

    __slots__ = ("_claimed", "_copy", "_error", "_job", "_pending", "_pid", "_value", "nbytes")

    def __init__(self, job: Callable[[torch.Tensor], T], copy: torch.Tensor) -> None:
        self._job: Callable[[torch.Tensor], T] | None = job
        self._copy: torch.Tensor | None = copy
        self.nbytes = copy.numel() * copy.element_size()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._pid = os.getpid()
        self._claimed = threading.Lock()  # taken by whichever thread computes it
        self._pending = threading.Lock()  # held until the value is set
        self._pending.acquire()

    @property
    def done(self) -> bool:
        """Whether the value (or the job's exception) is set."""
        return self._job is None

    def claim(self) -> None:
        """Compute it on this thread unless another thread has begun to (or has)."""
        if self._claimed.acquire(blocking=False):
            self._compute()

    def _compute(self) -> None:
        """Run the job on the copy, keep its value or exception, and drop the copy."""
        job, copy = self._job, self._copy
        if job is None or copy is None:
            return  # computed already (in a forked child: before `claim`)
        try:
            self._value = job(copy)
        except BaseException as error:  # kept for `result`, which raises it in the caller
            self._error = error
        finally:
            self._job = self._copy = None
            self._pending.release()

    def result(self) -> T:
        """The job's value: computed here if no thread has begun it, else waited for (in a
        forked child, where the worker that began it does not exist, computed here)."""
        if self._job is not None and os.getpid() != self._pid:
            self._pid = os.getpid()
            self._compute()
        self.claim()
        with self._pending:
            pass
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set by compute without an error


def results(items: Sequence[U | Deferred[T]]) -> list[U | T]:
    """`items` with every `Deferred` replaced by its result. The caller computes the ones the
    worker has not begun, last first, while the worker goes on from the first: they meet
    between, and the caller never waits for a tensor nobody is measuring."""
    for item in reversed(items):
        if isinstance(item, Deferred):
            item.claim()
    return [item.result() if isinstance(item, Deferred) else item for item in items]


class SpareCore:
    """One observer's worker for plain CPU tensors (see the module docstring).

    `run` measures a tensor's copy on the worker (a `Deferred`) when a core is spare, else the
    tensor at once.
    """

    def __init__(self, max_bytes: int = MAX_BYTES_IN_FLIGHT) -> None:
        self.max_bytes = max_bytes  # of copies waiting for the worker; beyond, measured at once
        self._threads = 0  # torch's thread count when `_spare` was last read
        self._spare = False
        self._queue: queue.SimpleQueue[Deferred | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._in_flight: deque[Deferred] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False

    def run(self, job: Callable[[torch.Tensor], T], tensor: torch.Tensor) -> T | Deferred[T]:
        """`job` of `tensor` (detached): on a copy by the worker when a core is spare and the
        copies in flight leave room, else now on this thread."""
        tensor = tensor.detach()
        if (threads := torch.get_num_threads()) != self._threads:
            self._threads, self._spare = threads, spare_core_count(threads) > 0
        if not self._spare or self._closed or tensor.device.type != "cpu":
            return job(tensor)
        if not SMALLEST_COPY <= tensor.numel() <= LARGEST_COPY:
            return job(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:  # held for the bookkeeping only, never while a tensor is copied
            while self._in_flight and self._in_flight[0].done:
                self._bytes -= self._in_flight.popleft().nbytes
            room = not self._closed and self._bytes + nbytes <= self.max_bytes
            self._bytes += nbytes if room else 0  # reserved for the copy
        if not room:
            return job(tensor)
        try:
            deferred = Deferred(job, tensor.clone(memory_format=torch.contiguous_format))
        except BaseException:
            with self._lock:
                self._bytes -= nbytes
            raise
        with self._lock:
            self._in_flight.append(deferred)
            if self._closed:  # closed meanwhile: whoever asks for it measures it (`results`)
                return deferred
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._work, name="torchinstruments-spare-core", daemon=True
                )
                self._thread.start()
        self._queue.put(deferred)
        return deferred

    def _work(self) -> None:
        """The worker: compute each deferred measurement in order until `close`."""
        while (deferred := self._queue.get()) is not None:
            deferred.claim()

    def close(self) -> None:
        """Finish what is waiting, then stop the worker (idempotent)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join()
