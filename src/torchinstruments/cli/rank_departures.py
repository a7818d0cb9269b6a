"""`compare PARENT`'s computation: per series, the first x at which one rank's value departs
from every other rank's, read in ranges of x (`cli.ranks` holds the command; this, the reading).

Design decision: all ranks are read together in ranges of `x` of about a budget of rows (history
is ordered by sample, so each range reads only the Parquet row groups that hold it); in each
range, names are compared as integer codes (Categorical) and groups found by comparing
neighbours in one sort, not by window functions, and the ranges' results are combined per
series (the earliest departure, matched samples summed). A series is keyed by its module type
too (`RANK_SERIES_KEY`): a layer name that is another module on some rank (a pipeline split) is
a series of its own, never compared with the other type.

A sample also departs where the ranks' rows disagree on what they hold (`cli.matching`: a null
against a value, or nulls for different reasons), the two-run `compare`'s difference: the ranks
named are those whose kind (a value, or a null's reason) is not the one most ranks hold; where
no kind is held by more ranks than every other (two ranks, one null), every rank there departs,
as two ranks whose values differ both do. A rank that has a sample (a row of any series
there, marker rows too) and the layer among its selected ones, but no row of a series another
rank has there, holds "no row" (its reason `NO_ROW`): the two-run `compare`'s row in one run
and none in the other (a branch one rank skipped); a rank without the sample, or without the
layer (a pipeline stage's layers, a layer of another module type there), holds nothing there;
nor does a live rank hold "no row" for a gradient at its open sample (`matching.open_sample`).

Nonfinite values (hand-edited or concatenated histories only: the library writes a null with a
reason where a statistic is not finite) take part in distances as the two-run `compare` treats
them: equal values are 0 apart (two NaN, two infinities of one sign), and a NaN or an infinity
is infinitely far from any other value. So two ranks compared as a parent depart exactly where
`compare RANK_A RANK_B` differs, but on a layer one of them does not select (which that
comparison calls absent in one run, and this one compares among the ranks that have it).
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from torchinstruments.cli.matching import agreement, matched_samples
from torchinstruments.records import OUTPUT_GRADIENT
from torchinstruments.rundir.windows import SERIES_KEY

__all__ = ["NO_ROW", "RANK_SERIES_KEY", "batch_departures", "combine_departures"]

RANK_SERIES_KEY = (*SERIES_KEY, "module_type")

# A departing rank's reason where it has the sample but no row of the series there (a layer it
# skipped): no reason the library writes reads so.
NO_ROW = "no row"
_KEY = RANK_SERIES_KEY


# The series key's string columns (every key column but call_index), compared as codes.
_TEXT_KEYS = tuple(k for k in _KEY if k != "call_index")


def _same_as(keys: Sequence[str], shift: int) -> pl.Expr:
    """Whether the row `shift` rows away holds the same `keys` (rows sorted by them)."""
    same = pl.lit(True)
    for k in keys:
        same = same & (pl.col(k) == pl.col(k).shift(shift)).fill_null(False)
    return same


def batch_departures(
    batch: pl.LazyFrame,
    x: str,
    tolerance: float,
    samples: pl.DataFrame | None = None,
    layers: pl.DataFrame | None = None,
    opens: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Per series in one x range: matched samples (`matching.matched_samples`: at least 2
    ranks agree on what the row holds), and the first x where one rank's value is more than
    `tolerance` from its nearest other rank's (`_gap`: NaN and infinities too, as the two-run
    `compare` differs on them), or where the ranks' rows disagree on what they hold
    (`_kind_departures`), a rank that has the sample and the layer but no row of the series
    there among them (`_missing_rows`; `samples`: each rank's own x, `layers`: each rank's
    selected layers; None: no such row), but a gradient row a live rank lacks at its open
    sample (`opens`: rank, x; `matching.open_sample`): it may still come.

    Names are compared as integer codes (Categorical), and groups are found by comparing
    neighbours in one sort, not by window functions: a range of millions of rows takes two
    numeric sorts.
    """
    codes = [f"_{k}" for k in _TEXT_KEYS]
    keys = [*codes, "call_index"]
    frame = batch.select(
        *(pl.col(k).cast(pl.Categorical) for k in _TEXT_KEYS),
        *(
            pl.col(k).cast(pl.Categorical).to_physical().alias(c)
            for k, c in zip(_TEXT_KEYS, codes, strict=True)
        ),
        "call_index",
        x,
        "rank",
        "value",
        pl.col("unavailable_reason").cast(pl.Categorical),
    ).collect()
    # A series with several rows in one sample (never in the library's own runs: only in
    # hand-edited or concatenated histories): its occurrences, in write order.
    per_rank = [*keys, x, "rank"]
    frame = frame.sort(*per_rank, maintain_order=True).with_columns(_start=~_same_as(per_rank, 1))
    position = pl.int_range(pl.len())
    frame = frame.with_columns(
        _occurrence=position - pl.when("_start").then(position).forward_fill()
    )
    at = [*keys, x, "_occurrence"]
    # Sorted, -inf first and NaN last: equal values are neighbours, so a rank's nearest other
    # value is one of its two neighbours, nonfinite ones too (`_gap`).
    values = frame.filter(pl.col("value").is_not_null()).sort(*at, "value")
    values = values.with_columns(
        _below=pl.when(_same_as(at, 1)).then(_gap(pl.col("value").shift(1))),
        _above=pl.when(_same_as(at, -1)).then(_gap(pl.col("value").shift(-1))),
    ).with_columns(nearest_other=pl.min_horizontal("_below", "_above"))
    series = [*_TEXT_KEYS, "call_index"]
    seen = frame.group_by(series).agg(ranks=pl.col("rank").n_unique())
    matched = matched_samples(frame, series, x)  # the two-run comparison's definition
    measured = seen.join(matched, on=series, how="left")
    rows = [*_TEXT_KEYS, *at, "rank", "value", "unavailable_reason", "nearest_other"]
    departing = (
        pl.concat(
            [
                values.filter(pl.col("nearest_other") > tolerance).select(rows),
                _kind_departures(
                    pl.concat(
                        [frame, _missing_rows(frame, samples, layers, at, x, opens)], how="diagonal"
                    ),
                    at,
                ).select(rows),
            ],
            how="vertical_relaxed",
        )
        .group_by(*at, "rank", maintain_order=True)  # a rank departing both ways: once
        .agg(
            pl.col(*_TEXT_KEYS, "value", "unavailable_reason").first(),
            pl.col("nearest_other").max(),
        )
    )
    first = departing.group_by(series).agg(first_departure=pl.col(x).min())
    at_first = (
        departing.join(first, on=series)
        .filter(pl.col(x) == pl.col("first_departure"))
        .sort("rank")
        .group_by(series)
        .agg(
            pl.col("first_departure").first(),
            departing_ranks=pl.col("rank"),
            departing_values=pl.col("value"),
            departing_reasons=pl.col("unavailable_reason").cast(pl.String),
            nearest_other=pl.col("nearest_other").max(),
        )
    )
    return measured.join(at_first, on=series, how="left").with_columns(
        pl.col(k).cast(pl.String) for k in _TEXT_KEYS
    )


def _gap(other: pl.Expr) -> pl.Expr:
    """How far `value` is from `other`, as the two-run `compare` tells a difference: 0 when
    they are equal (two NaN, two infinities of one sign too), else |value - other|, infinite
    where either is NaN or infinite (a rank whose value turned NaN departs from numbers)."""
    value = pl.col("value")
    return pl.when(value == other).then(0.0).otherwise((value - other).abs().fill_nan(float("inf")))


def _missing_rows(
    frame: pl.DataFrame,
    samples: pl.DataFrame | None,
    layers: pl.DataFrame | None,
    at: Sequence[str],
    x: str,
    opens: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """A row (value null, reason `NO_ROW`) for each rank that has a sample (`samples`: rank,
    x) and the layer (`layers`: rank, layer, module_type, its selected layers) but no row of a
    series (one occurrence, `at`) that another rank has there, as the two-run `compare` differs
    where one run has a row and the other none. A rank without the sample (it stopped, or
    sampled elsewhere) or without the layer (a pipeline stage's layers, a layer of another
    module type there) holds nothing, nor does a live rank for a gradient at its open sample
    (`opens`: rank, x). Most ranges have every row on every rank: one count per
    series and sample, and no join."""
    if samples is None or layers is None:
        return frame.clear()
    per_x = samples.group_by(x).agg(_ranks=pl.len())
    held = (
        frame.group_by(at)
        .agg(pl.len().alias("_n"), pl.col(*_TEXT_KEYS).first())
        .join(per_x, on=x)
        .filter(pl.col("_n") < pl.col("_ranks"))
    )
    if held.is_empty():
        return frame.clear()
    grid = (
        held.drop("_n", "_ranks")
        .join(samples.select(x, "rank"), on=x)
        .join(
            layers.select(
                "rank", pl.col("layer", "module_type").cast(pl.String).cast(pl.Categorical)
            ),
            on=["rank", "layer", "module_type"],
            how="semi",
        )
    )
    if opens is not None and opens.height:
        still = grid.join(opens, on=["rank", x], how="semi").filter(
            pl.col("signal").cast(pl.String) == OUTPUT_GRADIENT
        )
        grid = grid.join(still.select(*at, "rank"), on=[*at, "rank"], how="anti")
    return grid.join(frame.select(*at, "rank"), on=[*at, "rank"], how="anti").with_columns(
        value=pl.lit(None, pl.Float64),
        unavailable_reason=pl.lit(NO_ROW).cast(pl.Categorical),
    )


def _kind_departures(frame: pl.DataFrame, at: Sequence[str]) -> pl.DataFrame:
    """The rows (one per rank and occurrence, `at`) of samples where the ranks' rows disagree on
    what they hold (`matching.agreement`), each rank whose kind is not the one held by more
    ranks than every other kind: all of them where no kind is (`nearest_other` null)."""
    kinds = frame.with_columns(_agree=agreement())
    if frame["value"].null_count() == 0:  # every row a value: one kind (most ranges, no sort)
        return kinds.clear().with_columns(nearest_other=pl.lit(None, pl.Float64))
    per_kind = kinds.group_by(*at, "_agree").agg(_n=pl.len())
    split = (
        per_kind.group_by(at)
        .agg(
            _kinds=pl.len(),
            _most=pl.col("_n").max(),
            _tied=(pl.col("_n") == pl.col("_n").max()).sum(),
        )
        .filter(pl.col("_kinds") > 1)
    )
    apart = per_kind.join(split, on=at).filter(
        (pl.col("_n") < pl.col("_most")) | (pl.col("_tied") > 1)
    )
    return kinds.join(apart.select(*at, "_agree"), on=[*at, "_agree"]).with_columns(
        nearest_other=pl.lit(None, pl.Float64)
    )


def combine_departures(pieces: list[pl.DataFrame]) -> pl.DataFrame:
    """The batches' results as one row per series: the earliest departure, summed matches."""
    schema = {
        "layer": pl.String,
        "module_type": pl.String,
        "call_index": pl.Int32,
        "signal": pl.String,
        "tensor_path": pl.String,
        "mode": pl.String,
        "metric": pl.String,
        "ranks": pl.Int64,
        "matched_samples": pl.Int64,
        "first_departure": pl.Int64,
        "departing_ranks": pl.List(pl.Int64),
        "departing_values": pl.List(pl.Float64),
        "departing_reasons": pl.List(pl.String),
        "nearest_other": pl.Float64,
    }
    if not pieces:
        return pl.DataFrame(schema=schema)
    both = pl.concat(pieces, how="diagonal_relaxed")  # by name: a combined frame is a piece too
    matched = both.group_by(_KEY).agg(
        pl.col("matched_samples").sum().cast(pl.Int64),
        pl.col("ranks").max().cast(pl.Int64),
    )
    first = (
        both.filter(pl.col("first_departure").is_not_null())
        .sort("first_departure")
        .group_by(_KEY, maintain_order=True)
        .first()
        .select(
            *_KEY,
            "first_departure",
            "departing_ranks",
            "departing_values",
            "departing_reasons",
            "nearest_other",
        )
    )
    frame = matched.join(first, on=_KEY, how="left", nulls_equal=True).with_columns(
        pl.col("matched_samples").fill_null(0), pl.col("ranks").fill_null(0).cast(pl.Int64)
    )
    return frame.select(list(schema)).cast(schema)  # type: ignore[arg-type]
