"""The warning `compare` and `compare PARENT` say first where the runs (or ranks) were restarted
at different samples (`rundir.attempt_starts`): the same sample_id is then another attempt's,
another job's step, in some of them, and matching on it would pair them without a word.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchinstruments.cli.reader import RunFacts
from torchinstruments.rundir.attempt_starts import first_attempt_apart
from torchinstruments.rundir.ranges import ranges

__all__ = ["attempts_apart"]


def attempts_apart(labelled: Sequence[tuple[str, RunFacts]], x: str, runs: str) -> str | None:
    """The warning, or None. `labelled`: each run's label ("A", "rank 1") and facts; `runs`:
    "runs" or "ranks"."""
    found = first_attempt_apart([(label, f.run_state) for label, f in labelled], x)
    if found is None:
        return None
    at, by_attempt = found
    each = "; ".join(f"{_labels(labels)}: attempt {a}" for a, labels in by_attempt.items())
    one, where = ("rank", "on each rank") if runs == "ranks" else ("run", "in each run")
    return (
        f"warning: the {runs}' attempts begin at different samples: {x} {at} is {each}. "
        f"Each {one}'s directory continues {x} from the rows it holds when a job is "
        f"restarted into it, so from there on the same {x} may be another job's step "
        f"{where} (each {one}'s index.md lists its attempts)."
    )


def _labels(labels: list[str]) -> str:
    """`rank 0, 2-3` for rank labels, else the labels joined (`A, B`)."""
    if all(label.startswith("rank ") for label in labels):
        return "rank " + ranges(int(label.removeprefix("rank ")) for label in labels)
    return ", ".join(labels)
