"""Reading the run's TensorBoard steps (`finalize`, a continued run) holds one record at a time,
not the event file, which grows with every sample of a long run."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

from torchinstruments.rundir.event_steps import event_steps

SUMMARY_BYTES = 1000  # about one histogram's summary
HELD_BOUND = 256 * 1024  # a file read whole held 2 and 4 MB below


def event(step: int) -> bytes:
    """An `Event` proto by hand: wall_time (field 1), step (field 2), a summary (field 5)."""
    varint = bytes([SUMMARY_BYTES & 0x7F | 0x80, SUMMARY_BYTES >> 7])
    return b"\x09" + b"\0" * 8 + b"\x10" + bytes([step]) + b"\x2a" + varint + b"s" * SUMMARY_BYTES


def write_events(directory: Path, records: int, torn: bool = False) -> None:
    """`records` summaries at steps 0..9 over and over (TFRecord framing, checksums not read),
    then a torn record with step 99 if `torn`."""
    folder = directory / "tensorboard"
    folder.mkdir(parents=True)
    with (folder / "events.out.tfevents.1.host.1.0").open("wb") as file:
        for n in range(records):
            data = event(n % 10)
            file.write(struct.pack("<Q", len(data)) + b"\0" * 4 + data + b"\0" * 4)
        if torn:
            data = event(99)
            file.write(struct.pack("<Q", len(data)) + b"\0" * 4 + data[:100])


def held_reading(directory: Path) -> tuple[set[int], int]:
    """The steps read, and the most memory held while reading them (bytes, by tracemalloc)."""
    tracemalloc.start()
    try:
        steps = event_steps(directory)
        return steps, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_reading_twice_the_events_holds_no_more_memory(tmp_path: Path) -> None:
    """2 MB and 4 MB of events (2,000 and 4,000 summaries) are read holding less than 256 KiB
    each; the steps are every one written, and a torn last record is left out quietly."""
    for records in (2000, 4000):
        write_events(tmp_path / str(records), records, torn=True)
        steps, held = held_reading(tmp_path / str(records))
        assert steps == set(range(10))
        assert held < HELD_BOUND, (records, held)
