"""Steps a resumed fit repeats: training steps trained again, evaluations run again.

Design decision: a fit resumed from a checkpoint behind the last step its run recorded (a job
preempted after its last checkpoint) trains those steps again, and evaluates again where the
trainer evaluated after them: the first attempt evaluated at step 8 and was killed at step 9,
the second resumed at step 6 and evaluates at step 8 again. Both attempts then hold samples at
one `step`, which a join with the trainer's logs pairs with one value. What the earlier attempts
recorded is read once, from history, when the fit starts; which evaluations this fit repeats is
known only as they happen (whether a trainer evaluates again at the step it resumed at depends
on where its checkpoint was saved), so `EvaluationSteps`, a sink, counts this fit's evaluation
samples at the steps the earlier ones had, and the note is written when the fit ends. The first
note (and the pinned logger's, `logger_repeats`) is in the run state as soon as it is said
(`rundir.live_notes`); the second lives in the process until the fit's end: for a resumed fit
killed again (SIGKILL), `finalize` (or the next attempt) says both from its rows too
(`rundir.repeats`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from torchinstruments.records import MeasurementBlock, RunCounts, RunInfo, SampleRecord
from torchinstruments.rundir.event_steps import folder_steps
from torchinstruments.rundir.ranges import plural, ranges
from torchinstruments.rundir.repeats import resumed_at, sample_steps
from torchinstruments.rundir.shell import literal_span
from torchinstruments.sinks.protocol import Sink
from torchinstruments.sinks.tensorboard import TensorBoardSink

__all__ = [
    "EarlierSteps",
    "EvaluationSteps",
    "earlier_steps",
    "logger_repeats",
    "repeated_evaluations",
]


@dataclass(frozen=True)
class EarlierSteps:
    """What the earlier attempts of a continued run recorded, by `step`.

    Attributes:
        trained: the largest step of a training sample (None: none, or history unreadable).
        evaluated: (attempt, step) -> how many evaluation samples that attempt took there.
    """

    trained: int | None = None
    evaluated: Mapping[tuple[int, int], int] = field(default_factory=dict)


def earlier_steps(history: Path) -> EarlierSteps:
    """The steps of the training and evaluation samples in `history` (the earlier attempts' rows
    of a continued run), read once per resumed fit, never per sample.

    A training sample has a row in train mode or a gradient row; an evaluation sample neither.
    Training samples alone give `trained`: an evaluation sample (record_eval) taken after the
    last step a checkpoint holds carries that step (the trainer's global step, optimizer steps
    so far), while the resumed fit's first training forwards carry it too, for the next step:
    counted, it made a fit resumed exactly where its checkpoint left say that step was trained
    again.
    """
    try:
        steps = sample_steps(history)
    except Exception:  # no history yet, or unreadable: nothing to compare with
        return EarlierSteps()
    trained = steps.filter(pl.col("training"))["step"].max()
    evaluated = steps.filter(~pl.col("training"), pl.col("attempt").is_not_null())
    evaluated = evaluated.select("attempt", "step", "len")
    return EarlierSteps(
        trained=None if trained is None else int(trained),  # type: ignore[arg-type]
        evaluated={(int(a), int(s)): int(n) for a, s, n in evaluated.iter_rows()},
    )


class EvaluationSteps:
    """A sink counting this fit's evaluation samples at the steps given to `watch` (those the
    earlier attempts evaluated at): the samples whose rows are none in train mode, and which
    get no backward. Only those steps are kept, so its memory is bounded by what the earlier
    attempts evaluated, whatever the length of this fit."""

    def __init__(self) -> None:
        self._watched: frozenset[int] = frozenset()
        self._samples: dict[int, int] = {}  # sample_id -> step

    def watch(self, steps: frozenset[int]) -> None:
        """The steps whose evaluation samples to count."""
        self._watched = steps

    def counts(self) -> Counter[int]:
        """step -> this fit's evaluation samples there."""
        return Counter(self._samples.values())

    def start(self, run: RunInfo) -> None:
        """Nothing to open."""

    def write_forward(self, record: SampleRecord) -> None:
        measurements = record.measurements
        if isinstance(measurements, MeasurementBlock):
            modes, step = measurements.modes, measurements.step
        else:
            modes = tuple(m.mode for m in measurements)
            step = measurements[0].step if measurements else None
        if step in self._watched and modes and "train" not in modes:
            self._samples[record.sample_id] = step  # type: ignore[assignment]

    def write_backward(self, record: SampleRecord) -> None:
        self._samples.pop(record.sample_id, None)  # a gradient: a training sample after all

    def close(self, counts: RunCounts) -> None:
        """Nothing to close."""


def repeated_evaluations(
    earlier: EarlierSteps, this_fit: Counter[int], resume_step: int, retried: bool = False
) -> str | None:
    """index.md's note on the evaluation steps this fit and an earlier attempt both sampled,
    with each attempt's evaluation samples there; None when there are none (`retried`: the
    fit is the trainer's retry of its loop, not a resumed one: `resumed_at`)."""
    repeated = sorted(set(this_fit) & {step for _, step in earlier.evaluated})
    if not repeated:
        return None
    each = Counter[int]()
    for (attempt, step), n in earlier.evaluated.items():
        if step in repeated:
            each[attempt] += n
    counts = [f"{plural(n, 'sample')} in attempt {a}" for a, n in sorted(each.items())]
    counts.append(f"{plural(sum(this_fit[s] for s in repeated), 'sample')} in this one")
    where = f"step {repeated[0]}" if len(repeated) == 1 else f"steps {ranges(repeated)}"
    return (
        f"{resumed_at(resume_step, retried)} and evaluated again at {where}, where "
        f"earlier attempts had recorded evaluation samples too, so the evaluation samples at "
        f"{where} appear in more than one attempt ({', '.join(counts)}); tell them apart by "
        "`attempt`: the latest attempt's evaluate the training that went on"
    )


def logger_repeats(
    sink: Sink | None, resume_step: int, logger: str, retried: bool = False
) -> str | None:
    """index.md's note when the trainer's TensorBoard logger (`sink`) writes where an earlier
    attempt's did (a pinned version or logging_dir) and that one has records at steps this fit,
    resumed at `resume_step` (or, `retried`, the trainer's retry of its loop started again at
    it), writes again; None otherwise (a new folder per fit, the default).

    Why: TensorBoard's default data server keeps one record per tag and step, and a record at a
    step it has seen drops the ones at or after it (its handling of a restarted job), so those
    earlier records are no longer shown; read before this fit writes anything there.
    """
    folder = sink.log_dir() if isinstance(sink, TensorBoardSink) else None
    steps = sorted(s for s in folder_steps(Path(folder)) if s >= resume_step) if folder else []
    if not steps:
        return None
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} to {steps[-1]}"
    return (
        f"{logger} writes to {literal_span(str(folder))}, where earlier attempts wrote records up to step "
        f"{steps[-1]}; {resumed_at(resume_step, retried)} and writes there again, so "
        "TensorBoard's default data server (a record at a step it has seen drops the ones at or "
        f"after it) shows this attempt's histograms from step {resume_step} on and no longer "
        f"the earlier attempts' at {where} (its Python reader, --load_fast=false, draws both). "
        "tensorboard/ here keeps every attempt's histograms on their own steps (forward_index "
        "continues across attempts), and history.parquet every attempt's rows (`attempt` "
        "tells them apart)"
    )
