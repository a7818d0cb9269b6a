"""Lightning training batches whose `training_step` returned None: their samples get no backward.

Design decision: in automatic optimization, Lightning runs no backward for a batch whose
`training_step` returned None (its way to skip a batch, say a loss that came out NaN), and hands
`on_train_batch_end` an empty `outputs` (checked on Lightning 2.6.6: `{}`, where a step that
returned a loss gives `{"loss": ...}`); the optimizer still steps where the batch ends an
optimizer step, with no gradient from it. Such a batch's training samples then have output rows
and no output_gradient rows, which reads like any other missing gradient (a frozen part, a lost
hook), so the run names them: a warning at the first such batch, and index.md. The note is kept
in the run state from that first batch on (`note_so_far`, which the run directory's flush thread
reads at each round, and the callback has the run saved at once then), so a fit killed before
its end still names them, as a lower bound; the fit's end gives the whole note.

Which samples a batch took is told by a sink (`SkippedBackwards`), which costs one call per
sample record and nothing per layer: it keeps the sample ids of the current batch's training
samples (rows in mode `train`; an evaluation forward under no_grad inside the step expects no
backward anyway), cleared at each batch's start, so its memory is one batch's samples plus the
first `SHOWN` skipped ids and counts, whatever the length of the fit. The hooks are the callback's
(`lightning.py`); manual optimization, where a step returns None as a rule and runs its own
backward, is never told here.
"""

from __future__ import annotations

from torchinstruments.records import MeasurementBlock, RunCounts, RunInfo, SampleRecord
from torchinstruments.rundir.ranges import plural, ranges

__all__ = ["SkippedBackwards"]

SHOWN = 20  # sample ids (and steps) a note lists; beyond them it counts the rest
SO_FAR = (
    "up to the run's last save of its state while it went on (a lower bound where the run ended "
    "without removal: the fit's end names every such batch), "
)


class SkippedBackwards:
    """A sink keeping the current training batch's training samples, and the samples of the
    batches whose backward Lightning skipped (`skipped`)."""

    def __init__(self) -> None:
        self._batch: list[int] = []  # the current batch's training samples, in order
        self.batches = 0  # batches skipped that held a training sample
        self.samples = 0  # their training samples
        self._ids: list[int] = []  # the first SHOWN of those samples
        self._steps: list[int] = []  # the first SHOWN distinct steps of those batches
        self._more_steps = False  # whether there were more
        self._said = False  # whether the owner gave the final note (`final_note`)

    def batch_start(self) -> None:
        """A training batch starts: its samples are the ones recorded from now on."""
        self._batch.clear()

    def skipped(self, batch_idx: int, step: int) -> str | None:
        """The batch `batch_idx`, at global `step`, ran no backward: remember its samples;
        returns the warning to give when it is the fit's first such batch with a sample."""
        taken = self._batch
        if not taken:
            return None
        self.batches += 1
        self.samples += len(taken)
        self._ids += taken[: SHOWN - len(self._ids)]
        if step not in self._steps:
            if len(self._steps) < SHOWN:
                self._steps.append(step)
            else:
                self._more_steps = True
        if self.batches > 1:
            return None
        return (
            f"training_step returned None for training batch {batch_idx} (global step {step}), "
            f"so Lightning ran no backward for it: {_samples(len(taken), taken)} of that batch "
            f"{'has' if len(taken) == 1 else 'have'} output rows and no output_gradient rows; "
            "index.md names every such sample"
        )

    def note_so_far(self) -> str | None:
        """The note as the run state keeps it while the fit goes on (`NoteKeeper`): a lower
        bound, should the fit be killed before its end (None: no such batch yet)."""
        said = None if self._said else self.note()
        return None if said is None else f"{SO_FAR}{said}"

    def final_note(self) -> str | None:
        """The fit's end: the whole note (None: none), which replaces the live one from now on
        (a run closed without it keeps the live one: `NoteKeeper`)."""
        self._said = True
        return self.note()

    def note(self) -> str | None:
        """index.md's note on the fit's batches whose backward was skipped (None: none)."""
        if not self.batches:
            return None
        steps = ranges(self._steps) + (", ..." if self._more_steps else "")
        batches = plural(self.batches, "training batch", "training batches")
        those = "that batch" if self.batches == 1 else "those batches"
        return (
            f"training_step returned None for {batches} (global "
            f"{'step' if len(self._steps) == 1 else 'steps'} {steps}), and Lightning runs no "
            "backward for such a batch (the optimizer still steps where the batch ends an "
            f"optimizer step, with no gradient from it): {_samples(self.samples, self._ids)} "
            f"of {those} {'has' if self.samples == 1 else 'have'} output rows and no "
            "output_gradient rows, a skipped step rather than a gradient that did not reach a "
            "layer."
        )

    def start(self, run: RunInfo) -> None:
        """Nothing to open."""

    def write_forward(self, record: SampleRecord) -> None:
        """A training sample of the current batch joins it (once, whatever its records)."""
        measurements = record.measurements
        if isinstance(measurements, MeasurementBlock):
            training = "train" in measurements.modes
        else:
            training = any(m.mode == "train" for m in measurements)
        batch = self._batch
        if training and (not batch or batch[-1] != record.sample_id):
            batch.append(record.sample_id)

    def write_backward(self, record: SampleRecord) -> None:
        """Nothing: a skipped batch has none."""

    def close(self, counts: RunCounts) -> None:
        """Nothing to close."""


def _samples(count: int, ids: list[int]) -> str:
    """`sample 3`, `samples 3, 4`, `25 samples (0-19 and 5 more)`: the ids and the count."""
    if count == 1:
        return f"sample {ids[0]}"
    if count <= len(ids):
        return f"samples {ranges(ids)}"
    return f"{count} samples ({ranges(ids)} and {count - len(ids)} more)"
