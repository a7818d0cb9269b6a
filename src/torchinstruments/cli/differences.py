"""`compare DIR_A DIR_B`'s reading: per series, the first x at which the two runs differ, their
matched samples and each run's extent, read in ranges of x (`cli.compare` holds the command;
this, the reading), as `cli.rank_departures` is `compare PARENT`'s.

Design decision: both runs are read together in ranges of `x` of about `chunked.CHUNK_ROWS`
rows of both (history is ordered by sample, so each range reads only the Parquet row groups
that hold it), names compared as integer codes (Categorical), and each range's per-series
result folded into one as it comes: memory is one range and one row per series, whatever the
runs' length. What differs and what a matched sample is: `cli.compare`'s docstring and
`cli.matching`.
"""

from __future__ import annotations

import polars as pl

from torchinstruments.cli.chunked import in_range, x_counts, x_ranges
from torchinstruments.cli.matching import agreement, matched_samples, open_sample, pending
from torchinstruments.cli.reader import SERIES_KEY, RunFacts
from torchinstruments.cli.selection import Selection

__all__ = ["differences", "first_differences"]

# The series key's string columns, read as integer codes (Categorical) while the ranges are
# compared: grouping and joining millions of rows by codes, not strings, is most of the speed.
_TEXT_KEYS = tuple(k for k in SERIES_KEY if k != "call_index")


def _matched_values(rows: pl.LazyFrame, x: str) -> pl.DataFrame:
    """Series key (its names as Categorical), x, occurrence number within (series, x) in write
    order, value and unavailable_reason, of one range of samples (whole samples, read in write order).

    Most series have one row per sample: only the rows whose (series, x) repeats are numbered
    by group, the others are occurrence 0, so a range costs a duplicate test, not a group per
    series and sample.
    """
    frame = (
        rows.select(
            *(pl.col(k).cast(pl.Categorical) if k in _TEXT_KEYS else pl.col(k) for k in SERIES_KEY),
            x,
            "value",
            pl.col("unavailable_reason").cast(pl.Categorical),
        )
        .collect()
        .sort(x, maintain_order=True)
        .with_row_index("_write")
        .with_columns(_twice=pl.struct(*SERIES_KEY, x).is_duplicated())
    )
    once = frame.filter(~pl.col("_twice")).with_columns(_occurrence=pl.lit(0, pl.Int64))
    twice = frame.filter("_twice").with_columns(
        _occurrence=pl.int_range(pl.len(), dtype=pl.Int64).over(*SERIES_KEY, x)
    )
    return pl.concat([once, twice]).sort("_write").drop("_write", "_twice")


def _named(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` with its key's names as strings again (one row per series: cheap)."""
    return frame.with_columns(pl.col(k).cast(pl.String) for k in _TEXT_KEYS)


def first_differences(
    a: pl.DataFrame,
    b: pl.DataFrame,
    x: str,
    tolerance: float,
    samples: tuple[pl.DataFrame, pl.DataFrame] | None = None,
    open_at: tuple[int | None, ...] = (None, None),
) -> pl.DataFrame:
    """Per series: matched samples, and the first x where A and B differ.

    Only samples both runs have are compared: `samples` holds each run's own (`chunked.x_counts`, so a
    series' first difference does not depend on what else is selected; None: the x of `a` and
    `b`); there, a row in one run and not the other is a difference (but a gradient row a live
    run lacks at its open sample, `open_at`: A's and B's x or None), as is a value in one and a
    null in the other or nulls for different reasons; matched samples are
    `matching.matched_samples`'.
    """
    keys = [*SERIES_KEY, x, "_occurrence"]
    own_a, own_b = (a.select(x), b.select(x)) if samples is None else samples
    common = own_a.unique().join(own_b.unique(), on=x)
    joined = (
        a.with_columns(_in_a=pl.lit(True), _agree=agreement())
        .join(
            b.with_columns(_in_b=pl.lit(True), _agree=agreement()),
            on=keys,
            how="full",
            suffix="_b",
            coalesce=True,
            nulls_equal=True,
            maintain_order="left_right",  # A's write order: the first occurrence first
        )
        .filter(pl.col(x).is_in(common[x].implode()))  # a filter keeps the order
        .rename({"value": "value_a"})
        .with_columns(pl.col("_in_a", "_in_b").fill_null(False))
    )
    open_a, open_b = pending(x, open_at[0]), pending(x, open_at[1])
    open_row = (~pl.col("_in_a") & open_a) | (~pl.col("_in_b") & open_b)  # may still come
    one_missing = (pl.col("_in_a") != pl.col("_in_b")) & ~open_row
    # A null against a value, or nulls for different reasons (`matching.agreement`).
    disagree = pl.col("_agree") != pl.col("_agree_b")
    # Equal values never differ: B - A of two equal infinities, or of two NaN, is NaN, which
    # Polars orders above every number (and so above any tolerance).
    beyond = (pl.col("value_a") != pl.col("value_b")) & (
        (pl.col("value_b") - pl.col("value_a")).abs() > tolerance
    )
    differ = one_missing | disagree | beyond
    # Each aggregation on rows chosen beforehand, so each is a plain per-group one (a filter
    # inside an aggregation is evaluated group by group: slow with one group per series).
    in_common = pl.col(x).is_in(common[x].implode())
    matched = matched_samples(pl.concat([a.filter(in_common), b.filter(in_common)]), SERIES_KEY, x)
    first = (
        joined.filter(differ)
        .sort(x, maintain_order=True)  # the first row at the first x, in joined order
        .group_by(SERIES_KEY, maintain_order=True)
        .agg(
            first_difference=pl.col(x).first(),
            value_a_at_first_difference=pl.col("value_a").first(),
            value_b_at_first_difference=pl.col("value_b").first(),
        )
    )
    return (
        joined.select(SERIES_KEY)
        .unique()
        .join(matched, on=SERIES_KEY, how="left", nulls_equal=True)
        .join(first, on=SERIES_KEY, how="left", nulls_equal=True)
        .with_columns(pl.col("matched_samples").fill_null(0))
    )


def _extent(values: pl.DataFrame, x: str, tag: str) -> pl.DataFrame:
    """Per series: how many samples it has in one run, and its first and last x there."""
    return values.group_by(SERIES_KEY).agg(
        pl.col(x).n_unique().alias(f"samples_{tag}"),
        pl.col(x).min().alias(f"first_{tag}"),
        pl.col(x).max().alias(f"last_{tag}"),
    )


def _fold_differences(earlier: pl.DataFrame | None, later: pl.DataFrame) -> pl.DataFrame:
    """`first_differences` of two ranges of x that share no sample, as one: matched samples
    add up, the first difference (and the values there) is the earlier range's."""
    if earlier is None:
        return later
    at = ("first_difference", "value_a_at_first_difference", "value_b_at_first_difference")
    return (
        pl.concat([earlier, later], how="vertical_relaxed")
        .sort("first_difference", nulls_last=True, maintain_order=True)
        .group_by(SERIES_KEY, maintain_order=True)
        .agg(pl.col("matched_samples").sum(), pl.col(*at).first())
    )


def _fold_extent(earlier: pl.DataFrame | None, later: pl.DataFrame, tag: str) -> pl.DataFrame:
    """`_extent` of two ranges of x that share no sample, as one."""
    if earlier is None:
        return later
    return (
        pl.concat([earlier, later], how="vertical_relaxed")
        .group_by(SERIES_KEY)
        .agg(
            pl.col(f"samples_{tag}").sum(),
            pl.col(f"first_{tag}").min(),
            pl.col(f"last_{tag}").max(),
        )
    )


def differences(
    lf_a: pl.LazyFrame,
    lf_b: pl.LazyFrame,
    selection: Selection,
    x: str,
    tolerance: float,
    facts: tuple[RunFacts, RunFacts],
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, tuple[int | None, int | None]]:
    """Per series: `first_differences`, and each run's `_extent`, read in ranges of x of about
    `chunked.CHUNK_ROWS` rows of both runs (`cli.chunked`); and each run's open sample."""
    counts = (x_counts(lf_a, x), x_counts(lf_b, x))  # also each run's own samples
    samples = (counts[0].select(x), counts[1].select(x))
    opens = (open_sample(facts[0], counts[0], x), open_sample(facts[1], counts[1], x))
    diffs = extent_a = extent_b = None
    for bounds in x_ranges(counts, x):
        a = _matched_values(selection.rows(in_range(lf_a, x, bounds)), x)
        b = _matched_values(selection.rows(in_range(lf_b, x, bounds)), x)
        diffs = _fold_differences(diffs, first_differences(a, b, x, tolerance, samples, opens))
        extent_a = _fold_extent(extent_a, _extent(a, x, "a"), "a")
        extent_b = _fold_extent(extent_b, _extent(b, x, "b"), "b")
        del a, b  # before the next range is read
    if diffs is None or extent_a is None or extent_b is None:
        empty = _matched_values(selection.rows(lf_a.clear()), x)
        diffs = first_differences(empty, empty, x, tolerance, samples)
        extent_a, extent_b = _extent(empty, x, "a"), _extent(empty, x, "b")
    return _named(diffs), _named(extent_a), _named(extent_b), opens
