"""Plain records that cross module boundaries.

Everything the capture engine hands to sinks is a frozen dataclass of Python scalars, never a
tensor: sinks can be written, tested and run without touching torch, and nothing a sink keeps can
pin device memory. The one exception in spirit is `HistogramRecord`, which carries bin counts that
were already reduced on the tensor's device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, overload

from torchinstruments.history_config import HistoryConfig

__all__ = [
    "INTERRUPTED",
    "OUTPUT",
    "OUTPUT_GRADIENT",
    "SIGNALS",
    "Columns",
    "HistogramRecord",
    "LayerInfo",
    "Measurement",
    "MeasurementBlock",
    "MetricValue",
    "RunCounts",
    "RunInfo",
    "SampleFacts",
    "SampleRecord",
    "ScaleSpan",
    "TensorKey",
    "histogram_tag",
    "module_type",
    "tag_layer",
]

OUTPUT = "output"
OUTPUT_GRADIENT = "output_gradient"
SIGNALS = (OUTPUT, OUTPUT_GRADIENT)
# The reserved metric of a marker row: a null value whose reason says why its sample is not an
# ordinary complete one (its root forward raised, or only part of its rows reached the disk).
INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """A selected module: its qualified name (root = "") and class name (`module_type`)."""

    name: str
    module_type: str


def module_type(module: object) -> str:
    """The class name a layer is listed under: the user's class, also where FSDP2's
    `fully_shard` (or `replicate`) gave the module a class of its own, `FSDP<Name>` made from
    the wrapper and `<Name>`. Why: a run sharded and one not (a restart into the same directory
    on more ranks, `compare` of the two) must list the same layers; resume refuses other ones."""
    cls = type(module)
    bases = cls.__bases__
    if (
        len(bases) == 2
        and cls.__module__.startswith("torch.distributed.")
        and bases[0].__module__.startswith("torch.distributed.")
        and cls.__name__.endswith(bases[1].__name__)
    ):
        return bases[1].__name__
    return cls.__name__


@dataclass(slots=True, eq=False)
class TensorKey:
    """Which tensor of which sample: shared by an output and the gradient into it.

    Made once per sampled output and never changed; not frozen, because a frozen dataclass's
    `__init__` sets each field through `object.__setattr__` (0.67 against 0.12 us a key, about
    2 ms of a 3,000-layer sampled step). Compared by identity: two keys are the same tensor of
    the same sample only when they are one object.
    """

    sample_id: int
    forward_index: int
    layer: LayerInfo
    call_index: int
    signal: str
    tensor_path: str
    mode: str
    grad_enabled: bool
    # The trainer's global step, or the step a plain loop gave with `set_step`; None otherwise.
    step: int | None = None


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
    # The trainer's global step, or the step a plain loop gave with `set_step`; None otherwise.
    step: int | None = None
    # Which tensor the row describes: None for this rank's own tensor (or DTensor shard),
    # "global:ranks=0,1" for the whole tensor over those ranks (`global_statistics=`).
    population: str | None = None


# The tensors of a block before it is made, one list per field: their keys, timestamps_us,
# shapes, dtypes, placements and mesh coordinates (`MeasurementBlock.of_keys`).
Columns = tuple[
    list[TensorKey],
    list[int],
    list[tuple[int, ...] | None],
    list[str],
    list[str | None],
    list[tuple[int, ...] | None],
]


@dataclass(frozen=True, slots=True, eq=False)
class MeasurementBlock(Sequence[Measurement]):
    """The measurements of one sample and signal, held column by column.

    Design decision: a sampled forward of a model with thousands of layers measures thousands of
    tensors, and one `Measurement` with its `MetricValue`s per tensor is some fifteen Python
    objects the garbage collector scans until the sample is written. A block holds the same
    content as one tuple per field (per tensor) plus the values and reasons of every metric
    (row-major, `len(metrics)` per tensor), so the run directory turns it into rows without
    building those objects. Tuples, so that a block is immutable like every record: a sink that
    receives it cannot change what another sink, or the run directory's buffer, holds. It is a `Sequence[Measurement]`: a sink that iterates it gets the
    `Measurement`s, built on access, equal to the ones the block stands for.
    """

    sample_id: int
    forward_index: int
    signal: str
    rank: int | None
    metrics: tuple[str, ...]
    timestamps_us: tuple[int, ...]
    layers: tuple[str, ...]
    module_types: tuple[str, ...]
    call_indices: tuple[int, ...]
    tensor_paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[str, ...]
    modes: tuple[str, ...]
    grad_enabled: tuple[bool, ...]
    placements: tuple[str | None, ...]
    mesh_coordinates: tuple[tuple[int, ...] | None, ...]
    values: tuple[float | None, ...]
    reasons: tuple[str | None, ...]
    step: int | None = None  # the sample's step (see `Measurement.step`)

    @classmethod
    def of_keys(
        cls,
        columns: Columns,
        values: Sequence[float | None],
        reasons: Sequence[str | None],
        signal: str,
        rank: int | None,
        metrics: tuple[str, ...],
    ) -> MeasurementBlock:
        """The block of one sample's tensors (`columns`, whose keys are all of that sample) and
        their metrics' `values` and `reasons` (row-major), in tuples: no sink can change what
        another sink receives."""
        keys, stamps, shapes, dtypes, placements, meshes = columns
        return cls(
            sample_id=keys[0].sample_id,
            forward_index=keys[0].forward_index,
            signal=signal,
            rank=rank,
            metrics=metrics,
            timestamps_us=tuple(stamps),
            layers=tuple([key.layer.name for key in keys]),
            module_types=tuple([key.layer.module_type for key in keys]),
            call_indices=tuple([key.call_index for key in keys]),
            tensor_paths=tuple([key.tensor_path for key in keys]),
            shapes=tuple(shapes),
            dtypes=tuple(dtypes),
            modes=tuple([key.mode for key in keys]),
            grad_enabled=tuple([key.grad_enabled for key in keys]),
            placements=tuple(placements),
            mesh_coordinates=tuple(meshes),
            values=tuple(values),
            reasons=tuple(reasons),
            step=keys[0].step,
        )

    def __len__(self) -> int:
        return len(self.layers)

    @overload
    def __getitem__(self, index: int) -> Measurement: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Measurement, ...]: ...
    def __getitem__(self, index: int | slice) -> Measurement | tuple[Measurement, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        i = range(len(self))[index]  # negative indices, and IndexError past the end
        k = len(self.metrics)
        values = self.values[i * k : (i + 1) * k]
        why = self.reasons[i * k : (i + 1) * k]
        return Measurement(
            sample_id=self.sample_id,
            forward_index=self.forward_index,
            timestamp_us=self.timestamps_us[i],
            rank=self.rank,
            layer=self.layers[i],
            module_type=self.module_types[i],
            call_index=self.call_indices[i],
            signal=self.signal,
            tensor_path=self.tensor_paths[i],
            shape=self.shapes[i],
            dtype=self.dtypes[i],
            mode=self.modes[i],
            grad_enabled=self.grad_enabled[i],
            metrics=self.metrics,
            values=tuple(MetricValue(v, r) for v, r in zip(values, why, strict=True)),
            placement=self.placements[i],
            mesh_coordinate=self.mesh_coordinates[i],
            step=self.step,
        )

    def __iter__(self) -> Iterator[Measurement]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same measurements (a tuple of them, say)."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


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
    mode: str = "train"  # the layer's mode at the call; an eval tensor has tags of its own

    @property
    def tag(self) -> str:
        """Stable TensorBoard tag: `layer/call_N/signal/tensor_path` (root layer is `<root>`, a
        `/` or `%` in a name percent-encoded), under `eval/` for a sample in eval mode."""
        return histogram_tag(self.layer, self.call_index, self.signal, self.tensor_path, self.mode)


def histogram_tag(
    layer: str, call_index: int, signal: str, tensor_path: str, mode: str = "train"
) -> str:
    """The TensorBoard tag of one tensor; a bare tensor's empty path is written as `tensor`.

    An eval-mode tensor's tag starts with `eval/`: train and eval samples are never one series,
    and TensorBoard groups the eval tags in a section of their own. The layer's name is one part
    of the tag whatever it holds (`tag_layer`: `/` and `%` percent-encoded), so a train tag
    has four parts before its tensor path and an eval tag five, and no two tensors share a tag,
    even a train layer named `eval/a` and an eval layer `a` (a `/` in the tensor path, the last
    part, cannot make two tags meet either). Names without `/` or `%`, almost all, keep their
    tags unchanged; the tag's description names the real layer.
    """
    tag = f"{tag_layer(layer)}/call_{call_index}/{signal}/{tensor_path or 'tensor'}"
    return tag if mode == "train" else f"{mode}/{tag}"


def tag_layer(layer: str) -> str:
    """A layer's name as one part of a TensorBoard tag: `<root>` for the root, `%` and `/`
    written `%25` and `%2F` (a layer literally named `<root>`: `%3Croot>`), which a percent-
    decoding (`urllib.parse.unquote`) reads back."""
    if not layer:
        return "<root>"
    part = layer.replace("%", "%25").replace("/", "%2F")
    return "%3Croot>" if part == "<root>" else part


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """What one sampled root forward (signal "output") or its backward produced."""

    signal: str
    sample_id: int
    forward_index: int
    # A `MeasurementBlock` when the observer made the record; any sequence of measurements works.
    measurements: Sequence[Measurement]
    histograms: tuple[HistogramRecord, ...] = ()


class SampleFacts(Protocol):
    """What a marker row repeats of its sample (samples.py): one of its measurements, or the
    gradients a sample awaited (gradients.py) when none of them arrived."""

    @property
    def sample_id(self) -> int: ...
    @property
    def forward_index(self) -> int: ...
    @property
    def step(self) -> int | None: ...
    @property
    def mode(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What a run is: written into index.md and handed to sinks at start.

    It records the options a reader of the run needs without the code that ran it: the run's
    own `HistoryConfig` (one object, not copies of its fields; `max_buffered_rows` is the cap
    in force, None in the state of a version before the cap), `rank_policy` and
    `capture_direct_forwards`. The other options are code (sampler, selectors, reducers, sinks)
    and are recorded as what they did: `sampler` described, `metrics`, the selected `layers`.
    """

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
    history: HistoryConfig
    started_at: str
    # What this configuration cannot record or changes, one sentence each (warned at inject,
    # stated in index.md).
    notes: tuple[str, ...] = ()
    # The loss scaler handed over as `grad_scaler` (`loss_scale.describe_scaler`), or None: the
    # run's output_gradient rows are then of the scaled loss (`RunCounts.loss_scales`).
    grad_scaler: str | None = None
    # The modules with a fused fast path that holds selected layers (`fused_paths.fused_path_modules`;
    # "" for the observed model itself): index.md says how sampled forwards run them.
    fused_paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ScaleSpan:
    """The loss scale of the samples from `first_sample_id` on, up to the next span's first.

    `scale` is what `GradScaler.get_scale()` returned in the sampled forward (the factor its
    backward's gradients carry); None when it could not be read (the note says why).
    """

    first_sample_id: int
    scale: float | None


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
    # Root forwards on the training schedule (every one in a plain loop) and evaluation forwards
    # on their own schedule (a trainer callback's record_eval): what each sampler was asked
    # with. None: unknown (rebuilt from history, or read from a state written before these).
    train_forwards: int | None = None
    eval_forwards: int | None = None
    # Root forwards a trainer callback passed through unobserved (phases.py): evaluation forwards
    # without record_eval, and the fit's setup forwards (before its first loop: Lightning's model
    # summary of example_input_array). 0 in a plain loop; None: unknown, as above.
    unobserved_eval_forwards: int | None = None
    unobserved_setup_forwards: int | None = None
    # With no root forward seen: what built a module that calls the model's layers past the
    # observer after inject_observer (bypass.py), e.g. "accelerate's compile_regions"; else None.
    bypassed_by: str | None = None
    # With a `grad_scaler`: the loss scale of each sample, one span per change (loss_scale.py).
    loss_scales: tuple[ScaleSpan, ...] = ()
    # Counts rebuilt from history after a kill: the samples on disk whose every output row ran
    # with grad disabled (an evaluation under torch.no_grad), which no gradient can reach, so a
    # rebuilt `backward_samples` of 0 is known, not unknown, when they are all the samples.
    # None: not counted (the live run's counts are exact; an older state).
    no_grad_samples: int | None = None
