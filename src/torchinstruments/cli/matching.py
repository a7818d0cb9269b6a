"""What a matched sample is, in `compare DIR_A DIR_B` and `compare PARENT` alike.

Design decision: one definition, computed here for both comparisons, and said in both legends
(`matched_legend`). A series' sample is matched when two runs (or two ranks) both have its row
there and the two rows agree on what they hold: a value in each (equal or not: the values are
then compared), or a null in each for the same reason (an empty output in both: nothing to
compare, and nothing differs). A null in one and a value in the other, or nulls for different
reasons, is a difference, never a match; a row in one run only matches nothing. A series
measured several times in one sample (hand-edited or concatenated histories only) is matched
occurrence by occurrence, and the sample counts once.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

__all__ = ["agreement", "matched_legend", "matched_samples"]

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


def matched_legend(between: str, x: str) -> str:
    """The legend's sentence on `matched`, `between` naming the runs ("both runs", "at least 2
    of the ranks")."""
    return (
        f"matched: samples (matched on {x}) at which {between} have a row holding a value, or "
        "a null for the same reason (a null against a value, or nulls for different reasons, "
        "is no match)."
    )
