"""The small-tensor lane in whole runs: the rows the general path writes, in fewer objects.

A run with the lane writes the rows and histograms a run without it writes; a sampled forward
keeps few objects for the garbage collector per measured tensor (the lane's reason for
existing); a lane block is a sequence of its measurements; a copy that fails hands its tensor
to the general path.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.measurement import lane, transfer
from torchinstruments.measurement.reducers import DEFAULT_METRICS, Measurer
from torchinstruments.records import (
    HistogramRecord,
    LayerInfo,
    Measurement,
    MeasurementBlock,
    MetricValue,
    SampleRecord,
    TensorKey,
)
from torchinstruments.spare_core import SpareCore

from _lane_bits import same_record_bits
from conftest import read_history


def chain(depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(8, 8), nn.ReLU(inplace=True), nn.LayerNorm(8)]
    return nn.Sequential(*layers)


def run(
    model: nn.Module,
    x: torch.Tensor,
    directory: Path,
    steps: int = 2,
    sink: _HistogramSink | None = None,
) -> pl.DataFrame:
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        max_histogram_modules=2,
        sinks=[sink] if sink is not None else [],
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    remove_observer(model)
    return read_history(directory).drop("timestamp")


class _HistogramSink:
    """Keeps every sample's histograms, in the order the records carry them."""

    def __init__(self) -> None:
        self.histograms: list[HistogramRecord] = []

    def start(self, run: object) -> None:
        pass

    def write_forward(self, record: SampleRecord) -> None:
        self.histograms += record.histograms

    def write_backward(self, record: SampleRecord) -> None:
        self.histograms += record.histograms

    def close(self, counts: object) -> None:
        pass


def test_a_run_writes_the_same_rows_with_and_without_the_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = chain(6)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    measured = []
    original = lane.measure

    def counting(copies: list[np.ndarray], *args: Any) -> object:
        measured.append(len(copies))
        return original(copies, *args)

    monkeypatch.setattr(lane, "measure", counting)
    x = torch.randn(4, 8)
    lane_sink, general_sink = _HistogramSink(), _HistogramSink()
    with_lane = run(model, x, tmp_path / "lane", sink=lane_sink)
    # every output and gradient of both steps, the focus layers' too
    assert sum(measured) == 2 * 2 * 6 * 3
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial[name])
    monkeypatch.setattr(lane, "takes", lambda tensor: False)
    general = run(model, x, tmp_path / "general", sink=general_sink)
    assert with_lane.height == general.height > 0
    assert with_lane.equals(general, null_equal=True)
    # two focus layers, output and gradient, two steps: the same records in the same order
    assert len(lane_sink.histograms) == len(general_sink.histograms) == 2 * 2 * 2
    assert [(h.layer, h.signal) for h in lane_sink.histograms][:4] == [
        ("0", "output"),
        ("1", "output"),
        ("1", "output_gradient"),
        ("0", "output_gradient"),
    ]
    for got, want in zip(lane_sink.histograms, general_sink.histograms, strict=True):
        assert same_record_bits(got, want), (got, want)


class _CountingSink:
    """Counts the objects the garbage collector tracks when a sample's record arrives."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def start(self, run: object) -> None:
        pass

    def write_forward(self, record: object) -> None:
        self.counts.append(len(gc.get_objects()))

    def write_backward(self, record: object) -> None:
        pass

    def close(self, counts: object) -> None:
        pass


def test_a_sampled_forward_keeps_few_objects_for_the_collector_per_tensor(
    tmp_path: Path,
) -> None:
    """The lane's reason to exist. When a sampled forward's record reaches the sinks, every
    object made for its tensors is still alive. Before the lane that was about 26.5 tracked
    objects per measured tensor (a reduction, a record, nine metric values, ...), and at 3,000
    layers the collector scanned the whole heap about once per step; then 6.9, and 5.9 with
    the lane entry's sizes inline; 4.9 with the gradient hook as the output's key; now 2.9:
    torch's hook dictionary and autograd objects, and no more (a series' gradient hook is
    armed again for its next samples, and a lane entry holds no object the collector tracks)."""
    model = chain(100)  # 300 layers
    x = torch.randn(4, 8)
    sink = _CountingSink()
    inject_observer(
        model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(1), sinks=[sink]
    )
    for _ in range(2):
        model(x).sum().backward()  # warm
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = len(gc.get_objects())
        output = model(x)
        during = sink.counts[-1] - before
    finally:
        if was_enabled:
            gc.enable()
    output.sum().backward()
    remove_observer(model)
    assert during / 300 < 3.4, during


def test_a_lane_copy_waits_for_its_pass_as_objects_the_collector_does_not_track() -> None:
    """A lane copy waits in its pass's list from the layer's return (or its gradient's arrival)
    to the pass's end, through the collections a long forward or backward runs. Besides its key
    (the entry before it) it is its time, its copy (in the tensor's shape) and its focus, none
    of them tracked by the collector from the start: a 3,000-layer step's collections neither
    count nor promote an object per tensor for it (a tuple of them was one until the first
    collection that met it)."""
    key = TensorKey(0, 0, LayerInfo("l", "Linear"), 0, "output", "", "train", True)
    spare = SpareCore()
    tensor = torch.randn(8, 4).t()  # not contiguous: the copy is in C order, in its shape
    entries = transfer.launch(Measurer(None), key, tensor, False, spare)
    assert entries[0] is key
    assert len(entries) == 4
    assert not any(gc.is_tracked(entry) for entry in entries[1:])
    copy = entries[2]
    assert isinstance(copy, np.ndarray)
    assert copy.shape == (4, 8)
    assert copy.ravel().tolist() == tensor.reshape(-1).tolist()
    (record,) = transfer.build_records("output", list(entries), DEFAULT_METRICS, None, spare)
    assert isinstance(record.measurements, MeasurementBlock)
    assert record.measurements.layers == ("l",)
    assert record.measurements.shapes == ((4, 8),)
    got = dict(zip(DEFAULT_METRICS, record.measurements.values, strict=True))
    values = tensor.double().numpy()
    assert (got["min"], got["max"]) == (values.min(), values.max())
    assert got["mean"] == pytest.approx(values.mean(), abs=1e-6)


def test_a_block_is_a_sequence_of_the_measurements_it_holds() -> None:
    block = MeasurementBlock(
        sample_id=3,
        forward_index=7,
        signal="output",
        rank=None,
        metrics=("mean", "max"),
        timestamps_us=(10, 11),
        layers=("a", "b"),
        module_types=("Linear", "ReLU"),
        call_indices=(0, 1),
        tensor_paths=("", "[0]"),
        shapes=((2, 3), None),
        dtypes=("float32", "float32"),
        modes=("train", "eval"),
        grad_enabled=(True, False),
        placements=(None, "Shard(0)"),
        mesh_coordinates=(None, (1,)),
        values=(1.0, 2.0, None, 4.0),
        reasons=(None, None, "no finite entries", None),
    )
    second = Measurement(
        sample_id=3,
        forward_index=7,
        timestamp_us=11,
        rank=None,
        layer="b",
        module_type="ReLU",
        call_index=1,
        signal="output",
        tensor_path="[0]",
        shape=None,
        dtype="float32",
        mode="eval",
        grad_enabled=False,
        metrics=("mean", "max"),
        values=(MetricValue(None, "no finite entries"), MetricValue(4.0)),
        placement="Shard(0)",
        mesh_coordinate=(1,),
    )
    assert len(block) == 2
    assert block[1] == block[-1] == second
    assert block[0].values == (MetricValue(1.0), MetricValue(2.0))
    assert block == (block[0], second)
    assert block != (second, block[0])
    assert block[1:] == (second,)
    with pytest.raises(IndexError):
        block[2]


def test_a_copy_that_fails_hands_the_tensor_to_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(tensor: torch.Tensor) -> np.ndarray:
        raise RuntimeError("copy broke")

    torch.manual_seed(0)
    model = chain(2)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(4, 8)
    with_lane = run(model, x, tmp_path / "lane")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial[name])
    monkeypatch.setattr(lane, "copy_values", broken)
    handed_over = run(model, x, tmp_path / "handed-over")  # the user's step is not broken
    assert handed_over.equals(with_lane, null_equal=True)
