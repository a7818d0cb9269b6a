"""Where runs (or a parent's ranks) matched on sample_id were restarted at different samples.

Design decision: a job restarted into its run directory (resume=True) continues sample_id and
forward_index from what that directory holds, each directory on its own: a rank whose last
samples a kill lost, or that sampled less on uneven data, begins its next attempt at a smaller
sample_id than the others. Matched on sample_id (or forward_index), `compare` and `compare
PARENT` then pair one attempt's sample with another attempt's, which the samplers' own
warning does not see (one sampler on all) nor a count of attempts (the same count on all). So
both say, before the table, the first sample at which the runs' attempts begin apart and each
run's attempt there, from the state files' attempts (no history is read). Attempts that took no
sample begin nothing; runs whose attempts begin at the same samples are not warned about, even
where their numbers differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchinstruments.cli.reader import RunFacts
from torchinstruments.rundir.ranges import ranges

__all__ = ["attempts_apart"]

# (first x, its last x + 1, the attempt's number) of each attempt that took a sample
_Spans = tuple[tuple[int, int, int], ...]


def _spans(facts: RunFacts, x: str) -> _Spans:
    """The run's attempts that took samples, as spans of `x`."""
    state = facts.run_state
    if state is None:
        return ()
    found = []
    for a in state.attempts:
        if a.samples <= 0:
            continue
        if x == "sample_id":
            found.append((a.first_sample_id, a.first_sample_id + a.samples, a.attempt))
        else:  # forward_index: its root forwards hold its samples
            first = a.first_forward_index
            found.append((first, first + max(a.root_forwards, a.samples), a.attempt))
    return tuple(sorted(found))


def _at(spans: _Spans, at: int) -> int | None:
    """The attempt whose span holds `at`; None where none does."""
    for first, end, attempt in spans:
        if first <= at < end:
            return attempt
    return None


def attempts_apart(labelled: Sequence[tuple[str, RunFacts]], x: str, runs: str) -> str | None:
    """The warning said before the table where the runs' attempts begin at different `x`
    (see the module), or None. `labelled`: each run's label ("A", "rank 1") and facts; `runs`:
    "runs" or "ranks"."""
    spans = {label: _spans(facts, x) for label, facts in labelled}
    starts = {label: {first for first, _, _ in s[1:]} for label, s in spans.items()}
    for at in sorted(set().union(*starts.values())):
        holding = {label: _at(s, at) for label, s in spans.items() if _at(s, at) is not None}
        if len({at in starts[label] for label in holding}) < 2:
            continue
        by_attempt: dict[int, list[str]] = {}
        for label, attempt in holding.items():
            by_attempt.setdefault(attempt, []).append(label)  # type: ignore[arg-type]
        each = "; ".join(
            f"{_labels(labels)}: attempt {attempt}"
            for attempt, labels in sorted(by_attempt.items())
        )
        one, where = ("rank", "on each rank") if runs == "ranks" else ("run", "in each run")
        return (
            f"warning: the {runs}' attempts begin at different samples: {x} {at} is {each}. "
            f"Each {one}'s directory continues {x} from the rows it holds when a job is "
            f"restarted into it, so from there on the same {x} may be another job's step "
            f"{where} (each {one}'s index.md lists its attempts)."
        )
    return None


def _labels(labels: list[str]) -> str:
    """`rank 0, 2-3` for rank labels, else the labels joined (`A, B`)."""
    if all(label.startswith("rank ") for label in labels):
        return "rank " + ranges(int(label.removeprefix("rank ")) for label in labels)
    return ", ".join(labels)
