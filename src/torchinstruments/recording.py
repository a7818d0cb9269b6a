"""A sampled forward's values on their way to the sinks: a layer's output launched, one record each.

Design decision: the observer (observer.py) decides which root forwards are samples and delimits
them; what happens to the values inside one is this module's: each tensor a selected layer
returns is launched for measurement as it was returned (the lane's or the spare core's copy,
host statistics, or device reductions) and its gradient hooked, and at the sample's end one host
transfer builds its records, which go to the sinks under one lock with the backward's records
(`gradients.GradientRecorder` emits those through `emit_backward`). Kept apart so a newcomer finds
a value's path (`LayerCapture.on_call` -> `record_output` -> `transfer.launch` -> `emit_forward`
-> `transfer.build_records` -> sinks) in one place, and the observer holds the decisions. The
observer binds `record_output` and `emit_forward` once, so a call costs what it cost as its own
method: no lookup is added per layer call or per forward.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from torchinstruments.ambient import apart
from torchinstruments.capture import LayerCapture
from torchinstruments.counting import Counter
from torchinstruments.failed_measurements import FailedMeasurements
from torchinstruments.global_channel import GlobalRun
from torchinstruments.global_statistics import keep, kept_note, local_note, sample_rows
from torchinstruments.gradients import GradientRecorder
from torchinstruments.loss_scale import LossScales
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.measurement.transfer import build_records, launch, note_of
from torchinstruments.notices import RecordingFailures, shown
from torchinstruments.outputs import iter_tensors
from torchinstruments.records import OUTPUT, SampleRecord, TensorKey
from torchinstruments.rundir.shell import layer_span
from torchinstruments.samples import Sample
from torchinstruments.sinks.dispatch import SinkGroup
from torchinstruments.spare_core import SpareCore

__all__ = ["Recording"]


class Recording:
    """One observer's recording of sampled values, outputs and gradients, into its sinks.

    Args:
        measurer: the run's measurer.
        rank: the rank written into records.
        sinks: the run directory first, then the caller's sinks.
        global_option: the library's groups for global statistics (None: not asked for).
        spare: the spare core's worker (plain CPU tensors' copies).
        counter: the observer's counts (a layer's sampled forwards are counted at emission).
        failed_once: failures that leave rows out, warned once each.
        failed_measurements: tensors whose measurement failed, said per layer and kind.
        loss_scales: each sample's loss scale, read at its end.
        notes: the observer's notes (index.md), which a measurement note joins once.
        warn_once: the observer's warning, once per key.
    """

    def __init__(
        self,
        *,
        measurer: Measurer,
        rank: int | None,
        sinks: SinkGroup,
        global_option: GlobalRun | None,
        spare: SpareCore,
        counter: Counter,
        failed_once: RecordingFailures,
        failed_measurements: FailedMeasurements,
        loss_scales: LossScales,
        notes: list[str],
        warn_once: Callable[[str, str], None],
    ) -> None:
        self.measurer, self.rank, self.sinks = measurer, rank, sinks
        self.global_option, self.spare, self.counter = global_option, spare, counter
        self.failed_once, self.failed_measurements = failed_once, failed_measurements
        self.loss_scales, self.notes, self.warn_once = loss_scales, notes, warn_once
        self.sink_lock = threading.RLock()  # forward and backward records reach sinks one at a time
        self.gradients = GradientRecorder(measurer, rank, self.emit_backward, failed_once, spare)

    def record_output(
        self, sample: Sample, layer: LayerCapture, call_index: int, output: Any
    ) -> None:
        """Launch the reductions of every tensor in `output` and hook their gradients."""
        with apart():  # the user's autocast and modes set aside (ambient.py)
            try:
                mode = sample.mode or layer.mode()
                grad_enabled = torch.is_grad_enabled()
                tensors = list(iter_tensors(output, layer.info.name, self.failed_once))
            except Exception as error:
                self.failed_once(
                    f"walk:{layer.info.name}",
                    *(
                        f"reading the output of layer {named(layer.info.name)} failed: "
                        f"{shown(error)}; that call has no rows (sample {sample.sample_id})"
                        for named in (repr, layer_span)
                    ),
                )
                return
            for path, tensor in tensors:
                key = TensorKey(
                    sample.sample_id,
                    sample.forward_index,
                    layer.info,
                    call_index,
                    OUTPUT,
                    path,
                    mode,
                    grad_enabled,
                    sample.step,
                )
                key = self.gradients.hook_output(key, tensor, layer.focus)  # the hook, if made
                if keep(self.global_option, sample.global_pending, key, tensor, self.failed_once):
                    note = kept_note(tensor)  # measured when the sample ends
                else:
                    launched = launch(self.measurer, key, tensor, layer.focus, self.spare)
                    sample.pending += launched
                    note = note_of(launched[0])
                    if self.global_option is not None:
                        self._say(local_note(self.global_option, tensor))
                if note is not None:
                    self._say(note)

    def _say(self, note: str | None) -> None:
        """Said in index.md at removal, and warned now: once each."""
        if note is not None and note not in self.notes:
            self.notes.append(note)
            self.warn_once(note, note)

    def emit_forward(self, sample: Sample) -> None:
        """One host transfer for the whole sampled forward, then one record to the sinks."""
        with apart():  # the user's autocast and modes set aside (ambient.py)
            sample.emitted = True
            # a layer whose every call raised: not counted
            self.counter.count_layers(sample.returned)
            extra = sample_rows(
                self.global_option, sample, self.measurer, self.rank, self.failed_once
            )
            metrics = self.measurer.metrics
            try:
                records = build_records(OUTPUT, sample.pending, metrics, self.rank, self.spare) or [
                    SampleRecord(OUTPUT, sample.sample_id, sample.forward_index, ())
                ]
                if sample.interrupted is not None:
                    extra = (*extra, sample.interrupted)
                self.failed_measurements.scan(records, extra)  # before `extra` joins a record
                if extra:  # global rows (global_statistics), then the marker row
                    first = records[0]
                    records[0] = dataclasses.replace(
                        first, measurements=(*first.measurements, *extra)
                    )
                with self.sink_lock:
                    for record in records:
                        self.sinks.write_forward(record)
            except Exception as error:
                self.failed_once(
                    "emit_forward",
                    f"recording a sample failed: {shown(error)}; some or all of sample "
                    f"{sample.sample_id}'s output rows are not written",
                )
        # After the transfer has waited (loss_scale.py); outside `apart`, which hides autocast.
        self.loss_scales.read(sample.sample_id)

    def emit_backward(self, record: SampleRecord) -> None:
        """Hand one sample's gradient record to the sinks."""
        self.failed_measurements.scan((record,))
        with self.sink_lock:
            self.sinks.write_backward(record)
