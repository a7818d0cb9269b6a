"""The window summary: a series' `recent` and `previous` windows and their mean, in one module.

Design decision: result.json (`rundir.summary`) and the command line's `show` and `compare` take
their window means from `window_mean`, summed exactly on the host, so the two agree to the last
bit whatever order the engine hands the values over in. Which samples a window holds is defined
once (a series' latest `window` samples, and the `window` before them), and computed two ways:
`window_summaries` for any history rows (history.parquet, or a live run's parts), reading each
series' latest `2 * window` samples and widening the range (x4) only for the series that did not
have enough; and, at removal, `latest_windows` and `tail_from_end`, which read history.parquet
in sample order once for result.json (bounded memory whatever the history's length).
`tests/test_summary.py` holds the two to the same windows on runs with nulls, interruptions
and uneven sample spacing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import polars as pl

from torchinstruments.rundir.layout import HISTORY_SCHEMA
from torchinstruments.rundir.marks import is_mark

__all__ = [
    "SERIES_KEY",
    "TENSOR_KEY",
    "finite_or_none",
    "latest_windows",
    "tail_from_end",
    "tail_windows",
    "window_mean",
    "window_means",
    "window_summaries",
]

# One tensor of one layer call, and one of its metrics: the keys of result.json and the CLI.
# `mode` is part of it: a train sample and an eval sample of one tensor are never one series
# (their windows, extrema, first and latest are each their own), in a plain loop that calls
# model.eval() as under a trainer callback with record_eval.
TENSOR_KEY = ("layer", "call_index", "signal", "tensor_path", "mode")
SERIES_KEY = (*TENSOR_KEY, "metric")

_WIDEN = 4


def finite_or_none(value: float | None) -> float | None:
    """The value if it is a finite float, else None (keeps result.json strict JSON)."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _per_sample(lf: pl.LazyFrame, keys: pl.DataFrame, since: int) -> pl.DataFrame:
    """One row per (series, sample) at sample_id >= since, for the series in `keys`."""
    value = pl.col("value")
    return (
        lf.filter(pl.col("sample_id") >= since)
        .join(keys.lazy(), on=SERIES_KEY, how="semi")
        .group_by(*SERIES_KEY, "sample_id")
        .agg(
            valid=value.count(),
            finite=value.is_finite().sum(),
            finite_values=value.filter(value.is_finite()),
        )
        .collect(engine="streaming")
    )


def _windows(lf: pl.LazyFrame, window: int) -> pl.DataFrame:
    """The `recent` (rank 0) and `previous` (rank 1) window aggregates of every series."""
    samples = (
        lf.select(pl.col("sample_id").unique())
        .collect(engine="streaming")
        .get_column("sample_id")
        .sort(descending=True)
    )
    pending = lf.select(SERIES_KEY).unique().collect(engine="streaming")
    done: list[pl.DataFrame] = []
    depth = 2 * window
    while pending.height:
        since = samples[min(depth, samples.len()) - 1]
        rows = _per_sample(lf, pending, since)
        ranked = rows.with_columns(
            rank=pl.col("sample_id").rank("ordinal", descending=True).over(SERIES_KEY) - 1
        )
        enough = ranked.group_by(SERIES_KEY).agg(n=pl.len())
        if depth < samples.len():
            enough = enough.filter(pl.col("n") >= 2 * window)
        done.append(ranked.join(enough.select(SERIES_KEY), on=SERIES_KEY, how="semi"))
        pending = pending.join(enough.select(SERIES_KEY), on=SERIES_KEY, how="anti")
        depth *= _WIDEN
    ranked = pl.concat(done) if done else pl.DataFrame()
    if not ranked.height:
        return pl.DataFrame()
    return (
        ranked.filter(pl.col("rank") < 2 * window)
        .with_columns(which=(pl.col("rank") // window).cast(pl.Int32))
        .group_by(*SERIES_KEY, "which")
        .agg(
            actual=pl.len(),
            valid=pl.col("valid").sum(),
            finite=pl.col("finite").sum(),
            # The values themselves, summed exactly on the host: a Polars sum's order (and so
            # its last bit) depends on how the engine split the rows.
            finite_values=pl.col("finite_values").explode(),
            first_sample_id=pl.col("sample_id").min(),
            last_sample_id=pl.col("sample_id").max(),
        )
    )


def window_mean(values: Sequence[float]) -> float | None:
    """The mean of a window's finite values: the one definition, for result.json and the CLI.

    Summed exactly (`math.fsum`), so the result does not depend on the order the engine handed
    the values over, and divided once. A sum that would overflow is taken over the values scaled
    by a power of two (exact for all but subnormal values) and scaled back after the division.
    None for no values, or for a mean that is not finite.
    """
    if not values:
        return None
    n = len(values)
    try:
        mean = math.fsum(values) / n
    except OverflowError:
        scale = 2.0 ** (n.bit_length() + 1)
        mean = math.fsum(v / scale for v in values) / n * scale
    return finite_or_none(mean)


def window_summaries(lf: pl.LazyFrame, window: int) -> pl.DataFrame:
    """Per series, the `recent` (`which` 0) and `previous` (`which` 1) windows of result.json.

    Columns: the series key, `which`, `actual` (samples in the window), `valid` (non-null values
    in it), `mean` (`window_mean` of its finite values), `first_sample_id`, `last_sample_id`.
    A series with fewer than `window + 1` samples has no `previous` row. The command line's
    `show` and `compare` call this too, so their window means equal result.json's to the bit.

    Args:
        lf: history rows (history.parquet, or the parts of a live run).
        window: samples per window (>= 1).
    """
    frame = _windows(lf, window)
    if not frame.height:
        schema = {name: HISTORY_SCHEMA[name] for name in SERIES_KEY}
        return pl.DataFrame(schema={**schema, **_WINDOW_SCHEMA})
    means = [
        # Exploding an empty list may give a null (version-dependent): drop it.
        window_mean([v for v in values if v is not None])
        for values in frame.get_column("finite_values").to_list()
    ]
    return frame.select(
        *SERIES_KEY,
        "which",
        "actual",
        "valid",
        pl.Series("mean", means, dtype=pl.Float64),
        "first_sample_id",
        "last_sample_id",
    )


_WINDOW_SCHEMA = {
    "which": pl.Int32(),
    "actual": pl.UInt32(),
    "valid": pl.UInt32(),
    "mean": pl.Float64(),
    "first_sample_id": pl.Int64(),
    "last_sample_id": pl.Int64(),
}


# --- result.json's windows, from one pass over history.parquet in sample order -------------


def _latest_samples(rows: pl.DataFrame, depth: int) -> pl.DataFrame:
    """The rows of each series' latest `depth` distinct samples, in their order, with their
    `rank` (1 = the series' latest sample)."""
    rank = pl.col("sample_id").rank("dense", descending=True).over(SERIES_KEY)
    return rows.with_columns(rank=rank).filter(pl.col("rank") <= depth)


def tail_windows(tail: pl.DataFrame, window: int) -> pl.DataFrame:
    """The `recent` (which 0) and `previous` (which 1) window aggregates of every series."""
    value = pl.col("value")
    return (
        tail.with_columns(which=((pl.col("rank") - 1) // window).cast(pl.Int32))
        .group_by(*SERIES_KEY, "which")
        .agg(
            actual=pl.col("sample_id").n_unique(),
            valid=value.count(),
            finite_values=value.filter(value.is_finite()),
            first_sample_id=pl.col("sample_id").min(),
            last_sample_id=pl.col("sample_id").max(),
        )
    )


def tail_from_end(
    chunk: Callable[[int], pl.LazyFrame], total: int, series: int, window: int, chunk_rows: int
) -> pl.DataFrame:
    """`_latest_samples` of the whole history, read backwards in chunks until each of the `series` series
    has more than `2 * window` samples in what was read (or the start is reached).

    More than: history is in sample order, so once a series' `2 * window + 1`-th latest sample
    has a row in what was read, every row of its latest `2 * window` samples was read too. In an
    ordinary run every series is in every sample, and only the last chunk or two are read.
    """
    depth = 2 * window + 1
    kept: pl.DataFrame | None = None
    start = (max(total, 1) - 1) // chunk_rows * chunk_rows
    for offset in range(start, -1, -chunk_rows):
        rows = chunk(offset).select(*SERIES_KEY, "sample_id", "value").collect()
        kept = _latest_samples(rows if kept is None else pl.concat([rows, kept]), depth).drop(
            "rank"
        )
        del rows
        deep = kept.group_by(SERIES_KEY).agg(n=pl.col("sample_id").n_unique())
        if deep.filter(pl.col("n") == depth).height == series:
            break
    assert kept is not None  # the loop runs at least once
    return _latest_samples(kept, 2 * window)


def latest_windows(
    scan: pl.LazyFrame,
    samples: pl.Series,
    columns: Sequence[pl.Expr],
    window: int,
    rows: int,
    chunk_rows: int,
) -> pl.DataFrame:
    """`tail_windows` of every series observed in each of the run's latest `2 * window`
    samples (in an ordinary run, every series), from one read of those samples' rows.

    Such a series' latest `2 * window` samples are the run's, so a row's rank is its sample's
    rank among `samples` (the distinct sample ids of history's `rows` rows): no ranking per
    series. A series missing from one of them is left out here; `tail_from_end` reads it back.
    The samples are read in ranges of about `chunk_rows` rows (whole samples, so the
    ranges' aggregates add up), each range's aggregated before the next is read.
    """
    distinct = samples.unique().sort(descending=True)
    latest = distinct.head(2 * window)
    ranks = pl.LazyFrame(
        {"sample_id": latest, "rank": pl.Series(range(1, latest.len() + 1), dtype=pl.UInt32)}
    )
    step = max(1, chunk_rows * distinct.len() // max(rows, 1))
    pieces = []
    for start in range(0, latest.len(), step):
        piece = latest.slice(start, step)
        in_piece = pl.col("sample_id").is_between(piece.min(), piece.max())
        frame = (
            scan.filter(in_piece, ~is_mark())
            .select(columns)
            .select(*SERIES_KEY, "sample_id", "value")
            .join(ranks, on="sample_id")
            .collect()
        )
        pieces.append(tail_windows(frame, window))
        del frame
    windows = pieces[0]
    if len(pieces) > 1:
        windows = (
            pl.concat(pieces)
            .group_by(*SERIES_KEY, "which")
            .agg(
                pl.col("actual", "valid").sum(),
                pl.col("finite_values").explode(),
                pl.col("first_sample_id").min(),
                pl.col("last_sample_id").max(),
            )
            # Exploding an empty list may give a null (version-dependent): drop it.
            .with_columns(pl.col("finite_values").list.drop_nulls())
        )
    del pieces
    every = (
        windows.group_by(SERIES_KEY)
        .agg(n=pl.col("actual").sum())
        .filter(pl.col("n") == latest.len())
        .drop("n")
    )
    return windows.join(every, on=SERIES_KEY, how="semi", nulls_equal=True)


def window_means(finite_values: pl.Series) -> list[float | None]:
    """`window_mean` of each window's list of finite values.

    Read as one flat list and the lists' lengths: converting a List column that a group-by
    built from many chunks to Python lists row by row costs several times more.
    """
    lengths = finite_values.list.len().to_list()
    flat = finite_values.explode().drop_nulls().to_list()  # an empty list explodes to a null
    means = []
    at = 0
    for length in lengths:
        means.append(window_mean(flat[at : at + length]))
        at += length
    return means
