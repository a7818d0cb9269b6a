"""A spare core: plain CPU tensors measured on a worker thread while the training step goes on.

Design decision: when the process may run on more cores than torch's intra-op threads use
(`torch.get_num_threads()`, times the node's ranks under torchrun, below the cores in
`os.sched_getaffinity`: `torch.set_num_threads(1)` on a machine of several), a sampled forward's
plain CPU tensors, and the gradients into them, are copied on the training thread and measured on
one worker thread per observer while the forward or backward goes on (`run`). Records are still
built where they were, at the end of the forward and of the backward: the sinks, the order of the
rows and the values (the same function on the same entries, so the same bits) do not change, only
the thread that computes them. There the training thread computes, last first, the jobs the worker
has not begun (`results`), so it never waits for a tensor nobody is measuring. The copy is what
makes this safe: a later in-place operation (a `ReLU(inplace=True)` after the layer, an optimizer
step) changes the tensor, never the copy.

When torch already uses every core (its default), nothing is moved: a worker would take a core
from torch's own threads and slow every parallel op, so each tensor is measured on the training
thread as before (no copy). The cores are read again whenever torch's thread count changes, so
a `torch.set_num_threads` in the middle of a run is followed.

Cost and bounds: a copy is one read and one write of the tensor, about a tenth of measuring it
while its memory is reused, as much as measuring it when fresh pages must be mapped (above
`LARGEST_COPY` entries, which are measured where they are, as are those below `SMALLEST_COPY`).
So a copy is written into the memory of a finished one of the same size where one is kept
(`_reuse`: a layer's sizes repeat every sample), at most `MAX_BYTES_REUSED` (64 MiB) of it, let go
when the observer closes: freed and allocated again, copies kept for a pass took fresh pages from
the system each time (436 us for a copy of 2**18 float32 entries on a Zen 4 EPYC, 32 us reused).
Copies wait in memory until measured, at most `MAX_BYTES_IN_FLIGHT` (256 MiB); a tensor beyond it
is measured on the training thread at once, so memory stays bounded however far the worker falls
behind. The lane's copies of `lane.HELD_FROM` entries or more live until the end of their pass, at
most `MAX_BYTES_HELD` (64 MiB) of them at once (`hold`, `release`); beyond, a tensor is measured at
once. A job costs one object and, when the worker sleeps, one wake-up (a system call, about 12 us
here); one lock guards every job's state. The worker is a daemon thread started at the first job
and stopped when the observer closes. The step's CPU time summed over threads is not reduced (the
copies add to it); bench/sampled.py prints it next to the wall time. Jobs are NumPy calls that
release the GIL: Python run on the worker between them would hold the training thread's Python
back.

Design decision: the small-tensor lane's sorts stay on the training thread, at the end of the
pass. Handing a job over costs the training thread a lock, a share of a wake-up and the GIL's
hand-overs around it: about 60 us a job here, more than NumPy's AVX-512 sort takes for a copy of
16,384 float32 entries on an Intel Xeon (36 us; handing them over made bench/sampled.py's MLP
step 0.8 ms slower). Where a CPU sorts slowly (a Zen 4 AMD EPYC's NumPy sort of the same copy takes
several times as long) the lane selects instead of sorting (`order.selection_is_quicker`, timed
once per process), which costs the same on every CPU.

`Buffers`: the arrays the lane's batch at the end of a pass reuses from the last one's (a fresh
array of a megabyte maps fresh pages, a fault each, more than the batch's arithmetic costs).

A process forked while jobs wait has no worker: there a waiting job is computed by the thread
that asks for it, without the lock the fork may have copied held (forks.py makes such a child's
run inert, so it seldom asks).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch

__all__ = [
    "KEPT_BYTES",
    "LARGEST_COPY",
    "MAX_BYTES_HELD",
    "MAX_BYTES_IN_FLIGHT",
    "MAX_BYTES_REUSED",
    "SMALLEST_COPY",
    "Buffers",
    "Deferred",
    "SpareCore",
    "results",
    "spare_core_count",
]

T = TypeVar("T")
U = TypeVar("U")

MAX_BYTES_IN_FLIGHT = 256 * 2**20
# The most `Buffers` keeps per array (a batch of 2**22 float32 entries).
KEPT_BYTES = 16 * 2**20
# The lane's copies kept until the end of their pass (`SpareCore.hold`), over all passes.
MAX_BYTES_HELD = 64 * 2**20
# The memory of finished copies kept for the next ones of the same size, at most.
MAX_BYTES_REUSED = 64 * 2**20
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


class Buffers:
    """NumPy arrays one batch of the lane borrows from the last (`SpareCore.buffers` lends them
    to one pass at a time): a fresh array of a megabyte maps fresh pages, a fault of about 1.7
    us each here. Each name keeps one array, of at most `KEPT_BYTES`; a `Buffers()` of its own
    keeps none."""

    def __init__(self, keep: bool = False) -> None:
        self._keep = keep
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str, size: int, dtype: type) -> np.ndarray:
        """Room for `size` entries of `dtype` under `name` (contents undefined)."""
        kept = self._arrays.get(name)
        if kept is not None and kept.size >= size and kept.dtype == dtype:
            return kept[:size]
        made = np.empty(size, dtype)
        if self._keep and made.nbytes <= KEPT_BYTES:
            self._arrays[name] = made
        return made


_WAITING, _TAKEN, _DONE = 0, 1, 2


class Deferred(Generic[T]):
    """One job on a private payload (a tensor's copy): computed by the worker, or by the thread
    that asks for it first (`claim`); `result()` waits for it. Its state changes under its
    core's one lock; each item costs no lock of its own."""

    __slots__ = (
        "_buffer",
        "_core",
        "_error",
        "_job",
        "_payload",
        "_pid",
        "_state",
        "_value",
        "_waiter",
    )

    def __init__(
        self,
        core: SpareCore,
        job: Callable[[Any], T],
        payload: Any,
        buffer: np.ndarray | None = None,
    ) -> None:
        self._core = core
        self._buffer = buffer  # the payload's memory, reused once the job has succeeded
        self._job: Callable[[Any], T] | None = job
        self._payload = payload
        self._value: T | None = None
        self._error: BaseException | None = None
        self._state = _WAITING
        self._waiter: threading.Event | None = None  # made only when someone must wait
        self._pid = os.getpid()

    @property
    def done(self) -> bool:
        """Whether the value (or the job's exception) is set."""
        return self._state == _DONE

    def claim(self) -> None:
        """Compute it on this thread unless another thread has begun to (or has); in a forked
        child, `result` does (without the lock)."""
        if self._state != _WAITING or os.getpid() != self._pid:  # a state only moves forward
            return
        with self._core.lock:
            if self._state != _WAITING:
                return
            self._state = _TAKEN
        self._compute()

    def _compute(self, locked: bool = True) -> None:
        """Run the job on the payload, keep its value or exception, and drop the payload (the
        state set under the core's lock unless not `locked`: in a forked child)."""
        job, payload = self._job, self._payload
        if job is None:
            return  # computed already (in a forked child: before `claim`)
        buffer, self._buffer = self._buffer, None
        try:
            self._value = job(payload)
        except BaseException as error:  # kept for `result`, which raises it in the caller
            self._error = error
            buffer = None  # its traceback may hold the payload: never reused
        finally:
            with self._core.lock if locked else contextlib.nullcontext():
                self._job = self._payload = None
                self._state = _DONE
                waiter = self._waiter
                self._core._reuse(buffer)
            if waiter is not None:
                waiter.set()

    def result(self) -> T:
        """The job's value: computed here if no thread has begun it, else waited for (in a
        forked child, where the worker that began it does not exist, computed here without
        the lock, which the fork may have copied held)."""
        if self._state != _DONE and os.getpid() != self._pid:
            self._pid = os.getpid()
            self._compute(locked=False)
        if self._state != _DONE:
            self.claim()
        if self._state != _DONE:
            with self._core.lock:
                if self._state != _DONE and self._waiter is None:
                    self._waiter = threading.Event()
                waiter = self._waiter if self._state != _DONE else None
            if waiter is not None:
                waiter.wait()
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
    """One observer's worker for plain CPU tensors, and the bound on its copies (see the
    module docstring).

    `run` measures a tensor's copy on the worker (a `Deferred`) when a core is spare, else the
    tensor at once; `hold` and `release` count the bytes of the lane's copies kept until the
    end of their pass.
    """

    def __init__(self, max_bytes: int = MAX_BYTES_IN_FLIGHT) -> None:
        self.max_bytes = max_bytes  # of copies waiting for the worker; beyond, measured at once
        self.lock = threading.Lock()  # every item's state, the queue, the counts
        self._threads = 0  # torch's thread count when `_spare` was last read
        self._spare = False
        self._queue: deque[Deferred] = deque()
        self._ready = threading.Condition(self.lock)  # the worker sleeps on it
        self._thread: threading.Thread | None = None
        self._in_flight: deque[tuple[Deferred, int]] = deque()
        self._bytes = 0
        self._held = 0
        self._sleeping = False  # the worker waits on `_ready` (woken as `_submit` says)
        self._closed = False
        self._buffers = Buffers(keep=True)
        self._reused: dict[int, list[np.ndarray]] = {}  # copies' memory by size (`_reuse`)
        self._reused_bytes = 0
        self._lending = threading.Lock()

    def spare(self) -> bool:
        """Whether a core is spare now (torch's thread count is read at every call)."""
        if (threads := torch.get_num_threads()) != self._threads:
            self._threads, self._spare = threads, spare_core_count(threads) > 0
        return self._spare and not self._closed

    def run(self, job: Callable[[torch.Tensor], T], tensor: torch.Tensor) -> T | Deferred[T]:
        """`job` of `tensor` (detached): on a copy by the worker when a core is spare, the
        tensor has `SMALLEST_COPY` to `LARGEST_COPY` entries and the copies in flight leave
        room, else now on this thread."""
        tensor = tensor.detach()
        if not self.spare() or tensor.device.type != "cpu":
            return job(tensor)
        if not SMALLEST_COPY <= tensor.numel() <= LARGEST_COPY:
            return job(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self.lock:  # held for the bookkeeping only, never while a tensor is copied
            while self._in_flight and self._in_flight[0][0].done:
                self._bytes -= self._in_flight.popleft()[1]
            room = not self._closed and self._bytes + nbytes <= self.max_bytes
            self._bytes += nbytes if room else 0  # reserved for the copy
        if not room:
            return job(tensor)
        try:
            with self.lock:
                kept = self._reused.get(nbytes)
                buffer = kept.pop() if kept else None
                self._reused_bytes -= nbytes if buffer is not None else 0
                if kept == []:
                    del self._reused[nbytes]
            buffer = np.empty(nbytes, np.uint8) if buffer is None else buffer
            # A tensor made now (in the caller's inference mode or not) over kept memory.
            copy = torch.from_numpy(buffer).view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor)
        except BaseException:
            with self.lock:
                self._bytes -= nbytes
            raise
        return self._submit(job, copy, nbytes, buffer)

    def _reuse(self, buffer: np.ndarray | None) -> None:
        """Keep a finished job's copy memory for a later copy of the same size (the caller
        holds the lock); beyond `MAX_BYTES_REUSED`, the sizes used longest ago are let go
        first, so shapes that change every sample (a sequence length) hold nothing for long."""
        if buffer is None or self._closed or buffer.nbytes > MAX_BYTES_REUSED:
            return
        self._reused[buffer.nbytes] = [*self._reused.pop(buffer.nbytes, ()), buffer]  # newest
        self._reused_bytes += buffer.nbytes
        while self._reused_bytes > MAX_BYTES_REUSED:
            oldest = next(iter(self._reused))
            self._reused_bytes -= self._reused[oldest].pop().nbytes
            if not self._reused[oldest]:
                del self._reused[oldest]

    def _submit(
        self, job: Callable[[Any], T], payload: Any, nbytes: int, buffer: np.ndarray
    ) -> Deferred[T]:
        """Queue one job for the worker, started at its first job."""
        deferred = Deferred(self, job, payload, buffer)
        with self.lock:
            self._in_flight.append((deferred, nbytes))
            if self._closed:  # closed meanwhile: whoever asks for it computes it (`results`)
                return deferred
            self._queue.append(deferred)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._work, name="torchinstruments-spare-core", daemon=True
                )
                self._thread.start()
            elif self._sleeping:
                self._ready.notify()
        return deferred

    def hold(self, nbytes: int) -> bool:
        """Count `nbytes` of a copy kept until the end of its pass, if they fit under
        `MAX_BYTES_HELD` with the others (else False: measure the tensor at once)."""
        if not nbytes:
            return True
        with self.lock:
            if self._held + nbytes > MAX_BYTES_HELD:
                return False
            self._held += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """The end of a pass: its `hold`s' bytes are free again."""
        if not nbytes:
            return
        with self.lock:
            self._held -= nbytes

    @contextlib.contextmanager
    def buffers(self) -> Iterator[Buffers]:
        """The kept `Buffers` for one pass's batch, or while another pass has them (two threads
        emitting at once), a `Buffers` of its own."""
        if not self._lending.acquire(blocking=False):
            yield Buffers()
            return
        try:
            yield self._buffers
        finally:
            self._lending.release()

    def _work(self) -> None:
        """The worker: compute each queued job in order until `close`."""
        while True:
            with self.lock:
                while not self._queue:
                    if self._closed:
                        return
                    self._sleeping = True
                    self._ready.wait()
                    self._sleeping = False
                deferred = self._queue.popleft()
                if deferred._state != _WAITING:  # claimed by the thread that asked for it
                    continue
                deferred._state = _TAKEN
            deferred._compute()

    def close(self) -> None:
        """Finish what is waiting, then stop the worker (idempotent)."""
        with self.lock:
            self._closed = True
            thread, self._thread = self._thread, None
            self._ready.notify()
            self._reused.clear()
            self._reused_bytes = 0
        if thread is not None and thread.is_alive():
            thread.join()
