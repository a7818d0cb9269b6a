"""The caller's TensorBoard writer as a sink: focus-layer histograms on the caller's step.

`write_histograms` is shared with nothing else: histograms arrive already reduced (counts), and
each tag's first event carries its description and the histograms plugin's metadata.

Design decision: on the caller's step (`step=`) several samples can share a step: the
micro-batches of gradient accumulation, the batches of one evaluation, on a trainer's global
step. TensorBoard keeps them as several events at one step, and what its readers make of that
differs: its default data server (RustBoard) keeps one record per tag and step, the last one
written (a record at a step it has seen preempts those at or after it, its handling of a
restarted job), while its Python reader (`--load_fast=false`, `EventAccumulator`) keeps them all
and draws them on top of each other at that step. So this sink writes one per tag and step, the
step's first sample, the same on every reader: known when it arrives, so nothing waits for the
step to end, and the same micro-batch of every optimizer step. The later ones are counted
(`shared_step_samples`), warned about once, and the tag description says where they are: the
run directory's own events, one step per sample (forward_index), and history. Cost: the trainer's
TensorBoard shows one micro-batch of each optimizer step.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from torchinstruments._tensorboard_internals import summary_file_writer
from torchinstruments.events import (
    NO_HISTOGRAM,
    RUN_STEP,
    histogram_arguments,
    histogram_description,
    histogram_summary,
    measured_types,
    missing_histograms,
    missing_text,
)
from torchinstruments.notices import warn
from torchinstruments.records import HistogramRecord, RunCounts, RunInfo, SampleRecord
from torchinstruments.rundir.ranges import plural

__all__ = ["ONE_PER_STEP", "TensorBoardSink", "write_histograms"]

# How a note names the logger of a TensorBoardSink the caller built (a callback names its own).
LOGGER = "the TensorBoard logger of TensorBoardSink(step=...)"
# A sample's records (forward, then backward) arrive close together: the latest ids left out
# that are remembered, so that a sample is counted once.
_RECENT = 64

ONE_PER_STEP = (
    "One histogram per tag and step: the first sample taken at that step. Samples that share a "
    "step (the micro-batches of gradient accumulation, the batches of one evaluation) would be "
    "several events at one step, of which TensorBoard's default data server keeps only the last "
    "written, so the later ones are not written here: the run directory's tensorboard/ has every "
    "sample's histograms on its own step (forward_index), and its history their rows."
)


def write_histograms(
    writer: Any,
    histograms: Sequence[HistogramRecord],
    step: int,
    describe: Callable[[HistogramRecord], str | None] = lambda histogram: None,
) -> None:
    """Add already-reduced histograms to a SummaryWriter at `step`, with tag descriptions.

    The description (`describe(histogram)`, for a tag's first event) needs the writer's event
    file (`_tensorboard_internals.summary_file_writer`); where it has none, the histograms go
    through the public `add_histogram_raw`, without one.
    """
    events = summary_file_writer(writer)
    for histogram in histograms:
        if events is not None:
            events.add_summary(histogram_summary(histogram, describe(histogram)), global_step=step)
        else:
            writer.add_histogram_raw(
                histogram.tag, **histogram_arguments(histogram), global_step=step
            )


class TensorBoardSink:
    """Writes focus-layer histograms into a caller-owned TensorBoard logger.

    Accepts a `torch.utils.tensorboard.SummaryWriter` or anything with `.experiment` that is one
    (Lightning's `TensorBoardLogger`). The logger stays the caller's: this sink never flushes,
    closes, reconfigures or replaces it, so the caller keeps writing after `remove_observer`.

    The TensorBoard step of a histogram is the sample's forward_index (as in the run directory's
    own events) unless `step` is given: then `step()` is called when the sample's histograms
    arrive (after the sampled forward, and at the end of its backward) and its value is the
    step, e.g. `step=lambda: trainer.global_step` puts the histograms on Lightning's own step
    axis. A `step` that raises or returns no int detaches this sink with one warning (like any
    failing sink); training goes on. Each tag's first event carries a description (layer type,
    signal, finite entries only, the step axis: `step_name`), and a focus tensor without a
    histogram at a step (no finite entry) gets a text note saying why. With `step`, a tag gets
    one histogram (or note) per step, the first sample's at that step (`ONE_PER_STEP`, the
    module docstring says why): a later sample at that step is counted in
    `shared_step_samples` and warned about once.

    Args:
        logger: a SummaryWriter, or an object whose `.experiment` is one.
        step: optional zero-argument callable returning the caller's current step (an int).
        step_name: what the step is, for the tag descriptions (default: forward_index, or "the
            caller's step" with `step`).
        logger_name: how index.md's note on samples left out names the logger (a trainer
            callback: "the trainer's TensorBoard logger").

    Raises:
        TypeError: if neither `logger` nor `logger.experiment` has `add_histogram_raw`, or if
            `step` is given and not callable.

    Example:
        >>> sink = TensorBoardSink(trainer.logger, step=lambda: trainer.global_step)  # doctest: +SKIP
    """

    def __init__(
        self,
        logger: Any,
        step: Callable[[], int] | None = None,
        step_name: str | None = None,
        *,
        logger_name: str = LOGGER,
    ) -> None:
        if step is not None and not callable(step):
            raise TypeError(
                f"step must be a zero-argument callable returning an int (e.g. "
                f"`lambda: trainer.global_step`) or None, got {step!r}"
            )
        self._step = step
        self._logger = logger
        if not callable(getattr(self._writer(), "add_histogram_raw", None)):
            raise TypeError(
                "logger must be a torch.utils.tensorboard.SummaryWriter or have an `.experiment` "
                f"that is one (Lightning's TensorBoardLogger), got {logger!r}"
            )
        if step_name is None:
            step_name = RUN_STEP if step is None else "the caller's step (TensorBoardSink step=)"
        self._step_name = step_name
        self._logger_name = logger_name
        self._module_types: dict[str, str] = {}
        self._focus: frozenset[str] = frozenset()
        self._described: set[str] = set()
        self._last_steps: dict[str, int] = {}  # tag -> the step it was last written at
        # The samples left out (an earlier sample had their step): a count, and the latest
        # few ids, as a sample's forward and backward records both arrive (bounded memory).
        self._shared = 0
        self._recent_shared: deque[int] = deque(maxlen=_RECENT)

    @property
    def shared_step_samples(self) -> int:
        """How many samples had a histogram (or note) left out: an earlier sample had its step."""
        return self._shared

    def shared_step_note(self) -> str | None:
        """index.md's note on the samples left out of the logger (an earlier sample had their
        step), given at the run's removal (`SinkGroup.close`), and read before it by the run
        directory's flush thread (a killed run keeps it); None when none was."""
        n = self._shared
        if not n:
            return None
        logger = self._logger_name
        return (
            f"{plural(n, 'sample')} shared a step with an earlier sample (gradient "
            f"accumulation's micro-batches, an evaluation's batches), so {logger} holds "
            f"no histogram of {'it' if n == 1 else 'them'}: it gets one histogram per tag and "
            "step, the step's first sample's (TensorBoard's default data server keeps only the "
            "last record at a step, its Python reader draws them all on top of each other). "
            "tensorboard/ here has every sample's histograms on its own step (forward_index), "
            "and history their rows."
        )

    def log_dir(self) -> str | None:
        """The folder the logger writes its event files to (None: it does not say)."""
        writer = self._writer()
        folder = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)
        return folder if isinstance(folder, str) else None

    def _writer(self) -> Any:
        """The SummaryWriter, looked up each time: Lightning creates `.experiment` lazily."""
        if callable(getattr(self._logger, "add_histogram_raw", None)):
            return self._logger
        return getattr(self._logger, "experiment", None)

    def start(self, run: RunInfo) -> None:
        """Remember the layers' types and the focus layers (the caller's logger already exists)."""
        self._module_types = {layer.name: layer.module_type for layer in run.layers}
        self._focus = frozenset(run.focus_layers)

    def write_forward(self, record: SampleRecord) -> None:
        self._write(record)

    def write_backward(self, record: SampleRecord) -> None:
        self._write(record)

    def _write(self, record: SampleRecord) -> None:
        missing = missing_histograms(record, self._focus)
        if not record.histograms and not missing:
            return
        step = self._current_step(record)
        histograms = [h for h in record.histograms if self._first_at(h.tag, step)]
        firsts = [item for item in missing if self._first_at(item.tag, step)]
        if len(histograms) + len(firsts) < len(record.histograms) + len(missing):
            self._left_out(record, step)
        if any(h.tag not in self._described for h in histograms):  # a tag's first: its class
            self._module_types.update(measured_types(record.measurements))
        writer = self._writer()
        write_histograms(writer, histograms, step, self._describe)
        for item in firsts:
            writer.add_text(item.tag + NO_HISTOGRAM, missing_text(item, step), global_step=step)

    def _first_at(self, tag: str, step: int) -> bool:
        """Whether `tag` has nothing at `step` yet (always, on forward_index: one sample each)."""
        if self._step is not None and self._last_steps.get(tag) == step:
            return False
        self._last_steps[tag] = step
        return True

    def _left_out(self, record: SampleRecord, step: int) -> None:
        """Count a sample whose step an earlier sample had; warn at the first."""
        if record.sample_id in self._recent_shared:
            return  # its other record (forward or backward), counted already
        if not self._shared:
            warn(
                f"torchinstruments: TensorBoardSink: sample {record.sample_id} shares step {step} "
                "with an earlier sample (gradient accumulation's micro-batches, or an "
                "evaluation's batches): the logger gets one histogram per tag and step, the "
                "first sample's, since TensorBoard's default data server keeps only the last "
                "record at a step; every sample is in the run directory's tensorboard/ on its "
                "forward_index (said once; index.md counts them)"
            )
        self._shared += 1
        self._recent_shared.append(record.sample_id)

    def _describe(self, histogram: HistogramRecord) -> str | None:
        """The tag's description the first time it is written, else None."""
        if histogram.tag in self._described:
            return None
        self._described.add(histogram.tag)
        module_type = self._module_types.get(histogram.layer, "?")
        described = histogram_description(histogram, module_type, self._step_name)
        return described if self._step is None else f"{described} {ONE_PER_STEP}"

    def _current_step(self, record: SampleRecord) -> int:
        """The caller's step, or the sample's forward_index without `step`.

        `step()` may return what `set_step` accepts: an integer, Python, NumPy or a 0-d integer
        tensor (`operator.index`), read as a Python int; a bool or a float is refused.
        """
        if self._step is None:
            return record.forward_index
        step = self._step()
        try:
            if isinstance(step, bool):
                raise TypeError
            return operator.index(step)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"TensorBoardSink: step() returned {step!r} ({type(step).__name__}), expected an "
                "integer (Python, NumPy or a 0-d integer tensor)"
            ) from None

    def close(self, counts: RunCounts) -> None:
        """Leaves the caller's logger open and unflushed, as the caller left it."""
