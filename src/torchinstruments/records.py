"""Plain records that cross module boundaries.

Everything the capture engine hands to sinks is a frozen dataclass of Python scalars, never a
tensor: sinks can be written, tested and run without touching torch, and nothing a sink keeps can
pin device memory. The one exception in spirit is `HistogramRecord`, which carries bin counts that
were already reduced on the tensor's device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

OUTPUT = "output"
OUTPUT_GRADIENT = "output_gradient"
SIGNALS = (OUTPUT, OUTPUT_GRADIENT)
# The reserved metric of a marker row: a null value whose reason says why its sample is not an
# ordinary complete one (its root forward raised, or only part of its rows reached the disk).
INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """A selected module: its qualified name (root = "") and class name."""

    name: str
    module_type: str


@dataclass(frozen=True, slots=True)
class TensorKey:
    """Which tensor of which sample: shared by an output and the gradient into it."""

    sample_id: int
    forward_index: int
    layer: LayerInfo
    call_index: int
    signal: str
    tensor_path: str
    mode: str
    grad_enabled: bool


@dataclass(frozen=True, slots=True)
class MetricValue:
    """One metric of one tensor: a finite value, or None together with the reason."""

    value: float | None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Measurement:
    """All metrics of one tensor (an output or the gradient into it) at one sample."""

    sample_id: int
    forward_index: int
    timestamp_us: int
    rank: int | None
    layer: str
    module_type: str
    call_index: int
    signal: str
    tensor_path: str
    shape: tuple[int, ...] | None
    dtype: str
    mode: str
    grad_enabled: bool
    metrics: tuple[str, ...]
    values: tuple[MetricValue, ...]
    # A DTensor's placements (e.g. "Shard(0)") and this rank's mesh coordinate; None otherwise.
    placement: str | None = None
    mesh_coordinate: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class HistogramRecord:
    """Bin counts of the finite entries of one tensor, reduced on its device.

    `bucket_limits[i]` is the right edge of bucket i (TensorBoard's convention); the first bucket
    starts at `min`.
    """

    sample_id: int
    layer: str
    call_index: int
    signal: str
    tensor_path: str
    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: tuple[float, ...]
    bucket_counts: tuple[float, ...]

    @property
    def tag(self) -> str:
        """Stable TensorBoard tag: `layer/call_N/signal/tensor_path` (root layer is `<root>`)."""
        return histogram_tag(self.layer, self.call_index, self.signal, self.tensor_path)


def histogram_tag(layer: str, call_index: int, signal: str, tensor_path: str) -> str:
    """The TensorBoard tag of one tensor; a bare tensor's empty path is written as `tensor`."""
    return f"{layer or '<root>'}/call_{call_index}/{signal}/{tensor_path or 'tensor'}"


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """What one sampled root forward (signal "output") or its backward produced."""

    signal: str
    sample_id: int
    forward_index: int
    measurements: tuple[Measurement, ...]
    histograms: tuple[HistogramRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What a run is: written into index.md and handed to sinks at start."""

    output_dir: Path
    library_version: str
    torch_version: str
    model_class: str
    layers: tuple[LayerInfo, ...]
    focus_layers: tuple[str, ...]
    sampler: str
    metrics: tuple[str, ...]
    rank: int | None
    world_size: int | None
    rank_policy: str
    capture_direct_forwards: bool
    buffer_rows: int
    window: int
    started_at: str
    flush_seconds: float  # no default here: `HistoryConfig` holds the one default
    # What this configuration cannot record or changes, one sentence each (warned at inject,
    # stated in index.md).
    notes: tuple[str, ...] = ()
    # The most rows buffered while part writes fail (`HistoryConfig.buffered_rows_cap`); None in
    # the state of a version before the cap.
    max_buffered_rows: int | None = None


@dataclass(frozen=True, slots=True)
class RunCounts:
    """How much a run saw; known at removal.

    `layer_samples[name]` is the number of sampled forwards in which the selected layer `name`
    was called (a layer missing from the mapping never ran in one). After a crash it is rebuilt
    from history: the sampled forwards in which the layer recorded an output row.
    """

    root_forwards: int
    samples: int
    backward_samples: int
    layer_samples: Mapping[str, int] = field(default_factory=dict)
    # What the run said about the tensors it measured (torch.func wrappers, DTensors), once each.
    notes: tuple[str, ...] = ()
