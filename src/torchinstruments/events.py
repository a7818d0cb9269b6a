"""The run directory's TensorBoard event file: TensorBoard's own writer, made cheap per sample.

Design decision: events are written by TensorBoard's writer (torch's `FileWriter` over
TensorBoard's `EventFileWriter`: its file naming, record framing and writer thread), but two of
its per-record costs are taken off the training step, where its thread holds the GIL:

* Without TensorFlow, that writer opens, appends to and closes the file for every record. So
  `EventFile` writes one event per sampled forward (or backward) holding all its focus-layer
  histograms as values of one `Summary`, which TensorBoard reads exactly like one event each.
* Its framing computes each record's CRC-32C in pure Python, byte by byte: about 170 us per KiB.
  `Crc32c` computes the same checksum in a fixed number of NumPy operations per 1 KiB block.

Measured with `uv run bench/event_writer.py` (the MLP of `bench/sampled.py`, 16 histograms per
step): the writer thread's CPU time per step goes from 5.0 to 5.5 ms (one event per histogram)
to 4.0 to 4.4 ms (one per record) and 1.5 ms (with `Crc32c`).

Cost: handing the checksum over reaches private names of TensorBoard's async writer (kept in
`_tensorboard_internals.replace_record_framing`). Where they are missing (another TensorBoard
version) or NumPy is, the writer keeps its own checksum: slower, never wrong. TensorBoard's reader verifies every checksum it reads, and the tests read
every event file back with it; `tests/test_tensorboard.py` also pins that the hand-over happens.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard.summary import histogram_raw
from torch.utils.tensorboard.writer import FileWriter

from torchinstruments._tensorboard_internals import replace_record_framing
from torchinstruments.records import HistogramRecord

if TYPE_CHECKING:
    import numpy as np
else:
    try:  # NumPy comes with TensorBoard, but is not a declared dependency of ours
        import numpy as np
    except ImportError:  # pragma: no cover - exercised only without NumPy
        np = None

__all__ = ["Crc32c", "EventFile", "histogram_arguments"]

_POLYNOMIAL = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected
_MASK = 0xFFFFFFFF
_MASK_DELTA = 0xA282EAD8  # TFRecord's checksum masking constant
# Table rows: one per distance of a byte from the end of its block (BLOCK x 256 uint32, 1 MiB).
_BLOCK = 1024


class Crc32c:
    """CRC-32C and its TFRecord mask, equal to TensorBoard's `masked_crc32c` for every input.

    The checksum is linear over GF(2): with a zero register, it is the XOR of each byte's own
    contribution, which depends only on the byte's value and its distance from the end. One
    table holds those contributions for every distance in a block, so a block's checksum is one
    gather and one XOR-reduction. The register carried into a block (all ones before the first)
    acts as if XORed into the block's first 4 bytes; what of it a shorter block does not reach
    stays in the register, shifted.
    """

    def __init__(self) -> None:
        value = np.arange(256, dtype=np.uint32)
        for _ in range(8):
            value = np.where(value & 1, (value >> 1) ^ np.uint32(_POLYNOMIAL), value >> 1)
        by_distance = np.empty((_BLOCK, 256), dtype=np.uint32)
        by_distance[0] = value
        for distance in range(1, _BLOCK):  # one more zero byte after each
            previous = by_distance[distance - 1]
            by_distance[distance] = value[previous & 0xFF] ^ (previous >> 8)
        # Row i holds distance BLOCK - 1 - i, so a block of L bytes reads rows BLOCK - L onwards.
        self._flat = by_distance[::-1].reshape(-1).copy()
        self._row_starts = np.arange(_BLOCK, dtype=np.int64) * 256

    def _contribution(self, distance: int, byte: int) -> int:
        return int(self._flat[(_BLOCK - 1 - distance) * 256 + byte])

    def crc(self, data: bytes) -> int:
        """The CRC-32C of `data` (initial and final XOR with all ones, as TFRecord uses it)."""
        view = np.frombuffer(data, dtype=np.uint8)
        register = _MASK
        for start in range(0, len(view), _BLOCK):
            chunk = view[start : start + _BLOCK]
            length = len(chunk)
            positions = self._row_starts[_BLOCK - length :] + chunk
            value = int(np.bitwise_xor.reduce(np.take(self._flat, positions)))
            reached = min(length, 4)
            for index in range(reached):  # the register's bytes, XORed into the first ones
                byte = (register >> (8 * index)) & 0xFF
                value ^= self._contribution(length - 1 - index, byte)
            register = value ^ (register >> (8 * reached))
        return register ^ _MASK

    def masked(self, data: bytes) -> int:
        """TFRecord's masked checksum of `data`."""
        crc = self.crc(data)
        return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _MASK


class _ChecksummedRecords(RecordWriter):
    """TensorBoard's record framing (length, masked CRC of length, data, masked CRC of data)."""

    def __init__(self, file: Any, checksum: Crc32c) -> None:
        super().__init__(file)
        self._file = file
        self._checksum = checksum

    def write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        head_crc = struct.pack("<I", self._checksum.masked(header))
        data_crc = struct.pack("<I", self._checksum.masked(data))
        self._file.write(header + head_crc + data + data_crc)


def histogram_arguments(histogram: HistogramRecord) -> dict[str, Any]:
    """The keyword arguments of TensorBoard's raw histogram (`add_histogram_raw`) for a record."""
    return {
        "min": histogram.min,
        "max": histogram.max,
        "num": histogram.num,
        "sum": histogram.sum,
        "sum_squares": histogram.sum_squares,
        "bucket_limits": list(histogram.bucket_limits),
        "bucket_counts": list(histogram.bucket_counts),
    }


class EventFile:
    """The run directory's event file: one event per record, checksummed by `Crc32c`.

    Args:
        log_dir: Directory of the event file (created if missing).
        flush_seconds: How often TensorBoard's writer thread flushes the file.
    """

    def __init__(self, log_dir: str, flush_seconds: float) -> None:
        self._writer = FileWriter(log_dir, flush_secs=flush_seconds)  # type: ignore[arg-type]
        self.fast_checksum = np is not None and _hand_over_checksum(self._writer, Crc32c())

    def add_histograms(self, histograms: Sequence[HistogramRecord]) -> None:
        """One event per sample_id, holding each histogram as one value under its tag."""
        by_step: dict[int, Any] = {}  # sample_id -> its Summary
        for histogram in histograms:
            summary = histogram_raw(histogram.tag, **histogram_arguments(histogram))
            if histogram.sample_id in by_step:
                by_step[histogram.sample_id].value.extend(summary.value)
            else:
                by_step[histogram.sample_id] = summary
        for step, summary in by_step.items():
            self._writer.add_summary(summary, global_step=step)

    def flush(self) -> None:
        """Writes every queued event to the file."""
        self._writer.flush()

    def close(self) -> None:
        """Flushes, stops the writer thread and closes the file."""
        self._writer.close()


def _hand_over_checksum(writer: FileWriter, checksum: Crc32c) -> bool:
    """Frames `writer`'s records with `checksum`, on the same file; False where TensorBoard's
    writer does not have the known shape (`_tensorboard_internals.replace_record_framing`)."""
    return replace_record_framing(
        writer.event_writer, lambda file: _ChecksummedRecords(file, checksum)
    )
