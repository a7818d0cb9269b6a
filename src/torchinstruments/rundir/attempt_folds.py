"""A bound on the attempts a run's state keeps one by one.

Design decision: `.state.json` kept one `AttemptCounts` per attempt (about 400 bytes), so a job
restarted thousands of times (a preemptible cluster) grew its state file, which every inject,
flush-thread save, removal, `finalize` and `show` reads or writes whole, without bound (4 MB
and about a second more per restart at 10,000 attempts). Every attempt is still counted, never
dropped: as each attempt starts (`attempt_states.start_state`) the entries between the first
`KEPT_FIRST` and the last `KEPT_LAST` are folded, each run of consecutive attempts that ended
alike (removed, finished without remove_observer, or killed: a preempted job's SIGTERM writes
its rows, then ends the process, so its attempts end killed) with the same sampler, way of
continuing the run and flush interval becoming one entry that names its first and last attempt
(`AttemptCounts.last_attempt`) and holds their counts summed (exact where theirs were, lower
bounds where they were killed; rows too, so each finish still checks history's rows of them
together). What a reader needs one by one stays one by one: the first and last attempts
(index.md's Attempts table shows 6 of each), and every attempt killed during removal, or whose
sampler or continuation differs from its neighbours'; readers that name attempts (the state
line, `show`) name a folded entry's as the range it stands for. What a folded entry forgets:
each attempt's start time and its own first ids, which no reader needs again once the
attempts after it started (the `attempt` column of history still says which rows each attempt
wrote): the ids a folded killed attempt may have skipped are said for the fold as a whole, a
gap in history's sample ids inside it is not called rows missing, and `compare` of runs
restarted at different samples finds where their attempts part only among the entries kept one
by one. The bound is in the changes, not the attempts: a job whose attempts alternate how
they end (removed, then killed, then removed) keeps one entry per change between them, since
an entry says one end for each of its attempts. The cost: one pass over the entries per
attempt start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torchinstruments.rundir.attempts import FINISHED, KILLED, AttemptCounts

__all__ = ["KEPT_FIRST", "KEPT_LAST", "fold_attempts"]

KEPT_FIRST = 6  # the first attempts kept one by one (the Attempts table shows 6 of each end)
KEPT_LAST = 50  # the last ones, where every restart's own facts are read
# The ends an entry may be folded with: a plain kill too (a preempted job's SIGTERM ends its
# attempt so), never one killed during removal, which readers name one by one.
_FOLDED_ENDS = (*FINISHED, KILLED)


def fold_attempts(attempts: Sequence[AttemptCounts]) -> tuple[AttemptCounts, ...]:
    """`attempts` with the finished ones between the first `KEPT_FIRST` and the last
    `KEPT_LAST` folded into one entry per run of alike ones (see the module docstring); as they
    are while they are no more than those."""
    if len(attempts) <= KEPT_FIRST + KEPT_LAST:
        return tuple(attempts)
    middle: list[AttemptCounts] = []
    for entry in attempts[KEPT_FIRST : len(attempts) - KEPT_LAST]:
        if middle and _alike(middle[-1], entry):
            middle[-1] = _folded(middle[-1], entry)
        else:
            middle.append(entry)
    return (*attempts[:KEPT_FIRST], *middle, *attempts[len(attempts) - KEPT_LAST :])


def _alike(a: AttemptCounts, b: AttemptCounts) -> bool:
    """Whether `b` can join `a`'s entry: both ended the same way (finished, or killed) and said
    the same way."""
    return (
        a.ended in _FOLDED_ENDS
        and b.ended == a.ended
        and (b.sampler, b.continued_by, b.flush_seconds)
        == (a.sampler, a.continued_by, a.flush_seconds)
    )


def _folded(a: AttemptCounts, b: AttemptCounts) -> AttemptCounts:
    """One entry for the attempts of `a` and then `b`: `a`'s start and first ids, the counts of
    both summed (unknown where either's is)."""
    return dataclasses.replace(
        a,
        root_forwards=a.root_forwards + b.root_forwards,
        samples=a.samples + b.samples,
        backward_samples=a.backward_samples + b.backward_samples,
        train_forwards=_sum(a.train_forwards, b.train_forwards),
        eval_forwards=_sum(a.eval_forwards, b.eval_forwards),
        rows=_sum(a.rows, b.rows),
        no_grad_samples=_sum(a.no_grad_samples, b.no_grad_samples),
        last_attempt=b.numbers[-1],
    )


def _sum(a: int | None, b: int | None) -> int | None:
    """`a + b`, None when either is unknown."""
    return None if a is None or b is None else a + b
