"""TensorBoard events on disk, read as a test's kill waits for them."""

from __future__ import annotations

import contextlib
from pathlib import Path

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader


def event_steps(directory: Path) -> set[int]:
    """The steps of the events on disk in the run's TensorBoard files (a record cut short by a
    write in progress ends the read of its file)."""
    found: set[int] = set()
    for path in (directory / "tensorboard").glob("events.out.tfevents.*"):
        with contextlib.suppress(Exception):
            found.update(event.step for event in EventFileLoader(str(path)).Load())
    return found
