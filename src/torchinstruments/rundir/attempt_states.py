"""The run state an attempt starts from at inject and ends with at removal.

A new run starts from its own run info; a continued one (resume=True) from the state its earlier
attempts left: their ledger, notes, TensorBoard problems and samples in flight stay the run's,
the run started when its first attempt did, and each attempt keeps its own start. At removal
the attempt's counts end its entry, and the run's counts are the whole job's (lower bounds when
an earlier attempt's were, since it was killed).
"""

from __future__ import annotations

import dataclasses

from torchinstruments.records import RunCounts, RunInfo
from torchinstruments.rundir.attempt_folds import fold_attempts
from torchinstruments.rundir.attempts import (
    FINISHED_UNREMOVED,
    REMOVED,
    UNREMOVED_NOTE,
    AttemptCounts,
    Continuation,
    attempt_notes,
    job_counts,
)
from torchinstruments.rundir.state import RunState

__all__ = ["BY_CHECKPOINT", "BY_RESUME", "BY_RETRY", "job_state", "start_state"]

# How an attempt continued its run (`AttemptCounts.continued_by`): the caller passed resume=True,
# or a trainer callback did, for a fit resumed from a checkpoint (`ckpt_path=`,
# `resume_from_checkpoint=`), where the user never wrote resume=True, or for the Hugging Face
# Trainer's retry of its training loop inside one train() call (auto_find_batch_size, after it
# ran out of memory); `show` says which.
BY_RESUME = "resume=True"
BY_CHECKPOINT = "checkpoint"
BY_RETRY = "retry"


def start_state(
    run: RunInfo,
    continuation: Continuation | None,
    previous: RunState | None,
    continued_by: str = BY_RESUME,
) -> RunState:
    """The state written at inject: this attempt's entry last in its attempts (`continued_by`:
    how it continues the run, where it does)."""
    this = AttemptCounts(
        0 if continuation is None else continuation.attempt,
        run.started_at,
        first_sample_id=0 if continuation is None else continuation.first_sample_id,
        first_forward_index=0 if continuation is None else continuation.first_forward_index,
        sampler=run.sampler,
        flush_seconds=run.history.flush_seconds,
        continued_by=None if continuation is None else continued_by,
    )
    if continuation is None or previous is None:
        return RunState(run, attempts=(this,))
    # the run started when its first attempt did; each attempt keeps its own start
    started = (continuation.attempts or (this,))[0].started_at
    if started == "unknown":
        started = previous.run.started_at
    return RunState(
        dataclasses.replace(run, started_at=started),
        interrupted=previous.interrupted,
        live_problems=previous.live_problems,
        losses=previous.losses,
        notes=_earlier_notes(previous.notes, continuation),
        removed_in_flight=previous.removed_in_flight,
        # what the finish of a kill found in the events, which no later finish reads again
        events_without_rows=previous.events_without_rows,
        events_without_rows_total=previous.events_without_rows_total,
        # a job restarted thousands of times keeps a bounded state (`rundir.attempt_folds`)
        attempts=fold_attempts((*continuation.attempts, this)),
        loss_scales=previous.counts.loss_scales if previous.counts else previous.loss_scales,
    )


def _earlier_notes(notes: tuple[str, ...], continuation: Continuation) -> tuple[str, ...]:
    """The earlier attempts' notes (the state's, or its counts'), each naming its attempt:
    those of a first attempt, written while it was the run's only one, get their label now."""
    if len(continuation.attempts) != 1:
        return notes
    return attempt_notes(continuation.attempts[0].attempt, notes)


def _unremoved(counts: RunCounts) -> bool:
    """Whether this attempt was finished without remove_observer (its counts carry the note)."""
    return any(note.startswith(UNREMOVED_NOTE) for note in counts.notes)


def job_state(
    base: RunState,
    previous: RunState | None,
    continuation: Continuation | None,
    counts: RunCounts,
    rows_produced: int,
) -> RunState:
    """The state at removal: this attempt's counts (`counts`) ended in `base.attempts`, the
    whole run's counts, and rows recorded (unknown when an earlier attempt was killed)."""
    *earlier, this = base.attempts
    ended = dataclasses.replace(
        this,
        root_forwards=counts.root_forwards,
        samples=counts.samples,
        backward_samples=counts.backward_samples,
        # finished without remove_observer (collected, or at the exit), its note says
        ended=FINISHED_UNREMOVED if _unremoved(counts) else REMOVED,
        train_forwards=counts.train_forwards,
        eval_forwards=counts.eval_forwards,
        rows=rows_produced,
    )
    if continuation is None:
        return dataclasses.replace(
            base, counts=counts, rows_recorded=rows_produced, attempts=(*earlier, ended)
        )
    # the state file's counts.notes name their attempt as its notes (and index.md) do
    labelled = dataclasses.replace(counts, notes=attempt_notes(this.attempt, counts.notes))
    if previous is None or previous.counts is None:
        return dataclasses.replace(
            base, counts=labelled, rows_recorded=rows_produced, attempts=(*earlier, ended)
        )
    rows = None if previous.rows_recorded is None else previous.rows_recorded + rows_produced
    # the run's totals are lower bounds when any earlier attempt's counts are
    bounds = any(a.counts_recovered for a in earlier)
    earlier_counts = dataclasses.replace(
        previous.counts, notes=_earlier_notes(previous.counts.notes, continuation)
    )
    return dataclasses.replace(
        base,
        counts=job_counts(continuation, earlier_counts, labelled),
        counts_recovered=previous.counts_recovered or previous.interrupted or bounds,
        rows_recorded=rows,
        attempts=(*earlier, ended),
    )
