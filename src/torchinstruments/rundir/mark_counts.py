"""What `finalize` of a killed run takes from its id mark: samples begun that left nothing else.

Design decision: counts rebuilt after a kill come from what reached the disk (history rows,
then the TensorBoard steps that have no row, `rundir.finish`). A sample whose process was killed
before any of its rows or events reached the disk leaves no trace there, but the run's id mark
in `.lock` (`rundir.id_mark`) was written as the sample was taken: the ids after every sample
the process began. `resume=True` already numbers the next attempt after it
(`attempts.plan_continuation`); `finalize` run alone reads it too, so the counts it states (and
that the killed attempt keeps in the Attempts table) never say less than the mark knows, and a
later `resume=True` finds the same counts. The mark only raises lower bounds: a run of a
version before it, or one whose mark a power loss took, is counted from the disk as before.
One read of 42 bytes per finalize of a killed run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchinstruments.records import RunCounts
from torchinstruments.rundir.attempts import raise_to_mark
from torchinstruments.rundir.id_mark import read_mark
from torchinstruments.rundir.state import RunState

__all__ = ["raised_to_mark"]


def raised_to_mark(
    directory: Path, state: RunState, counts: RunCounts, recovered: bool
) -> tuple[RunState, RunCounts]:
    """`state`'s last attempt, killed, raised to the run's id mark (`raise_to_mark`), and, for
    counts rebuilt from history (`recovered`), the run's root forwards and samples too: at
    least the mark's next forward_index, and at least what the attempts say together; the
    samples that adds are the state's `mark_samples` (index.md says them)."""
    mark = read_mark(directory)
    if mark is None:
        return state, counts
    attempts = raise_to_mark(state.attempts, mark)
    raised = attempts[-1].samples - state.attempts[-1].samples if attempts else 0
    state = dataclasses.replace(state, attempts=attempts, mark_samples=0)
    if recovered:
        samples = max(counts.samples, sum(a.samples for a in attempts))
        state = dataclasses.replace(state, mark_samples=min(raised, samples - counts.samples))
        counts = dataclasses.replace(
            counts, root_forwards=max(counts.root_forwards, mark[1]), samples=samples
        )
    return state, counts
