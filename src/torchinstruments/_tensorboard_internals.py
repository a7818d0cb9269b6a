"""Every private TensorBoard internal the library relies on, one adapter each.

TensorBoard does not promise any of these; an upgrade that moves one breaks here and nowhere else,
and each adapter falls back to TensorBoard's own behaviour (slower, never wrong) where the shape
it expects is missing. Checked on tensorboard 2.21.0 (with torch 2.15.0's `FileWriter`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from tensorboard.summary.writer.record_writer import RecordWriter

__all__ = ["replace_record_framing", "summary_file_writer"]


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
