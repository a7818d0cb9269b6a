"""What a matched sample is, in `compare DIR_A DIR_B` and `compare PARENT` alike.

Design decision: one definition, computed here for both comparisons, and said in both legends
(`matched_legend`). A series' sample is matched when two runs (or two ranks) both have its row
there and the two rows agree on what they hold: a value in each (equal or not: the values are
then compared), or a null in each for the same reason (an empty output in both: nothing to
compare, and nothing differs). A null in one and a value in the other, or nulls for different
reasons, is a difference, never a match; a row in one run only matches nothing. A series
measured several times in one sample (hand-edited or concatenated histories only) is matched
occurrence by occurrence, and the sample counts once.

A live run's latest sample is still open (`open_sample`): its output rows can be on disk while
its backward has not ended, or its gradient rows have not reached a part yet. A gradient row
that the live run (or rank) lacks there is no difference and no departure, since it may still
come; the rows it has there are compared as any others, and once its backward is written the
sample is an ordinary one. Design decision: only the latest sample, and only the gradient side:
a run's rows reach the disk in the order it measured them, so an earlier sample's gradients
written before the latest forward are on disk, and the forward's rows of a sample are
transferred together, before any of its gradients. (A backward run only after a later
sampled forward is the exception, and is then a difference, as for a finished run.) A run whose
process died before removal reads "in progress" in its state file until `finalize`, but no
process holds its run lock (`lock.writer_ended`, as its state line and the parent page tell it):
its latest sample is not open, since nothing can still come; what it lacks there is a
difference, as after `finalize`. Only where the lock cannot be told is it treated as open.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from torchinstruments.cli.reader import RunFacts
from torchinstruments.records import OUTPUT_GRADIENT
from torchinstruments.rundir.lock import writer_ended
from torchinstruments.rundir.state import Status

__all__ = [
    "agreement",
    "matched_in_join",
    "matched_legend",
    "matched_samples",
    "open_line",
    "open_sample",
    "pending",
]

# What `agreement` gives a row that holds a value: no reason can be this text.
_VALUE = "\x00value"


def agreement() -> pl.Expr:
    """Equal for two rows exactly when they agree on what they hold: `_VALUE` for a value
    (NaN and infinities too), the reason for a null."""
    return (
        pl.when(pl.col("value").is_not_null())
        .then(pl.lit(_VALUE))
        .otherwise(pl.col("unavailable_reason").cast(pl.String).fill_null(""))
    )


def matched_samples(rows: pl.DataFrame, series: Sequence[str], x: str) -> pl.DataFrame:
    """Per series: its matched samples (`matched_samples`), counted from `rows`, which hold one
    row per run (or rank) per series, `x` and `_occurrence`, with `value` and
    `unavailable_reason`. A series without a matched sample has no row."""
    return (
        rows.select(*series, x, "_occurrence", _agree=agreement())
        .group_by(*series, x, "_occurrence", "_agree")
        .agg(_runs=pl.len())
        .filter(pl.col("_runs") >= 2)
        .group_by(*series)
        .agg(matched_samples=pl.col(x).n_unique())
    )


def matched_in_join(joined: pl.DataFrame, series: Sequence[str], x: str) -> pl.DataFrame:
    """`matched_samples` of two runs from their rows already joined (full join on the series,
    `x` and `_occurrence`, each side's `agreement()` as `_agree` and `_agree_b`): a joined row
    whose sides agree is a group of `matched_samples` held by both runs. Counting it there
    spares a second grouping of every row by a text column (`compare DIR_A DIR_B`)."""
    return (
        joined.filter(pl.col("_agree") == pl.col("_agree_b"))  # a row of one run only: null
        .group_by(*series)
        .agg(matched_samples=pl.col(x).n_unique())
    )


def matched_legend(between: str, x: str) -> str:
    """The legend's sentence on `matched`, `between` naming the runs ("both runs", "at least 2
    of the ranks")."""
    return (
        f"matched: samples (matched on {x}) at which {between} have a row holding a value, or "
        "a null for the same reason (a null against a value, or nulls for different reasons, "
        "is no match)."
    )


def open_sample(facts: RunFacts, own: pl.DataFrame, x: str) -> int | None:
    """The `x` of a live run's latest sample (`own`: the run's own samples, a row of any series
    there), whose gradient rows may still come; None for a run that is not in progress, or
    whose process ended (no process holds its run lock)."""
    state = facts.run_state
    if state is None or state.status is not Status.IN_PROGRESS or own.is_empty():
        return None
    if writer_ended(facts.directory):  # killed or crashed: none of its rows can still come
        return None
    latest = own.select(pl.col(x).max()).item()
    return None if latest is None else int(latest)


def pending(x: str, at: int | None) -> pl.Expr:
    """Whether a row's series and `x` is a gradient at the open sample `at` (None: none)."""
    if at is None:
        return pl.lit(False)
    return (pl.col("signal").cast(pl.String) == OUTPUT_GRADIENT) & (pl.col(x) == at)


def open_line(who: str, x: str, at: int, what: str) -> str:
    """What the output says of a live run's open sample (`what`: "difference", "departure")."""
    return (
        f"{who} is in progress: its latest sample ({x} {at}) is still open: a gradient row "
        f"it lacks there is no {what} (the sample's backward may not have ended, or its rows "
        "not yet reached the disk; once they have, it is compared as any other)."
    )
