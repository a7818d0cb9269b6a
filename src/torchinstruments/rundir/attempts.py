"""A run continued across processes: its attempts, and where a new one starts.

Design decision: a restarted job (preempted, requeued, resumed from a checkpoint) continues the
run in the same directory only on request (`inject_observer(..., resume=True)`); without it the
directory is refused, so two unrelated runs never end up in one history by accident. Each
injection is one *attempt* (a process of a restarted job, or a fit resumed in the same process),
numbered from 0, and every history row carries its attempt (the `attempt` column). A continued
run:

- first completes the earlier attempt exactly as `finalize` does (`rundir.finish.finalize`: a
  killed attempt's parts merged, its losses in the ledger, its cut sample marked), so the earlier
  rows stay as they are: history.parquet is only ever extended, never rewritten row by row;
- continues `sample_id` and `forward_index` after everything the earlier attempts left, in
  history, in the run's own TensorBoard events (`rundir.event_steps`) and in the run's id mark
  (`rundir.id_mark`: the ids after every sample any attempt began, written as it was taken,
  so a sample of which nothing reached the disk before a kill still counts, in the killed
  attempt's counts too: `raise_to_mark`), so no id and no TensorBoard step is used twice; a
  killed attempt's counts are lower bounds (its last flush interval died with it), so the ids
  may skip a few, never repeat;
- continues each sampler's schedule: the training sampler is asked after the earlier attempts'
  training forwards, the evaluation sampler (a trainer callback's `record_eval`) after their
  evaluation forwards, so evaluation forwards never move the training schedule across a restart.
  Each attempt's state records both counts at removal. Where an earlier attempt's count is
  unknown (a state written before these counts were kept, or an attempt whose process died
  before removal), that schedule falls back to the rule before them: the training schedule
  continues from forward_index, the evaluation schedule starts at 0. Where the attempt whose
  counts are unknown kept two schedules (`record_eval`: its forward_index counted evaluation
  forwards too), that fallback moves both schedules, so the new attempt says so in index.md and
  a warning (`continuation_notes.schedule_fallback_note`), never silently;
- continues the part numbers after those already merged (merge.py deletes a part whose number
  history.parquet says it holds);
- keeps one `AttemptCounts` per attempt in the state file (index.md lists them), and the run's
  counts and summaries (result.json) cover the whole job; where the last attempt was killed,
  the run's counts are rebuilt from history and raised to what the attempts' own counts say
  together (`at_least_attempts`), so a removed attempt's exact counts are never undercut;
- names the attempt in each note once the run has more than one (`attempt_notes`): a note speaks
  of the attempt that added it ("attempt 0: the fit ended with an exception ..."), never of the
  whole run, which went on. The first attempt's notes, written while it was the only one, get
  their label when the second attempt starts.

The cost: a continued run re-reads the earlier history's sample and forward ids once at start
(and the TensorBoard events only after a kill), and the merge at the end rewrites
history.parquet with the new parts added (it streams).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from torchinstruments.records import RunCounts, ScaleSpan
from torchinstruments.rundir.event_steps import event_steps, steps_between
from torchinstruments.rundir.gradient_counts import no_grad_samples
from torchinstruments.rundir.id_mark import read_mark
from torchinstruments.rundir.layout import STATE_FILE
from torchinstruments.rundir.page_bounds import SHOWN_SAMPLER_RUNS
from torchinstruments.rundir.ranges import ends
from torchinstruments.rundir.shell import literal_if_unclear

IN_PROGRESS = "in progress"
REMOVED = "removed"
KILLED = "killed"
# remove_observer was called and its process died in the last flush (`rundir.state.LAST_PARTS`):
# `finalize` opens the attempt as IN_REMOVAL and closes it as KILLED_IN_LAST_FLUSH, so that no
# reader calls an attempt whose remove_observer ran "ended without remove_observer".
IN_REMOVAL = "in removal"
KILLED_IN_LAST_FLUSH = "killed during removal"
# remove_observer was never called: the run was finished when the model was collected or at the
# process's exit (`torchinstruments.unremoved`), with exact counts like a removed attempt's.
FINISHED_UNREMOVED = "finished without remove_observer"
# How the note begins that such an attempt's counts carry (`unremoved.unremoved_note`).
UNREMOVED_NOTE = "remove_observer was not called"
# The ends whose counts the attempt's own process wrote (exact).
FINISHED = (REMOVED, FINISHED_UNREMOVED)
# How each open end is closed once its process is known dead (`close_attempts`).
_CLOSED_AS = {IN_PROGRESS: KILLED, IN_REMOVAL: KILLED_IN_LAST_FLUSH}


@dataclass(frozen=True)
class AttemptCounts:
    """One process's part of a run.

    Attributes:
        attempt: its number, from 0 (the `attempt` column of its rows).
        started_at: when it was injected (UTC, ISO 8601).
        first_sample_id: the sample_id its first sample got.
        first_forward_index: the forward_index its first root forward got.
        root_forwards: root forwards it saw.
        samples: samples it took.
        backward_samples: its samples with output gradients (whose backward reached a selected
            layer's output).
        train_forwards: its root forwards on the training schedule (the training sampler's
            count); None: unknown (a state written before it was kept, or killed before removal).
        eval_forwards: its evaluation forwards on their own schedule (`record_eval`); None:
            unknown, as for `train_forwards`.
        ended: `"removed"` (remove_observer), `"finished without remove_observer"` (finished
            when the model was collected or at its process's exit: exact counts too),
            `"killed"` (its process died before
            remove_observer: counted from the rows it left, lower bounds), `"killed during
            removal"` (it died in remove_observer's last flush: counted as a killed one), or
            still open: `"in progress"`, `"in removal"` (`finalize` found it killed in that
            flush and closes it).
        sampler: the description of the sampler that chose its samples (`RunInfo.sampler` of
            that process: a restarted job may pass another); None: unknown (a state written
            before it was kept, `rundir.resume` fills what the run's own line still says).
        rows: the rows it recorded (written, or counted in the loss ledger); None: unknown
            (killed, or a state written before it was kept). Every finish checks history's
            rows of the attempt against it (`rundir.finish`).
        flush_seconds: the flush interval its process ran with (its own HistoryConfig's): what
            it may have lost when killed is bounded by its own, not by a later attempt's; None:
            unknown (a state written before it was kept).
        no_grad_samples: of a killed attempt, its samples on disk whose forward ran with grad
            disabled (`rundir.gradient_counts`: a 0 of `backward_samples` is known when they are
            all its samples); None: not counted (a finished attempt's counts are exact).
        continued_by: how it continued the run (`rundir.attempt_states.BY_RESUME`, `BY_CHECKPOINT`,
            `BY_RETRY`); None: the first attempt, or unknown (a state written before it was kept).
        last_attempt: where the entry stands for a run of attempts folded into one
            (`rundir.attempt_folds`: ones that ended alike, removed or killed, with one sampler
            and way of continuing), the last of them (`attempt` is the first) and its counts
            are theirs summed; None: the entry is one attempt's.
    """

    attempt: int
    started_at: str
    first_sample_id: int = 0
    first_forward_index: int = 0
    root_forwards: int = 0
    samples: int = 0
    backward_samples: int = 0
    ended: str = IN_PROGRESS
    train_forwards: int | None = None
    eval_forwards: int | None = None
    sampler: str | None = None
    rows: int | None = None
    flush_seconds: float | None = None
    no_grad_samples: int | None = None
    continued_by: str | None = None
    last_attempt: int | None = None

    @property
    def numbers(self) -> range:
        """The attempts the entry stands for: its own, or the run folded into it."""
        return range(
            self.attempt, (self.attempt if self.last_attempt is None else self.last_attempt) + 1
        )

    @property
    def counts_recovered(self) -> bool:
        """Whether its counts were rebuilt from its rows (its process died)."""
        return self.ended not in FINISHED


@dataclass(frozen=True)
class Continuation:
    """Where a continued run's new attempt starts.

    Attributes:
        attempt: the new attempt's number.
        first_sample_id: its first sample_id.
        first_forward_index: its first forward_index.
        first_part: the number of its first history part.
        attempts: the earlier attempts (each ended).
        samples_held: the earlier attempts' samples with a row in history (its distinct
            sample ids, always counted): after a kill, or rows lost, fewer than
            `first_sample_id` (the ids they took).
        first_train_index: what its training sampler is first asked with.
        first_eval_index: what its evaluation sampler is first asked with.
        earlier_metrics: the metrics the attempt before it measured (its run info's); None:
            unknown (its run info was rebuilt after a kill).
        earlier_focus: the focus layers of the attempt before it, likewise.
    """

    attempt: int
    first_sample_id: int
    first_forward_index: int
    first_part: int
    attempts: tuple[AttemptCounts, ...]
    samples_held: int
    first_train_index: int = 0
    first_eval_index: int = 0
    earlier_metrics: tuple[str, ...] | None = None
    earlier_focus: tuple[str, ...] | None = None

    @property
    def after_a_kill(self) -> bool:
        """Whether an earlier attempt's counts were rebuilt (its process died): the samples
        it took are known only as a lower bound."""
        return any(a.counts_recovered for a in self.attempts)


def attempt_rows(history: Path, attempt: int) -> AttemptCounts | None:
    """The counts an attempt's rows in `history` say (lower bounds), or None without rows."""
    try:
        frame = (
            pl.scan_parquet(history, glob=False)
            .filter(pl.col("attempt") == attempt)
            .select(
                first_sample=pl.col("sample_id").min(),
                first_forward=pl.col("forward_index").min(),
                last_forward=pl.col("forward_index").max(),
                samples=pl.col("sample_id").n_unique(),
                backward=pl.col("sample_id")
                .filter(pl.col("signal") == "output_gradient")
                .n_unique(),
                no_grad=no_grad_samples(),
                rows=pl.len(),
            )
            .collect()
        )
    except (OSError, pl.exceptions.PolarsError):
        return None
    row = frame.row(0, named=True)
    if not row["rows"]:
        return None
    return AttemptCounts(
        attempt,
        "unknown",
        first_sample_id=int(row["first_sample"]),
        first_forward_index=int(row["first_forward"]),
        root_forwards=int(row["last_forward"]) - int(row["first_forward"]) + 1,
        samples=int(row["samples"]),
        backward_samples=int(row["backward"]),
        no_grad_samples=int(row["no_grad"]),
    )


def close_attempts(attempts: tuple[AttemptCounts, ...], history: Path) -> tuple[AttemptCounts, ...]:
    """`attempts` with each one still open (its process died) counted from its rows in
    `history` and marked killed: "in progress" as killed, "in removal" as killed during
    removal."""
    closed = []
    for entry in attempts:
        if entry.ended in _CLOSED_AS:
            found = attempt_rows(history, entry.attempt) if history.is_file() else None
            # its root forwards began at its own first forward_index, not at its first sample's
            last = None if found is None else found.first_forward_index + found.root_forwards
            entry = dataclasses.replace(
                entry,
                root_forwards=0 if last is None else last - min(entry.first_forward_index, last),
                samples=0 if found is None else found.samples,
                backward_samples=0 if found is None else found.backward_samples,
                no_grad_samples=None if found is None else found.no_grad_samples,
                ended=_CLOSED_AS[entry.ended],
            )
        closed.append(entry)
    return tuple(closed)


def raise_to_events(
    attempts: tuple[AttemptCounts, ...], killed: Collection[int], missing: Iterable[int]
) -> tuple[AttemptCounts, ...]:
    """`attempts` with each of the `killed` ones (closed from their rows) raised to the sampled
    forwards `missing`: those the run's TensorBoard events hold and history has no row of
    (their rows died with the process). Each is one more sample of the attempt whose
    forward_index range holds it, and its root forwards reach at least that one, so the
    attempts add up to the run's counts, which `finalize` raises the same way. A state rebuilt
    without its file (deleted, unreadable) has no attempts: none to raise."""
    missing = sorted(missing)
    ends: list[int | None] = [a.first_forward_index for a in attempts[1:]]
    raised = []
    for entry, end in zip(attempts, [*ends, None][: len(attempts)], strict=True):
        mine = [
            step
            for step in missing
            if step >= entry.first_forward_index and (end is None or step < end)
        ]
        if entry.attempt in killed and mine:
            entry = dataclasses.replace(
                entry,
                root_forwards=max(entry.root_forwards, mine[-1] - entry.first_forward_index + 1),
                samples=entry.samples + len(mine),
            )
        raised.append(entry)
    return tuple(raised)


def plan_continuation(
    directory: Path,
    attempts: tuple[AttemptCounts, ...],
    history: Path,
    first_part: int,
    *,
    samples_taken: int = 0,
) -> Continuation:
    """Where the next attempt of the run in `directory` starts (its earlier attempts ended):
    after everything any earlier attempt left anywhere, so ids may skip, never repeat.

    The evidence, each a lower bound of its own: the attempts' own counts (from their first
    ids), history's last sample_id and forward_index, the run's TensorBoard events (a killed
    attempt's last samples can be there with no row: each step after the last row's
    forward_index is one more sample, `rundir.event_steps`), `samples_taken`, and the run's id
    mark (`rundir.id_mark`: the ids after the last sample any attempt began, which covers a
    sample killed before anything of it reached the disk; none in a run of a version before
    it, or after a power loss that lost it: then the rest decides).

    Args:
        directory: the run directory (finalized: no parts left, history.parquet in place).
        attempts: the earlier attempts, as the state file says (every one ended).
        history: the run's history.parquet.
        first_part: the number after the parts history.parquet holds (`merge`'s record).
        samples_taken: sample ids the run's state says were used (its loss ledger names
            samples whose rows never reached the disk): the next id is at least this.
    """
    next_sample = max((a.first_sample_id + a.samples for a in attempts), default=0)
    next_sample = max(next_sample, samples_taken)
    next_forward = max((a.first_forward_index + a.root_forwards for a in attempts), default=0)
    last_sample, last_forward, held = None, None, 0
    if history.is_file():
        frame = (
            pl.scan_parquet(history, glob=False)
            .select(
                pl.col("sample_id").max(),
                pl.col("forward_index").max(),
                held=pl.col("sample_id").n_unique(),
            )
            .collect()
        )
        last_sample, last_forward, held = frame.row(0)
        if last_sample is not None:
            next_sample = max(next_sample, int(last_sample) + 1)
        if last_forward is not None:
            next_forward = max(next_forward, int(last_forward) + 1)
    steps = _steps_that_count(directory, attempts)
    if steps:
        next_forward = max(next_forward, steps[-1] + 1)
        if last_sample is not None and last_forward is not None:
            beyond = len(steps) - bisect_right(steps, last_forward)
            next_sample = max(next_sample, int(last_sample) + 1 + beyond)
        for a, end in zip(attempts, _later_starts(attempts), strict=True):
            # one without rows: its samples are its steps (those of later attempts are theirs)
            next_sample = max(
                next_sample, a.first_sample_id + steps_between(steps, a.first_forward_index, end)
            )
    mark = read_mark(directory)
    if mark is not None:
        next_sample, next_forward = max(next_sample, mark[0]), max(next_forward, mark[1])
        attempts = raise_to_mark(attempts, mark)
    train = _schedule_total(a.train_forwards for a in attempts)
    evaluation = _schedule_total(a.eval_forwards for a in attempts)
    return Continuation(
        attempt=max((a.attempt for a in attempts), default=-1) + 1,
        first_sample_id=next_sample,
        first_forward_index=next_forward,
        first_part=first_part,
        attempts=attempts,
        first_train_index=next_forward if train is None else train,
        first_eval_index=0 if evaluation is None else evaluation,
        samples_held=int(held),
    )


def _steps_that_count(directory: Path, attempts: tuple[AttemptCounts, ...]) -> list[int]:
    """The run's TensorBoard steps, sorted, where they can tell more than the attempts' counts.

    A finished attempt's counts are exact and cover its steps, so the events (every record of
    the job: seconds for tens of thousands of samples) are read at a restart only from the
    first attempt whose counts are lower bounds (its process died) on, or all of them where no
    attempt is known (a state from before attempts were kept)."""
    killed = [a.first_forward_index for a in attempts if a.counts_recovered]
    if attempts and not killed:
        return []
    return sorted(event_steps(directory, since=min(killed, default=0)))


def _later_starts(attempts: tuple[AttemptCounts, ...]) -> list[int | None]:
    """Per attempt, the first forward_index of any later one (None for the last), in one pass."""
    starts: list[int | None] = [None]
    for a in reversed(attempts[1:]):
        later = starts[-1]
        starts.append(a.first_forward_index if later is None else min(later, a.first_forward_index))
    return starts[::-1]


def raise_to_mark(
    attempts: tuple[AttemptCounts, ...], mark: tuple[int, int]
) -> tuple[AttemptCounts, ...]:
    """`attempts` with the last one, where it was killed, raised to the run's id `mark` (next
    sample_id, next forward_index): each attempt's start writes its first ids there, so a mark
    past the last attempt's counts is that attempt's own samples, begun and killed before
    anything of them reached the disk. Its samples and root forwards then reach the mark, so
    the attempts add up to the run's count, as `raise_to_events` keeps them."""
    if not attempts or not attempts[-1].counts_recovered:
        return attempts
    last = attempts[-1]
    if mark[0] <= last.first_sample_id + last.samples:
        return attempts
    raised = dataclasses.replace(
        last,
        samples=mark[0] - last.first_sample_id,
        root_forwards=max(last.root_forwards, mark[1] - last.first_forward_index),
    )
    return (*attempts[:-1], raised)


# What a trainer callback's sampler line says under `record_eval` (integrations._fit): the
# attempt kept a training and an evaluation schedule apart.
TWO_SCHEDULES = "asked with the count of evaluation forwards (record_eval)"


def _schedule_total(counts: Iterable[int | None]) -> int | None:
    """The earlier attempts' forwards on one schedule, None when any attempt's is unknown."""
    total = 0
    for count in counts:
        if count is None:
            return None
        total += count
    return total


def _sum_known(a: int | None, b: int | None) -> int | None:
    """`a + b`, None when either is unknown."""
    return None if a is None or b is None else a + b


def sampler_line(run_sampler: str, attempts: tuple[AttemptCounts, ...]) -> str:
    """The run's sampler, as index.md and `show` say it: `sampler: <description>` when one
    sampler chose every sample, else `sampler, per attempt: attempt 0: ...; attempt 1: ...`.

    Why per attempt: `RunInfo.sampler` is the last attempt's (each attempt writes its own run
    info), and a job restarted with another sampler has samples the last one never chose.
    Each description is written by index.md's rule (`literal_if_unclear`): a user's sampler
    whose `describe()` or repr holds an escape or a line break must not rewrite the terminal
    (`show`) nor break the page's list item.
    """
    said = [a.sampler for a in attempts]
    if said and said[-1] is None:  # a state from before they were kept: the run's is the last's
        said[-1] = run_sampler
    if len(said) < 2 or all(s == run_sampler for s in said):
        return f"sampler: {literal_if_unclear(run_sampler)}"
    said = [None if s is None else literal_if_unclear(s) for s in said]
    unknown = "unknown (the state file of that attempt predates per-attempt samplers)"
    runs: list[tuple[int, int, str]] = []  # consecutive attempts of one sampler: first, last
    for a, s in zip(attempts, said, strict=True):
        if runs and runs[-1][2] == (s or unknown):
            runs[-1] = (runs[-1][0], a.numbers[-1], runs[-1][2])
        else:
            runs.append((a.attempt, a.numbers[-1], s or unknown))
    head, hidden, tail = ends(runs, SHOWN_SAMPLER_RUNS)  # the line stays bounded (index.md)
    each = [_attempts_said(first, last) + f": {s}" for first, last, s in head]
    more = f"... ({hidden} more runs of attempts, each sampler in `{STATE_FILE}`'s `attempts`)"
    each += [more] if hidden else []
    each += [_attempts_said(first, last) + f": {s}" for first, last, s in tail]
    return "sampler, per attempt: " + "; ".join(each)


def attempt_total(attempts: Iterable[AttemptCounts]) -> int:
    """How many attempts `attempts` stand for (an entry may be a folded run of them)."""
    return sum(len(a.numbers) for a in attempts)


def _attempts_said(first: int, last: int) -> str:
    """`attempt 3` or `attempts 3-7`."""
    return f"attempt {first}" if first == last else f"attempts {first}-{last}"


def at_least_attempts(counts: RunCounts, attempts: tuple[AttemptCounts, ...]) -> RunCounts:
    """`counts` rebuilt from history after a kill, raised to what the attempts' own counts say
    together (a removed attempt's are exact, a killed one's lower bounds): history's last
    forward_index and its sample ids forget an earlier attempt's unsampled last forwards, and
    its samples whose rows a write failure lost, which that attempt's removal counted."""
    if len(attempts) < 2:
        return counts
    forwards = max(a.first_forward_index + a.root_forwards for a in attempts)
    return dataclasses.replace(
        counts,
        root_forwards=max(counts.root_forwards, forwards, sum(a.root_forwards for a in attempts)),
        samples=max(counts.samples, sum(a.samples for a in attempts)),
        backward_samples=max(counts.backward_samples, sum(a.backward_samples for a in attempts)),
    )


def attempt_notes(attempt: int, notes: Iterable[str]) -> tuple[str, ...]:
    """`notes` labelled with the attempt that added them: `attempt 0: ...`."""
    return tuple(f"attempt {attempt}: {note}" for note in notes)


def job_counts(
    continuation: Continuation | None, previous: RunCounts | None, this: RunCounts
) -> RunCounts:
    """The whole run's counts: the earlier attempts' (`previous`) and this attempt's."""
    if continuation is None or previous is None:
        return this
    layers = dict(previous.layer_samples)
    for name, n in this.layer_samples.items():
        layers[name] = layers.get(name, 0) + n
    return RunCounts(
        continuation.first_forward_index + this.root_forwards,
        continuation.first_sample_id + this.samples,
        previous.backward_samples + this.backward_samples,
        layers,
        tuple(dict.fromkeys((*previous.notes, *this.notes))),
        train_forwards=_sum_known(previous.train_forwards, this.train_forwards),
        eval_forwards=_sum_known(previous.eval_forwards, this.eval_forwards),
        unobserved_eval_forwards=_sum_known(
            previous.unobserved_eval_forwards, this.unobserved_eval_forwards
        ),
        unobserved_setup_forwards=_sum_known(
            previous.unobserved_setup_forwards, this.unobserved_setup_forwards
        ),
        bypassed_by=this.bypassed_by,
        loss_scales=joined_spans(previous.loss_scales, this.loss_scales),
    )


def joined_spans(
    previous: tuple[ScaleSpan, ...], this: tuple[ScaleSpan, ...]
) -> tuple[ScaleSpan, ...]:
    """The loss scale spans of the earlier attempts, then this one's. Each attempt's spans end
    with an unread one, so a killed attempt's samples between them (whose spans died with it)
    have no scale rather than the one before; that span is left out where this attempt's first
    sample follows the earlier one's last (one span per first sample)."""
    if previous and this and previous[-1].first_sample_id == this[0].first_sample_id:
        previous = previous[:-1]
    return (*previous, *this)


__all__ = [
    "FINISHED",
    "FINISHED_UNREMOVED",
    "IN_PROGRESS",
    "IN_REMOVAL",
    "KILLED",
    "KILLED_IN_LAST_FLUSH",
    "REMOVED",
    "UNREMOVED_NOTE",
    "AttemptCounts",
    "Continuation",
    "at_least_attempts",
    "attempt_notes",
    "attempt_rows",
    "attempt_total",
    "close_attempts",
    "job_counts",
    "joined_spans",
    "plan_continuation",
    "raise_to_events",
    "raise_to_mark",
    "sampler_line",
]
