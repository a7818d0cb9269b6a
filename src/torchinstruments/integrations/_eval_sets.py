"""Which evaluation dataset each evaluation sample is of, where a fit evaluates several.

Design decision: the Hugging Face Trainer evaluates each dataset of a dict `eval_dataset` in turn
and logs its metrics under a prefix of its own (`eval_<name>_loss`); Lightning runs each
validation dataloader in turn and logs `<metric>/dataloader_idx_<i>`. Under `record_eval` the
samples of all of them share the evaluation's step and mode `eval`, and history has no column
that says which dataset a sample is of: read as one series, several datasets' activations are
averaged together, and the page's query for the evaluation metrics names `eval_loss`, which
such a Trainer never logs. So the callback tells this sink which dataset runs (Lightning at each
validation batch, by its `dataloader_idx`; the Hugging Face Trainer only once a dataset's
evaluation has ended, by the prefix of its metrics, so the samples of its batches wait until
then), and index.md lists each dataset's evaluation sample ids when the fit ends: one range per
evaluation, the first `SHOWN` of each of the first `SETS` datasets, then how many more. Its
memory is those ranges and a count per dataset, and the samples of one Hugging Face evaluation.
"""

from __future__ import annotations

from torchinstruments.records import MeasurementBlock, RunCounts, RunInfo, SampleRecord
from torchinstruments.rundir.ranges import plural
from torchinstruments.rundir.shell import literal_span

__all__ = ["EvaluationSets", "metrics_prefix"]

SHOWN = 20  # ranges of sample ids listed per dataset; beyond them, counted
SETS = 8  # datasets listed (index.md has a size budget); beyond them, counted


class EvaluationSets:
    """A sink filing each evaluation sample under the dataset that ran it (`running`, or
    `batch_ended` then `evaluated`); `note` says it in index.md where there were several."""

    def __init__(self) -> None:
        self._running: str | None = None  # the dataset whose batch runs now (Lightning)
        self._batch: list[int] = []  # evaluation samples since the last batch's end (HF)
        self._waiting: list[int] = []  # the batches' samples of the running evaluation (HF)
        self._ranges: dict[str, list[list[int]]] = {}  # dataset -> [first, last] sample ids
        self._more: dict[str, int] = {}  # dataset -> ranges beyond SHOWN
        self._last = -1  # the last sample id filed, so each sample is filed once

    def running(self, name: str | None) -> None:
        """The evaluation samples from now on are of dataset `name` (None: of none)."""
        self._running = name

    def batch_ended(self) -> None:
        """An evaluation batch ended: its samples wait for their dataset's name (`evaluated`)."""
        self._waiting += self._batch
        self._batch.clear()

    def step_ended(self) -> None:
        """A training step ended: evaluation samples inside it (no_grad forwards) are of no
        dataset."""
        self._batch.clear()

    def evaluated(self, name: str | None) -> None:
        """A dataset's evaluation ended: its batches' samples are `name`'s (None: unnamed)."""
        waiting, self._waiting = self._waiting, []
        if name is not None:
            for sample_id in waiting:
                self._file(name, sample_id)
        self._batch.clear()

    def note(self, metrics: str) -> str | None:
        """index.md's note on the datasets the fit evaluated, where more than one (None:
        one or none); `metrics`: how the trainer names each dataset's metrics."""
        if len(self._ranges) < 2:
            return None
        listed = "; ".join(
            f"{literal_span(name)}: sample_id {_ranges(spans, self._more.get(name, 0))}"
            for name, spans in list(self._ranges.items())[:SETS]
        )
        if len(self._ranges) > SETS:
            listed += f"; and {plural(len(self._ranges) - SETS, 'more dataset')}"
        return (
            f"the fit's evaluations ran {plural(len(self._ranges), 'evaluation dataset')} "
            f"({metrics}), whose evaluation samples share each evaluation's step and mode eval: "
            "no column of history tells them apart, so read each dataset's samples by their "
            f"sample_id, one range per evaluation: {listed}. A summary over all evaluation "
            "samples (result.json's eval entries, a window mean) mixes the datasets"
        )

    def _file(self, name: str, sample_id: int) -> None:
        """File `sample_id` under `name`: in its last range where it follows it, else a new one."""
        spans = self._ranges.setdefault(name, [])
        if spans and spans[-1][1] == sample_id - 1:
            spans[-1][1] = sample_id
        elif len(spans) < SHOWN:
            spans.append([sample_id, sample_id])
        else:
            self._more[name] = self._more.get(name, 0) + 1

    def start(self, run: RunInfo) -> None:
        """Nothing to open."""

    def write_forward(self, record: SampleRecord) -> None:
        """An evaluation sample (no row in train mode), once: filed, or waiting for its name."""
        measurements = record.measurements
        if isinstance(measurements, MeasurementBlock):
            modes = measurements.modes
        else:
            modes = tuple(m.mode for m in measurements)
        if not modes or "train" in modes or record.sample_id <= self._last:
            return
        self._last = record.sample_id
        if self._running is not None:
            self._file(self._running, record.sample_id)
        else:
            self._batch.append(record.sample_id)

    def write_backward(self, record: SampleRecord) -> None:
        """Nothing: an evaluation sample has no backward."""

    def close(self, counts: RunCounts) -> None:
        """Nothing to close."""


def metrics_prefix(metrics: object) -> str | None:
    """The prefix of a Hugging Face evaluation's metrics (`eval`, `eval_<name>` for a dataset
    of a dict `eval_dataset`): the one of its `<prefix>_runtime`, which the Trainer's
    `evaluate()` always reports (checked on transformers 5.24.0); None where it is not there."""
    if not isinstance(metrics, dict):
        return None
    found = [key[: -len("_runtime")] for key in metrics if str(key).endswith("_runtime")]
    return found[0] if len(found) == 1 else None


def _ranges(spans: list[list[int]], more: int) -> str:
    """`1, 5-6, 9` (and `, ... (N more)`): a dataset's ranges of sample ids."""
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return shown + (f", ... ({plural(more, 'more sample')})" if more else "")
