"""`compare DIR_A DIR_B`'s reading: per series, the first x at which the two runs differ, their
matched samples and each run's extent, read in ranges of x (`cli.compare` holds the command;
this, the reading), as `cli.rank_departures` is `compare PARENT`'s.

Design decision: both runs are read together in ranges of `x` of about `chunked.CHUNK_ROWS`
rows of both (history is ordered by sample, so each range reads only the Parquet row groups
that hold it), names compared as the strings the scan decodes (`_range_rows`), and each
range's per-series result folded into one as it comes: memory is one range and one row per series, whatever the
runs' length. The same read of a range also gives each run's summary its latest rows and rows
per sample (`chunked.with_windows` adds the windows): each range is read once, not once for the
summaries and again for the differences. Matched on forward_index, that holds where each run's
forward_index goes up with its sample_id, one root forward per sample (every run the library
writes, resumed ones too: both continue): a range of forward_index is then a range of whole
samples in sample order. Where a run's does not (a hand-edited or concatenated history), its
summary is read by sample, as `show` reads it (`Differences.latest` is None). What differs and
what a matched sample is: `cli.compare`'s docstring and `cli.matching`.

Two runs of one model and sampler hold, range after range, the same series at the same samples
in the same order. Such a range (`_alike`: one comparison of the key columns) is compared side
by side, row i of A against row i of B, in one grouping (`_side_by_side`), and its result
folded row by row (`chunked.aligned`); any other range takes the general path (a full join on
the series, x and occurrence, then a grouping each), which gives the same frames. On two
3,000-layer runs of 100 samples the general path alone cost about twice the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from torchinstruments.cli.chunked import aligned, in_range, x_counts, x_ranges
from torchinstruments.cli.matching import agreement, matched_in_join, open_sample, pending
from torchinstruments.cli.reader import SERIES_KEY, RunFacts
from torchinstruments.cli.selection import Selection

__all__ = ["Differences", "differences", "first_differences"]

# `first_differences`' columns after the series key.
_AT_FIRST = (
    "matched_samples",
    "first_difference",
    "value_a_at_first_difference",
    "value_b_at_first_difference",
)

# `chunked.summarize_series`' latest row of a series, as `_extent` reads it with the differences.
_LATEST = ("module_type", "latest_value", "latest_reason", "latest_sample_id")
_LATEST_READ = (*_LATEST, "observations")


def _range_rows(rows: pl.LazyFrame, x: str, latest: bool = False) -> pl.DataFrame:
    """Series key, module_type (for the summary's latest row), x, value and unavailable_reason
    of one range of samples (whole samples), in x then write order; with `latest` and x
    forward_index, sample_id too (the summary's latest row and rows per sample).

    Names stay the strings the scan decodes: a cast to Categorical hashed each of the range's
    names once more before the grouping hashed them again, for a grouping no faster on codes
    than on strings (on two 3,000-layer runs of 100 samples, `compare` took 4.6 s of CPU with
    the cast, 3.6 s without). The cost: a name held as a string view (16 bytes) instead of a
    code (4), about 30 MB more at peak there (305 MB, now 335 MB).
    """
    frame = rows.select(
        *SERIES_KEY,
        "module_type",
        x,
        *(["sample_id"] if latest and x != "sample_id" else []),
        "value",
        "unavailable_reason",
    ).collect()
    order = frame.get_column(x)
    if order.null_count() or not order.is_sorted():  # a range of a run is: nothing to copy
        frame = frame.sort(x, maintain_order=True)
    return frame


def _numbered(frame: pl.DataFrame, x: str) -> pl.DataFrame:
    """`frame` (`_range_rows`) with each row's occurrence number within (series, x) in write
    order (`_occurrence`), which `first_differences` joins on.

    Most series have one row per sample: only the rows whose (series, x) repeats are numbered
    by group, the others are occurrence 0, so a range costs a duplicate test, not a group per
    series and sample.
    """
    frame = frame.with_row_index("_write").with_columns(
        _twice=pl.struct(*SERIES_KEY, x).is_duplicated()
    )
    once = frame.filter(~pl.col("_twice")).with_columns(_occurrence=pl.lit(0, pl.Int64))
    twice = frame.filter("_twice").with_columns(
        _occurrence=pl.int_range(pl.len(), dtype=pl.Int64).over(*SERIES_KEY, x)
    )
    if twice.is_empty():
        return once.drop("_write", "_twice")
    return pl.concat([once, twice]).sort("_write").drop("_write", "_twice")


def _matched_values(rows: pl.LazyFrame, x: str, latest: bool = False) -> pl.DataFrame:
    """`_range_rows` of one range, `_numbered`."""
    return _numbered(_range_rows(rows, x, latest), x)


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
    `matching.matched_samples`' (counted on the joined rows: `matching.matched_in_join`).
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
    matched = matched_in_join(joined, SERIES_KEY, x)  # `joined` holds the samples in common
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
        .unique(maintain_order=True)  # (`chunked.aligned`)
        .join(matched, on=SERIES_KEY, how="left", nulls_equal=True, maintain_order="left")
        .join(first, on=SERIES_KEY, how="left", nulls_equal=True, maintain_order="left")
        .with_columns(pl.col("matched_samples").fill_null(0))
    )


def _extent(values: pl.DataFrame, x: str, tag: str, latest: bool = False) -> pl.DataFrame:
    """Per series: how many samples it has in one run, and its first and last x there; with
    `latest` (x is sample_id), also the columns of `chunked.summarize_series`' latest row
    (`_LATEST`: a range's rows are in sample_id and write order) and its `observations`."""
    aggs = [
        pl.col(x).n_unique().alias(f"samples_{tag}"),
        pl.col(x).min().alias(f"first_{tag}"),
        pl.col(x).max().alias(f"last_{tag}"),
    ]
    if latest:
        aggs += [
            pl.col("module_type").last(),
            pl.col("value").last().alias("latest_value"),
            pl.col("unavailable_reason").last().alias("latest_reason"),
            pl.col("sample_id").last().alias("latest_sample_id"),
            pl.len().alias("observations"),
        ]
    return values.group_by(SERIES_KEY, maintain_order=True).agg(aggs)  # (`chunked.aligned`)


def _alike(a: pl.DataFrame, b: pl.DataFrame, x: str) -> bool:
    """Whether A's and B's rows of a range (`_range_rows`) are the same series at the same x
    in the same order (runs of one model and sampler, range after range): row i of A is then
    the row of B that `first_differences`' join pairs it with (their occurrence numbers are
    the same: `_numbered` of the same sequence), and every row's x is a sample both runs have."""
    keys = [*SERIES_KEY, x]
    return a.height == b.height and a.select(keys).equals(b.select(keys))


def _side_by_side(
    a: pl.DataFrame, b: pl.DataFrame, x: str, tolerance: float, latest: bool
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """`first_differences` and A's and B's `_extent` of a range whose rows are `_alike`, from
    one grouping of the rows side by side: no join, and no row is missing in either run (so
    no open sample's row either); the same frames, row for row, as the general path's."""
    own_b = "sample_id" if x == "sample_id" else "sample_id_b"
    right = b.select(
        value_b="value",
        _agree_b=agreement(),
        module_type_b="module_type",
        unavailable_reason_b="unavailable_reason",
        **({own_b: "sample_id"} if latest and x != "sample_id" else {}),
    )
    rows = pl.concat([a.with_columns(_agree=agreement()), right], how="horizontal")
    agree = pl.col("_agree") == pl.col("_agree_b")
    beyond = (pl.col("value") != pl.col("value_b")) & (
        (pl.col("value_b") - pl.col("value")).abs() > tolerance
    )
    differ = ~agree | beyond  # as `first_differences`' (a row missing in one run: none here)
    aggs = [
        pl.col(x).filter(agree).n_unique().alias("matched_samples"),
        pl.col(x).filter(differ).first().alias("first_difference"),  # rows are in x order
        pl.col("value").filter(differ).first().alias("value_a_at_first_difference"),
        pl.col("value_b").filter(differ).first().alias("value_b_at_first_difference"),
        pl.col(x).n_unique().alias("_samples"),
        pl.col(x).min().alias("_first"),
        pl.col(x).max().alias("_last"),
    ]
    latest_of = {}
    for tag, suffix, sample in (("a", "", "sample_id"), ("b", "_b", own_b)):
        latest_of[tag] = [
            pl.col(f"module_type{suffix}").last().alias(f"module_type_{tag}"),
            pl.col(f"value{suffix}").last().alias(f"latest_value_{tag}"),
            pl.col(f"unavailable_reason{suffix}").last().alias(f"latest_reason_{tag}"),
            pl.col(sample).last().alias(f"latest_sample_id_{tag}"),
        ]
    if latest:
        aggs += [*latest_of["a"], *latest_of["b"], pl.len().alias("observations")]
    grouped = rows.group_by(SERIES_KEY, maintain_order=True).agg(aggs)  # (`chunked.aligned`)
    diffs = grouped.select(*SERIES_KEY, *_AT_FIRST)
    extents = []
    for tag in ("a", "b"):
        columns = [
            pl.col("_samples").alias(f"samples_{tag}"),
            pl.col("_first").alias(f"first_{tag}"),
            pl.col("_last").alias(f"last_{tag}"),
        ]
        if latest:
            columns += [
                pl.col(f"{name}_{tag}").alias(name) for name in ("module_type", *_LATEST[1:])
            ]
            columns.append(pl.col("observations"))
        extents.append(grouped.select(*SERIES_KEY, *columns))
    return diffs, extents[0], extents[1]


def _fold_differences(earlier: pl.DataFrame | None, later: pl.DataFrame) -> pl.DataFrame:
    """`first_differences` of two ranges of x that share no sample, as one: matched samples
    add up, the first difference (and the values there) is the earlier range's."""
    if earlier is None:
        return later
    at = _AT_FIRST[1:]
    both = aligned(earlier, later)
    if both is not None:
        found = pl.col("first_difference").is_not_null()  # the earlier range's
        return both.select(
            *SERIES_KEY,
            pl.col("matched_samples") + pl.col("matched_samples_later"),
            *(pl.when(found).then(pl.col(c)).otherwise(pl.col(f"{c}_later")).alias(c) for c in at),
        )
    return (
        pl.concat([earlier, later], how="vertical_relaxed")
        .sort("first_difference", nulls_last=True, maintain_order=True)
        .group_by(SERIES_KEY, maintain_order=True)
        .agg(pl.col("matched_samples").sum(), pl.col(*at).first())
    )


def _fold_extent(earlier: pl.DataFrame | None, later: pl.DataFrame, tag: str) -> pl.DataFrame:
    """`_extent` of two ranges of x that share no sample, as one (the latest row: the later
    range's)."""
    if earlier is None:
        return later
    samples, first, last = f"samples_{tag}", f"first_{tag}", f"last_{tag}"
    latest = "observations" in later.columns
    both = aligned(earlier, later)
    if both is not None:
        columns = [
            pl.col(samples) + pl.col(f"{samples}_later"),
            pl.min_horizontal(first, f"{first}_later").alias(first),
            pl.max_horizontal(last, f"{last}_later").alias(last),
        ]
        if latest:
            columns += [pl.col(f"{c}_later").alias(c) for c in _LATEST]
            columns.append(pl.col("observations") + pl.col("observations_later"))
        return both.select(*SERIES_KEY, *columns)
    aggs = [pl.col(samples).sum(), pl.col(first).min(), pl.col(last).max()]
    if latest:
        aggs += [pl.col(*_LATEST).last(), pl.col("observations").sum()]
    # In order of first appearance, so that the next range's fold can be row by row.
    both = pl.concat([earlier, later], how="vertical_relaxed")
    return both.group_by(SERIES_KEY, maintain_order=True).agg(aggs)


@dataclass(frozen=True)
class Differences:
    """What `differences` read of two runs.

    Attributes:
        diffs: per series, `first_differences` (names as strings).
        extents: A's and B's `_extent` (samples_a, first_a, last_a; and b's).
        opens: A's and B's open sample (`matching.open_sample`).
        in_order: whether a range of x was a range of samples in both runs (`_in_sample_order`),
            so that `latest` and `sample_rows` were read with the differences.
        latest: with `in_order`, per run its series' latest row and observations (the columns
            of `chunked.summarize_series` before its windows; None where the run has no
            selected row), and `sample_rows`: its selected rows per sample_id, for
            `chunked.with_windows`; else (None, None) each.
    """

    diffs: pl.DataFrame
    extents: tuple[pl.DataFrame, pl.DataFrame]
    opens: tuple[int | None, int | None]
    in_order: bool = True
    latest: tuple[pl.DataFrame | None, pl.DataFrame | None] = (None, None)
    sample_rows: tuple[pl.DataFrame | None, pl.DataFrame | None] = (None, None)


def _latest_of(extent: pl.DataFrame) -> pl.DataFrame | None:
    """The summary's columns of a run's `_extent` with `latest` (strings), None if empty."""
    if extent.is_empty() or "observations" not in extent.columns:
        return None
    return extent.select(*SERIES_KEY, *_LATEST, "observations")


def _x_counts(lf: pl.LazyFrame, x: str) -> pl.DataFrame:
    """`chunked.x_counts`, with x forward_index also each x's least and greatest sample_id
    (`_lo`, `_hi`), for `_in_sample_order`: the same one read of the run's x."""
    if x == "sample_id":
        return x_counts(lf, x)
    bounds = (pl.col("sample_id").min().alias("_lo"), pl.col("sample_id").max().alias("_hi"))
    return lf.group_by(x).agg(pl.len().alias("rows"), *bounds).sort(x).collect()


def _in_sample_order(counts: pl.DataFrame, x: str) -> bool:
    """Whether ranges of the run's `x` are ranges of whole samples in sample order: x is
    sample_id, or each forward_index is one sample and sample_id goes up with it."""
    if x == "sample_id" or counts.is_empty():
        return True
    lo = counts.get_column("_lo")
    return (
        counts.get_column(x).null_count() == 0
        and lo.null_count() == 0
        and lo.equals(counts.get_column("_hi"))
        and lo.is_sorted()
        and lo.n_unique() == lo.len()
    )


def differences(
    lf_a: pl.LazyFrame,
    lf_b: pl.LazyFrame,
    selection: Selection,
    x: str,
    tolerance: float,
    facts: tuple[RunFacts, RunFacts],
) -> Differences:
    """Per series: `first_differences`, and each run's `_extent`, read in ranges of x of about
    `chunked.CHUNK_ROWS` rows of both runs (`cli.chunked`); each run's open sample; and, where
    a range of x is a range of samples in both runs (`_in_sample_order`), each run's latest rows
    for its summary: one read of each range serves both."""
    counts = (_x_counts(lf_a, x), _x_counts(lf_b, x))  # also each run's own samples
    latest = all(_in_sample_order(c, x) for c in counts)
    samples = (counts[0].select(x), counts[1].select(x))
    opens = (open_sample(facts[0], counts[0], x), open_sample(facts[1], counts[1], x))
    diffs = extent_a = extent_b = None
    rows_a: list[pl.DataFrame] = []
    rows_b: list[pl.DataFrame] = []
    for bounds in x_ranges(counts, x):
        a = _range_rows(selection.rows(in_range(lf_a, x, bounds)), x, latest)
        b = _range_rows(selection.rows(in_range(lf_b, x, bounds)), x, latest)
        if _alike(a, b, x):
            found_ab, found_a, found_b = _side_by_side(a, b, x, tolerance, latest)
        else:
            numbered = (_numbered(a, x), _numbered(b, x))
            found_ab = first_differences(*numbered, x, tolerance, samples, opens)
            found_a, found_b = _extent(a, x, "a", latest), _extent(b, x, "b", latest)
        diffs = _fold_differences(diffs, found_ab)
        extent_a = _fold_extent(extent_a, found_a, "a")
        extent_b = _fold_extent(extent_b, found_b, "b")
        if latest:  # a sample lies in one range: its rows are counted once
            rows_a.append(a.group_by("sample_id").agg(rows=pl.len()))
            rows_b.append(b.group_by("sample_id").agg(rows=pl.len()))
        del a, b  # before the next range is read
    if diffs is None or extent_a is None or extent_b is None:
        empty = _matched_values(selection.rows(lf_a.clear()), x, latest)
        diffs = first_differences(empty, empty, x, tolerance, samples)
        extent_a, extent_b = _extent(empty, x, "a"), _extent(empty, x, "b")
    kept = (_latest_of(extent_a), _latest_of(extent_b))
    found = (pl.concat(rows_a) if rows_a else None, pl.concat(rows_b) if rows_b else None)
    extents = (extent_a.drop(_LATEST_READ, strict=False), extent_b.drop(_LATEST_READ, strict=False))
    return Differences(diffs, extents, opens, latest, kept, found)
