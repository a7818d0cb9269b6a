"""Every private TensorBoard internal the library relies on, one adapter each.

TensorBoard does not promise any of these; an upgrade that moves one breaks here and nowhere else,
and each adapter falls back to TensorBoard's own behaviour (slower, never wrong) where the shape
it expects is missing. Checked on tensorboard 2.21.0 (with torch 2.15.0's `FileWriter`).
"""

from __future__ import annotations

import queue
import struct
import time
from collections.abc import Callable
from typing import Any

from tensorboard.summary.writer.record_writer import RecordWriter

__all__ = [
    "WriterStalledError",
    "replace_byte_queue",
    "replace_record_framing",
    "summary_file_writer",
]


class _ChecksummedRecords(RecordWriter):
    """TensorBoard's record framing (length, masked CRC of length, data, masked CRC of data).

    Why a subclass of TensorBoard's undocumented `RecordWriter`: the async writer's worker calls
    `write` on whatever record writer it holds, and `replace_record_framing` checks that the one
    it replaces is a `RecordWriter`, so the replacement keeps the same class (checked on
    tensorboard 2.21.0).

    Why it keeps its failure: TensorBoard's worker thread re-raises whatever `write` or `flush`
    raised (a full disk), which prints a raw `Exception in thread` traceback and ends the
    thread. Here the first failure is kept in `error` and the writer drops every later record,
    so the thread lives on quietly; the library's foreground calls (`events.EventFile`) raise
    it, where the run directory reports it as one warning.
    """

    def __init__(self, file: Any, masked: Callable[[bytes], int]) -> None:
        super().__init__(file)
        self._file = file
        self._masked = masked
        self.error: BaseException | None = None

    def write(self, data: bytes) -> None:
        if self.error is not None:
            return
        header = struct.pack("<Q", len(data))
        head_crc = struct.pack("<I", self._masked(header))
        data_crc = struct.pack("<I", self._masked(data))
        try:
            self._file.write(header + head_crc + data + data_crc)
        except BaseException as error:  # kept for the foreground; the worker thread goes on
            self.error = error

    def flush(self) -> None:
        if self.error is not None:
            return
        try:
            super().flush()
        except BaseException as error:
            self.error = error


def replace_record_framing(
    event_writer: Any, masked: Callable[[bytes], int]
) -> _ChecksummedRecords | None:
    """Frame the records of `event_writer`'s writer thread with the TFRecord checksum `masked`.

    Why: TensorBoard frames each record with a CRC-32C computed in pure Python, on the writer
    thread, holding the GIL; `events.Crc32c` computes the same checksum in NumPy. Reaches four
    private names of TensorBoard's async writer (`EventFileWriter._async_writer`, its `_writer`
    and `_worker`, the worker's `_record_writer`) and the record writer's `_writer` (the file).

    Returns the record writer it put in place (its `error` holds the first write or flush
    failure, which no longer ends the writer thread), or None, changing nothing, where the
    async writer does not have the known shape. The worker thread reads its record writer
    afresh for every record, and both framings write to the same file object, so a record in
    flight is finished by the old one.
    """
    async_writer = getattr(event_writer, "_async_writer", None)
    worker = getattr(async_writer, "_worker", None)
    records = getattr(async_writer, "_writer", None)
    file = getattr(records, "_writer", None)
    if (
        async_writer is None
        or file is None
        or not isinstance(records, RecordWriter)
        or getattr(worker, "_record_writer", None) is not records
    ):
        return None
    replacement = _ChecksummedRecords(file, masked)
    async_writer._writer = replacement
    worker._record_writer = replacement  # type: ignore[union-attr]  # checked above
    return replacement


class WriterStalledError(TimeoutError):
    """TensorBoard's writer thread did not write the events handed to it in time (its file
    stopped answering: a stalled network file system)."""


class _Handoff:
    """The `queue.Queue` methods TensorBoard's async writer and its thread use, over a
    `queue.SimpleQueue`, whose `put` and `get` are single C calls: no Python-level lock a
    KeyboardInterrupt could leave held (see `replace_byte_queue`). Unbounded, as the foreground
    never waits for room; `join` polls the count of items the thread has finished, at most
    `stall_seconds`: TensorBoard's flush and close hold the async writer's lock while they join,
    and every event the training thread adds takes that lock, so a thread stuck in a write that
    never returns would hang the step; past the wait `join` raises `WriterStalledError` instead.

    Args:
        alive: whether the thread that takes the items still runs (a dead one finishes none).
        stall_seconds: how long `join` waits for the thread before it raises.
    """

    def __init__(self, alive: Callable[[], bool], stall_seconds: float) -> None:
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._alive = alive
        self._stall_seconds = stall_seconds
        self._put = 0  # puts are serialised by the async writer's lock
        self._done = 0  # only the writer thread counts these

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self._items.put(item)
        self._put += 1  # after the put: a cut here makes `join` return early, never hang

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self._items.get(block, timeout)

    def task_done(self) -> None:
        self._done += 1

    def join(self) -> None:
        target = self._put
        deadline = time.monotonic() + self._stall_seconds
        while self._done < target and self._alive():
            if time.monotonic() > deadline:
                raise WriterStalledError(
                    f"TensorBoard's writer thread had not written {target - self._done} queued "
                    f"event(s) after {self._stall_seconds:g} s"
                )
            time.sleep(0.001)


def replace_byte_queue(event_writer: Any, stall_seconds: float) -> bool:
    """Hand the records of `event_writer`'s writer thread over through a `_Handoff` instead of
    TensorBoard's `queue.Queue`.

    Why: `queue.Queue.put` takes its lock in a Python-level `Condition.__enter__`; a
    KeyboardInterrupt raised there (a Ctrl-C lands on any bytecode of the main thread) leaves
    the lock held for good, and the writer thread and every later event, flush and close hang.
    The library holds Ctrl-C while it hands rows to its sinks (interrupts.py), but a
    KeyboardInterrupt raised otherwise (by a library's own signal handling) is not held.

    Reaches TensorBoard's private `_AsyncWriter` (`_byte_queue`, `_worker`, `_writer`) and its
    `_AsyncWriterThread(queue, record_writer, flush_secs)` (checked on tensorboard 2.21.0):
    the thread started with the writer is stopped (it has written every record queued so far)
    and one of the same class is started on the handoff. Returns False, changing nothing,
    where the writer does not have that shape.
    """
    async_writer: Any = getattr(event_writer, "_async_writer", None)
    worker: Any = getattr(async_writer, "_worker", None)
    byte_queue = getattr(async_writer, "_byte_queue", None)
    if (
        not isinstance(byte_queue, queue.Queue)
        or getattr(worker, "_queue", None) is not byte_queue
        or not isinstance(getattr(worker, "_flush_secs", None), int | float)
        or not callable(getattr(worker, "stop", None))
        or not hasattr(async_writer, "_writer")
    ):
        return False
    worker.stop()
    handoff = _Handoff(lambda: replacement.is_alive(), stall_seconds)
    replacement = type(worker)(handoff, async_writer._writer, worker._flush_secs)
    async_writer._byte_queue = handoff
    async_writer._worker = replacement
    replacement.start()
    return True


def summary_file_writer(writer: Any) -> Any | None:
    """The event-file writer behind a caller's SummaryWriter, or None where it has none.

    Why: `SummaryWriter.add_histogram_raw` takes no description, but a tag's description lives
    in its summary's metadata; writing our own `Summary` (with the description) needs the writer
    that `add_histogram_raw` itself uses, `SummaryWriter._get_file_writer()` (torch's and
    tensorboardX's, checked on torch 2.15.0). Returns None (the caller then falls back to
    `add_histogram_raw`, without descriptions) where that method is missing.
    """
    get = getattr(writer, "_get_file_writer", None)
    if not callable(get):
        return None
    events = get()
    return events if callable(getattr(events, "add_summary", None)) else None
