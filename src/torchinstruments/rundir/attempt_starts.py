"""Where runs (or a parent's ranks) were restarted at different samples: the first sample that is
another attempt in some run, and each run's attempt there.

Design decision: a job restarted into its run directory (resume=True) continues sample_id and
forward_index from what that directory holds, each directory on its own: a rank whose last
samples a kill lost, or that sampled less on uneven data, begins its next attempt at a smaller
sample_id than the others. Matched on sample_id (or forward_index), one attempt's sample is then
paired with another attempt's, which neither the samplers (one on all) nor a count of attempts
(the same on all) tells. Found from the state files' attempts alone (no history is read), for
`compare`, `compare PARENT` and the parent's index.md alike. Attempts that took no sample begin
nothing; runs whose attempts begin at the same samples are apart nowhere, even where their
numbers differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchinstruments.rundir.state import RunState

__all__ = ["first_attempt_apart"]

# (first x, its last x + 1, the attempt's number) of each attempt that took a sample
_Spans = tuple[tuple[int, int, int], ...]


def _spans(state: RunState | None, x: str) -> _Spans:
    """The run's attempts that took samples, as spans of `x`."""
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


def first_attempt_apart(
    labelled: Sequence[tuple[str, RunState | None]], x: str
) -> tuple[int, dict[int, list[str]]] | None:
    """The first `x` at which some of the labelled runs begin an attempt and others, holding
    that `x` too, do not, with the labels by their attempt there; None where none is."""
    spans = {label: _spans(state, x) for label, state in labelled}
    starts = {label: {first for first, _, _ in s[1:]} for label, s in spans.items()}
    for at in sorted(set().union(*starts.values())):
        holding = {label: a for label, s in spans.items() if (a := _at(s, at)) is not None}
        if len({at in starts[label] for label in holding}) < 2:
            continue
        by_attempt: dict[int, list[str]] = {}
        for label, attempt in holding.items():
            by_attempt.setdefault(attempt, []).append(label)
        return at, dict(sorted(by_attempt.items()))
    return None
