"""Which sampled forwards the run's own TensorBoard events hold, read without torch.

Design decision: the run directory's event files (`tensorboard/`) are flushed on their own
schedule, so after a kill they can hold samples whose history rows died in memory. Their step is
the sample's forward_index (`events.RUN_STEP`), so the steps are a second, independent record of
which root forwards were sampled: `finalize` lists the ones with no history row (index.md says
which), and a continued run starts its forward_index after the last of them, so two attempts
never share a step. The files are TFRecord framed (length, crc, Event proto, crc); they are read
record by record, the two Event fields needed (step, summary) decoded by hand so `finalize`
needs no TensorBoard, and a torn last record (the kill) ends the file quietly. The checksums are not verified: a record is used only for its step.
"""

from __future__ import annotations

import contextlib
import os
import struct
from bisect import bisect_left
from collections.abc import Generator
from pathlib import Path

from torchinstruments.rundir.layout import TENSORBOARD_DIR

_HEADER = struct.Struct("<Q")  # the record's length; then a 4-byte crc of it


def event_steps(directory: Path, since: int = 0) -> set[int]:
    """The steps from `since` on of every summary in `directory/tensorboard/` (empty when there
    is none or it cannot be read).

    Each attempt of a run writes event files of its own, at steps from its first forward_index
    on, and the next attempt starts after them (the run's steps never repeat), so a file whose
    first summary is before `since` is an earlier attempt's and the rest of it is not read: a
    continued run asks only from its earliest killed attempt on, not for the whole job's.
    """
    folder = directory / TENSORBOARD_DIR
    if not since:
        return folder_steps(folder)
    steps: set[int] = set()
    for path in sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else ():
        with contextlib.suppress(OSError), contextlib.closing(_file_steps(path)) as read:
            first = next(read, None)
            if first is not None and first >= since:  # else an earlier attempt's file
                steps.add(first)
                steps.update(step for step in read if step >= since)
    return steps


def folder_steps(folder: Path) -> set[int]:
    """The steps of every summary in the event files of `folder` (any TensorBoard run
    directory, e.g. a trainer's logger's; empty when there is none or it cannot be read)."""
    if not folder.is_dir():
        return set()
    steps: set[int] = set()
    for path in sorted(folder.glob("events.out.tfevents.*")):
        with contextlib.suppress(OSError):
            steps.update(_file_steps(path))
    return steps


def steps_between(steps: list[int], first: int, end: int | None) -> int:
    """How many sorted `steps` are in [first, end) (`end` None: no end), 0 for an empty one:
    two bisections, so counting each attempt's steps costs no pass over the job's."""
    stop = len(steps) if end is None else bisect_left(steps, end)
    return max(0, stop - bisect_left(steps, first))


def _file_steps(path: Path) -> Generator[int]:
    """The steps of the summaries in one event file, read a record at a time: the file grows
    with every sample (about 9 KB a sample for a model of 4 focus layers), and a file read whole
    held it all in memory at each `finalize` and continued run (256 MB for 30,000 samples); one
    record at a time holds one record. A torn last record (the kill) ends it quietly."""
    with path.open("rb") as file:
        left = os.fstat(file.fileno()).st_size
        while left >= 12:
            header = file.read(12)
            if len(header) < 12:
                return  # the file was cut shorter as it was read
            (length,) = _HEADER.unpack_from(header)
            if 12 + length + 4 > left:
                return  # a torn last record
            event = file.read(length)
            file.read(4)
            left -= 12 + length + 4
            try:
                step = _summary_step(event)
            except (IndexError, ValueError):
                return
            if step is not None:
                yield step


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """A protobuf varint at `at`: (value, the offset after it)."""
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _summary_step(event: bytes) -> int | None:
    """An `Event` proto's step when it carries a non-empty summary (field 5), else None.

    Read by hand, field by field (Event: 1 wall_time double, 2 step int64, 5 summary), so this
    module needs neither TensorBoard nor protobuf: `finalize` runs without them.
    """
    at, step, summary = 0, 0, False
    while at < len(event):
        key, at = _varint(event, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(event, at)
            if field == 2:
                step = value - (1 << 64) if value >> 63 else value
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            size, at = _varint(event, at)
            if field == 5 and size:
                summary = True
            at += size
        else:
            raise ValueError(f"unexpected wire type {wire}")
    if at != len(event):
        raise ValueError("truncated event")
    return step if summary else None


__all__ = ["event_steps", "folder_steps", "steps_between"]
