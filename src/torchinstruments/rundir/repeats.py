"""Steps that more than one attempt sampled, read from history: what a killed attempt repeated.

Design decision: a trainer callback says at its fit's start which steps a resumed fit trains
again, and at its end which evaluations it repeated (`integrations._repeats`); the first is in
the run state once said (`rundir.live_notes`), the second lives in the process until removal,
so an attempt killed (SIGKILL) before its removal never said it. Its rows say both, as far as
the attempt got: when the run is finalized (`rundir.finish`, by `finalize` or by the next
attempt), each attempt that ended killed gets both notes from history, the steps where its
training (or evaluation) samples and an earlier attempt's share a `step`, with each attempt's
samples there. Its own counts are lower bounds (its last flush interval died with it). Cost:
one grouped scan of history per finalize that closes a killed attempt.

The killed attempt's fit-start note on the steps it trains again (`resumed_training_note`, kept
live) says the same as its rebuilt training note, less well (what it was about to train again,
not what it did, and no counts): once the rebuilt one is said, the fit-start one is dropped
(`with_killed_repeats`), so index.md says it once.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import polars as pl

from torchinstruments.rundir.ranges import plural, ranges

__all__ = [
    "killed_repeat_notes",
    "resumed_at",
    "resumed_training_note",
    "sample_steps",
    "with_killed_repeats",
]

_TRAINING = (pl.col("mode") == "train") | (pl.col("signal") == "output_gradient")
_RESUMED = "this fit resumed at global step "
_RETRIED = "this attempt, the trainer's retry of its training loop, started again at global step "
_UP_TO = "and earlier attempts had recorded training samples up to step "


def resumed_at(step: int, retried: bool = False) -> str:
    """How index.md says where an attempt that repeats steps began: a fit resumed from a
    checkpoint at `step`, or (`retried`) the trainer's retry of its training loop inside the
    same call (auto_find_batch_size), which starts again from `step` and resumed nothing."""
    return f"{_RETRIED if retried else _RESUMED}{step}"


def resumed_training_note(step: int, reached: int, retried: bool = False) -> str:
    """index.md's note, said at a resumed fit's start, that it resumed at global `step` (or,
    `retried`, that the trainer's retry of its loop started again there) and earlier attempts
    had recorded training samples up to step `reached` (>= `step`)."""
    which = (
        f"step {step} was trained again, so its"
        if reached == step
        else f"steps {step} to {reached} were trained again, so their"
    )
    return (
        f"{resumed_at(step, retried)}, {_UP_TO}{reached}: {which} samples appear in more than one attempt "
        "(tell them apart by `attempt`: the latest attempt's are the training that went on)"
    )


def sample_steps(history: Path) -> pl.DataFrame:
    """Per attempt, step and kind, the samples `history` holds: columns `attempt`, `step`,
    `training` (a row in train mode or a gradient row; else an evaluation sample) and `len`.
    Samples without a step are left out; `attempt` is null in rows of versions before it.
    Raises what reading `history` raises."""
    return (
        pl.scan_parquet(history, glob=False)
        .group_by("sample_id")
        .agg(_TRAINING.any().alias("training"), pl.col("step").max(), pl.col("attempt").first())
        .filter(pl.col("step").is_not_null())
        .group_by("attempt", "step", "training")
        .len()
        .collect()
    )


def _repeated(steps: pl.DataFrame, attempt: int, training: bool) -> tuple[list[int], dict]:
    """The steps where `attempt`'s samples of one kind and an earlier attempt's meet, and each
    attempt's samples of that kind there."""
    kind = steps.filter(pl.col("training") == training)
    own = set(kind.filter(pl.col("attempt") == attempt)["step"].to_list())
    before = kind.filter(pl.col("attempt") < attempt)
    shared = sorted(own & set(before["step"].to_list()))
    counts: dict[int, int] = {}
    for a, step, n in kind.select("attempt", "step", "len").iter_rows():
        if a is not None and step in shared and a <= attempt:
            counts[int(a)] = counts.get(int(a), 0) + int(n)
    return shared, counts


def _where(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {ranges(steps)}"


def _each(counts: dict[int, int], attempt: int) -> str:
    """`2 samples in attempt 0, at least 2 samples in attempt 1` (the killed one's: a bound)."""
    return ", ".join(
        f"{'at least ' if a == attempt else ''}{plural(n, 'sample')} in attempt {a}"
        for a, n in sorted(counts.items())
    )


# Per kind of sample: whether training, what the attempt did again, the kind's name, and
# what the latest attempt's samples are to the training that went on.
_KINDS = ((True, "trained", "training", "are"), (False, "evaluated", "evaluation", "evaluate"))


def killed_repeat_notes(history: Path, attempts: Iterable[int]) -> tuple[str, ...]:
    """index.md's notes on the steps each of `attempts` (killed: its fit never said them)
    trained or evaluated again, labelled with the attempt; empty when history is unreadable."""
    try:
        steps = sample_steps(history)
    except (OSError, pl.exceptions.PolarsError):
        return ()
    notes = []
    for attempt in attempts:
        for training, did, kind, latest in _KINDS:
            shared, counts = _repeated(steps, attempt, training=training)
            if shared:
                notes.append(
                    f"attempt {attempt}: {did} again at {_where(shared)}, where earlier attempts "
                    f"had recorded {kind} samples too, so the {kind} samples at "
                    f"{_where(shared)} appear in more than one attempt "
                    f"({_each(counts, attempt)}); tell them apart by `attempt`: the latest "
                    f"attempt's {latest} the training that went on (read from history when the "
                    f"run was finalized: attempt {attempt} was killed before its fit ended)"
                )
    return tuple(notes)


def with_killed_repeats(
    notes: tuple[str, ...], history: Path, attempts: Iterable[int]
) -> tuple[str, ...]:
    """`notes` with the repeats of each of `attempts` (killed) read from history
    (`killed_repeat_notes`); an attempt whose training repeats are said so drops its own
    fit-start note on them (`resumed_training_note`, labelled `attempt N: `), which says the
    same without the counts."""
    rebuilt = killed_repeat_notes(history, attempts)
    said = {n.partition(": ")[0] for n in rebuilt if ": trained again at " in n}
    return (*(n for n in notes if not _fit_start_note(n, said)), *rebuilt)


def _fit_start_note(note: str, labels: set[str]) -> bool:
    """Whether `note` is the fit-start note on the steps it trains again of an attempt whose
    label (`attempt N`) is in `labels`."""
    label, _, text = note.partition(": ")
    return label in labels and text.startswith((_RESUMED, _RETRIED)) and _UP_TO in text
