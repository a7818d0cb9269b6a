"""The run directory's TensorBoard event file: TensorBoard's own writer, made cheap per sample.

Design decision: events are written by TensorBoard's writer (torch's `FileWriter` over
TensorBoard's `EventFileWriter`: its file naming, record framing and writer thread), but two of
its per-record costs are taken off the training step, where its thread holds the GIL:

* Without TensorFlow, that writer opens, appends to and closes the file for every record. So
  `EventFile` writes one event per sampled forward (or backward) holding all its focus-layer
  histograms as values of one `Summary`, which TensorBoard reads exactly like one event each.
* Its framing computes each record's CRC-32C in pure Python, byte by byte: about 170 us per KiB.
  `Crc32c` computes the same checksum with one NumPy gather for all its whole 1 KiB blocks.

Measured with `uv run bench/event_writer.py` (the MLP of `bench/sampled.py`, 16 histograms per
step): the writer thread's CPU time per step goes from 5.0 to 5.5 ms (one event per histogram)
to 4.0 to 4.4 ms (one per record) and 1.5 ms (with `Crc32c`).

Cost: handing the checksum over reaches private names of TensorBoard's async writer (kept in
`_tensorboard_internals.replace_record_framing`). Where they are missing (another TensorBoard
version), the writer keeps its own checksum: slower, never wrong. TensorBoard's reader verifies
every checksum it reads, and the tests read every event file back with it; `tests/test_tensorboard.py` also pins that the hand-over happens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensorboard.plugins.histogram import metadata as histogram_metadata
from torch.utils.tensorboard.summary import HistogramProto, Summary
from torch.utils.tensorboard.summary import text as text_summary
from torch.utils.tensorboard.writer import FileWriter

from torchinstruments._tensorboard_internals import replace_byte_queue, replace_record_framing
from torchinstruments.measurement.numerics import PROFILE
from torchinstruments.records import (
    INTERRUPTED,
    OUTPUT,
    HistogramRecord,
    Measurement,
    MeasurementBlock,
    SampleRecord,
    histogram_tag,
)
from torchinstruments.rundir.shell import layer_span, literal_span

__all__ = [
    "NO_HISTOGRAM",
    "RUN_STEP",
    "TEXT_SUFFIX",
    "Crc32c",
    "EventFile",
    "MissingHistogram",
    "histogram_arguments",
    "histogram_description",
    "histogram_summary",
    "histogram_value",
    "measured_types",
    "missing_histograms",
    "missing_text",
    "no_histogram_tag",
]

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
        return self._flat.item((_BLOCK - 1 - distance) * 256 + byte)

    def crc(self, data: bytes) -> int:
        """The CRC-32C of `data` (initial and final XOR with all ones, as TFRecord uses it)."""
        view = np.frombuffer(data, dtype=np.uint8)
        whole = len(view) - len(view) % _BLOCK
        values: list[int] = []
        if whole:  # every whole block's own contribution in one gather and one reduction
            blocks = view[:whole].reshape(-1, _BLOCK)
            own = np.bitwise_xor.reduce(np.take(self._flat, self._row_starts + blocks), axis=1)
            values = own.tolist()
        lengths = [_BLOCK] * len(values)
        if whole < len(view):
            tail = view[whole:]
            positions = self._row_starts[_BLOCK - len(tail) :] + tail
            values.append(int(np.bitwise_xor.reduce(np.take(self._flat, positions))))
            lengths.append(len(tail))
        register = _MASK
        for value, length in zip(values, lengths, strict=True):
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


RUN_STEP = (
    "forward_index, the root forward the sample was taken at (0 at inject_observer; the training "
    "step when each step is one root forward)"
)


def histogram_description(histogram: HistogramRecord, module_type: str, step: str) -> str:
    """What a histogram tag shows, for TensorBoard's tag description (its first event only).

    Args:
        histogram: any histogram of the tag.
        module_type: the layer's class name.
        step: what the step axis is, e.g. `RUN_STEP`.
    """
    what = "output" if histogram.signal == OUTPUT else "gradient flowing back into the output"
    # TensorBoard renders a description as Markdown (`plugin_util.markdown_to_safe_html`): names
    # from outside as index.md writes them, so `*`, `_` or `<img>` in a key is not markup there.
    path = f", tensor {literal_span(histogram.tensor_path)}" if histogram.tensor_path else ""
    mode = (
        f", in {histogram.mode} mode (samples taken with module.training False, in a root "
        "forward called under no_grad or inference_mode, or in a trainer's evaluation: a "
        "series of their own, never mixed with the train tag)"
        if histogram.mode != "train"
        else ""
    )
    return (
        f"Histogram of the {what} of layer {layer_span(histogram.layer)} ({module_type}), call "
        f"{histogram.call_index}{path}{mode}. Only finite entries are counted: NaN and Inf are left "
        "out (the history's nonfinite_fraction counts them), and at a sample where the tensor "
        "has no finite entry there is no histogram; the text tag "
        f"{literal_span(no_histogram_tag(histogram.tag))} says so at that step. Step: {step}."
    )


NO_HISTOGRAM = " (no histogram)"

# What TensorBoard's text summary (`summary.text`, `SummaryWriter.add_text`) appends to the tag it
# is given: the event file, and TensorBoard's Text tab, name the note `<tag> (no histogram)`
# followed by it, so every text that tells a reader where to look names that whole tag.
TEXT_SUFFIX = "/text_summary"


def no_histogram_tag(tag: str) -> str:
    """The tag a reader finds a tensor's no-histogram note under (TensorBoard's Text tab,
    `EventAccumulator.Tensors`): `tag`, `NO_HISTOGRAM`, then `TEXT_SUFFIX`."""
    return tag + NO_HISTOGRAM + TEXT_SUFFIX


@dataclass(frozen=True, slots=True)
class MissingHistogram:
    """A focus tensor of a sample that has rows but no histogram, and why."""

    tag: str
    reason: str


def missing_histograms(record: SampleRecord, focus: frozenset[str]) -> list[MissingHistogram]:
    """Focus-layer tensors measured in `record` without a histogram, with the reason from their rows.

    Histograms count finite entries only, so a tensor that is empty or all NaN/Inf has none;
    this is how a sink says so instead of the tag silently stopping.
    """
    drawn = {histogram.tag for histogram in record.histograms}
    missing = []
    measurements = record.measurements
    if isinstance(measurements, MeasurementBlock):  # build only the measurements it must read
        measurements = [
            measurements[i]
            for i, layer in enumerate(measurements.layers)
            if layer in focus
            and histogram_tag(
                layer,
                measurements.call_indices[i],
                record.signal,
                measurements.tensor_paths[i],
                measurements.modes[i],
            )
            not in drawn
        ]
    for m in measurements:
        if m.layer not in focus or INTERRUPTED in m.metrics or m.population is not None:
            continue  # a global row (global_statistics) has no histogram, as index.md says
        tag = histogram_tag(m.layer, m.call_index, m.signal, m.tensor_path, m.mode)
        if tag in drawn:
            continue
        values = dict(zip(m.metrics, m.values, strict=True))
        nonfinite = values.get("nonfinite_fraction")
        if m.shape is not None and math.prod(m.shape) == 0:
            reason = "the tensor is empty"
        elif nonfinite is not None and nonfinite.value == 1.0:
            reason = "every entry is NaN or Inf (nonfinite_fraction 1)"
        else:
            reason = _profile_reason(m)
        missing.append(MissingHistogram(tag, reason))
    return missing


def _profile_reason(measurement: Measurement) -> str:
    """Why a tensor's default statistics are null, as its rows say; a custom reducer's reason
    (its error, an in-place write, its own non-finite result) is about that reducer, never the
    reason the tensor has no histogram."""
    for metric, value in zip(measurement.metrics, measurement.values, strict=True):
        if value.reason and metric in PROFILE:
            return value.reason
    return (
        "it has no finite entry to count, or measuring it failed (no default statistic says which)"
    )


def missing_text(missing: MissingHistogram, step: int) -> str:
    """The text note put at `step` under the tag's `NO_HISTOGRAM` text tag."""
    return f"No histogram at step {step}: {missing.reason}. The history holds this sample's rows."


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


def histogram_summary(histogram: HistogramRecord, description: str | None = None) -> Any:
    """TensorBoard's raw-histogram `Summary` of a record, with the tag's description if given."""
    return Summary(value=[histogram_value(histogram, description)])


def histogram_value(histogram: HistogramRecord, description: str | None = None) -> Any:
    """One record as the `Summary.Value` TensorBoard's `histogram_raw` builds (built here
    directly: the bins are read once, and a sample's values go into one `Summary`)."""
    value = Summary.Value(
        tag=histogram.tag,
        histo=HistogramProto(
            min=histogram.min,
            max=histogram.max,
            num=histogram.num,
            sum=histogram.sum,
            sum_squares=histogram.sum_squares,
            bucket_limit=histogram.bucket_limits,
            bucket=histogram.bucket_counts,
        ),
    )
    if description is not None:
        # The histograms plugin's own metadata, as TensorBoard's `histogram` summary writes it:
        # a description alone is metadata of no plugin, which TensorBoard's reader warns about.
        metadata = histogram_metadata.create_summary_metadata(histogram.tag, description)
        value.metadata.CopyFrom(metadata)
    return value


def measured_types(measurements: Sequence[Measurement]) -> dict[str, str]:
    """Each layer's class as a sample's rows give it: a lazy module (`nn.LazyLinear`) has
    become another class (`nn.Linear`) by its first measured call, so a tag's description,
    written at its first sample, names the class its rows say, not the one at injection."""
    if isinstance(measurements, MeasurementBlock):  # without building a Measurement each
        return dict(zip(measurements.layers, measurements.module_types, strict=True))
    return {m.layer: m.module_type for m in measurements}


class EventFile:
    """The run directory's event file: one event per record, checksummed by `Crc32c`.

    Each tag's first event carries its description (`histogram_description`; TensorBoard keeps
    the first one it reads), and the step is the record's forward_index (`RUN_STEP`).

    Args:
        log_dir: Directory of the event file (created if missing).
        flush_seconds: How often TensorBoard's writer thread flushes the file.
        module_types: layer name -> class name, for the descriptions.
    """

    def __init__(
        self, log_dir: str, flush_seconds: float, module_types: Mapping[str, str] | None = None
    ) -> None:
        self._writer = FileWriter(log_dir, flush_secs=flush_seconds)  # type: ignore[arg-type]
        self._records = _hand_over_checksum(self._writer, Crc32c())
        self.fast_checksum = self._records is not None
        # Events reach TensorBoard's writer thread through a queue without a Python-level lock
        # that a KeyboardInterrupt could leave held (`replace_byte_queue`; where TensorBoard's
        # writer has another shape, its own queue stays).
        replace_byte_queue(self._writer.event_writer, flush_seconds)
        self._module_types = dict(module_types or {})
        self._described: set[str] = set()

    def add_histograms(
        self,
        histograms: Sequence[HistogramRecord],
        step: int,
        measured: Sequence[Measurement] = (),
    ) -> None:
        """One event at `step` (the sample's forward_index), holding each histogram under its
        tag; a tag's first names its layer's class as `measured` (the sample's rows) gives it."""
        if not histograms:
            return
        if measured and any(h.tag not in self._described for h in histograms):
            self._module_types.update(measured_types(measured))
        values = []
        for histogram in histograms:
            description = None
            if histogram.tag not in self._described:
                self._described.add(histogram.tag)
                module_type = self._module_types.get(histogram.layer, "?")
                description = histogram_description(histogram, module_type, RUN_STEP)
            values.append(histogram_value(histogram, description))
        summary = Summary(value=values)
        self._raise_failure()
        self._writer.add_summary(summary, global_step=step)

    def add_missing(self, missing: Sequence[MissingHistogram], step: int) -> None:
        """A text note at `step` for each focus tensor without a histogram, saying why."""
        for item in missing:
            note = text_summary(item.tag + NO_HISTOGRAM, missing_text(item, step))
            self._writer.add_summary(note, global_step=step)

    def flush(self) -> None:
        """Writes every queued event to the file; raises what the writer thread could not
        write (a full disk)."""
        self._writer.flush()
        self._raise_failure()

    def close(self) -> None:
        """Flushes, stops the writer thread and closes the file; raises what the writer thread
        could not write, or, before stopping it, `_tensorboard_internals.WriterStalledError`
        when it cannot write (TensorBoard's own close would wait for it without end)."""
        self._writer.flush()
        self._writer.close()
        self._raise_failure()

    def _raise_failure(self) -> None:
        """Raise, here, the first failure of the writer thread (kept there, see
        `_tensorboard_internals.replace_record_framing`)."""
        error = None if self._records is None else self._records.error
        if error is not None:
            raise error


def _hand_over_checksum(writer: FileWriter, checksum: Crc32c) -> Any:
    """Frames `writer`'s records with `checksum`, on the same file: the record writer now in
    place, or None where TensorBoard's writer does not have the known shape
    (`_tensorboard_internals.replace_record_framing`)."""
    return replace_record_framing(writer.event_writer, checksum.masked)
