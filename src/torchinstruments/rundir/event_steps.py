"""Which sampled forwards the run's own TensorBoard events hold, read without torch.

Design decision: the run directory's event files (`tensorboard/`) are flushed on their own
schedule, so after a kill they can hold samples whose history rows died in memory. Their step is
the sample's forward_index (`events.RUN_STEP`), so the steps are a second, independent record of
which root forwards were sampled: `finalize` lists the ones with no history row (index.md says
which), and a continued run starts its forward_index after the last of them, so two attempts
never share a step. The files are TFRecord framed (length, crc, Event proto, crc); they are read
record by record with TensorBoard's own Event proto, and a torn last record (the kill) ends the
file quietly. The checksums are not verified: a record is used only for its step.
"""

from __future__ import annotations

import struct
from pathlib import Path

from torchinstruments.rundir.layout import TENSORBOARD_DIR

_HEADER = struct.Struct("<Q")  # the record's length; then a 4-byte crc of it


def event_steps(directory: Path) -> set[int]:
    """The steps of every summary in `directory/tensorboard/` (empty when there is none or it
    cannot be read)."""
    folder = directory / TENSORBOARD_DIR
    if not folder.is_dir():
        return set()
    try:
        from tensorboard.compat.proto import event_pb2
    except ImportError:  # pragma: no cover - tensorboard is a runtime dependency
        return set()
    steps: set[int] = set()
    for path in sorted(folder.glob("events.out.tfevents.*")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        offset = 0
        while offset + 12 <= len(data):
            (length,) = _HEADER.unpack_from(data, offset)
            start, end = offset + 12, offset + 12 + length
            if end + 4 > len(data):
                break  # a torn last record
            try:
                event = event_pb2.Event.FromString(data[start:end])  # type: ignore
            except Exception:
                break
            if event.HasField("summary") and event.summary.value:
                steps.add(int(event.step))
            offset = end + 4
    return steps


def ranges(numbers: list[int]) -> str:
    """`"3, 7-9, 12"` for sorted distinct numbers."""
    spans: list[str] = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        spans.append(str(numbers[i]) if i == j else f"{numbers[i]}-{numbers[j]}")
        i = j + 1
    return ", ".join(spans)


__all__ = ["event_steps", "ranges"]
