"""The run's own event files: records framed and checksummed as TensorBoard frames them, read
back by TensorBoard's record reader, which checks every checksum."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboard.compat.proto.event_pb2 import Event  # type: ignore[attr-defined]
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
    PyRecordReader_New,
    masked_crc32c,
)

from torchinstruments import (
    EveryNForwardsSampler,
    inject_observer,
    remove_observer,
)
from torchinstruments.events import Crc32c, EventFile

from _tensorboard_runs import Reversed

CHECKSUM = Crc32c()  # built once: its table takes a few milliseconds


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000))
def test_checksum_equals_tensorboards_own(data: bytes) -> None:
    assert CHECKSUM.masked(data) == masked_crc32c(data)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 1020, 1023, 1024, 1025, 1027, 1028, 2048, 4099])
def test_checksum_equals_tensorboards_own_around_block_ends(size: int) -> None:
    data = bytes((index * 131 + 7) % 256 for index in range(size))
    assert CHECKSUM.masked(data) == masked_crc32c(data)


def records(path: Path) -> list[Event]:
    """Every record of one event file, each checked against its checksums by TensorBoard."""
    reader = PyRecordReader_New(str(path).encode())
    out = []
    while True:
        try:
            reader.GetNext()  # raises DataLossError on a checksum mismatch
        except errors.OutOfRangeError:
            return out
        out.append(Event.FromString(reader.record()))


def test_run_events_pass_tensorboards_checksums_one_event_per_record(run_dir: Path) -> None:
    model = Reversed()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
    remove_observer(model)
    (path,) = (run_dir / "tensorboard").iterdir()
    events = [event for event in records(path) if event.HasField("summary")]
    # per step, one event for the forward and one for the backward, 8 focus layers each
    assert [event.step for event in events] == [0, 0, 1, 1, 2, 2]
    for event in events:
        assert len(event.summary.value) == 8
        assert all(value.HasField("histo") for value in event.summary.value)


def test_event_file_takes_over_tensorboards_checksum(tmp_path: Path) -> None:
    """Pins the hand-over (private TensorBoard names): a TensorBoard upgrade that breaks it fails
    here instead of silently going back to the slow pure-Python checksum."""
    events = EventFile(str(tmp_path), flush_seconds=1.0)
    events.close()
    assert events.fast_checksum
    (path,) = tmp_path.iterdir()
    assert records(path)[0].file_version == "brain.Event:2"
