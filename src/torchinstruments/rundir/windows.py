"""The window summary: which samples form a series' `recent` and `previous` windows, and their
`actual` and `valid` counts, `mean` and sample range, in one implementation, `window_summaries`.

result.json (`rundir.summary`) and every command of the command line (`show`, `compare`, the
`show` of a parent of rank runs, all through `cli.chunked.summarize_series`) call it, so they
agree to the last bit and a newcomer finds the definition in one place.

Definition: a series' samples are the distinct sample_ids with a row of it (marker rows of
interrupted samples are no series' rows), newest first: `recent` holds the latest `window` of
them, `previous` the `window` before. Per window: `actual` = samples in it (< window early in a
run), `valid` = non-null values, `mean` = `window_mean` of its finite values (null when there are
none; an average of per-sample statistics, not a statistic of the pooled elements),
`first_sample_id` / `last_sample_id` = its sample range.

Design decision: two reads, each in ranges of whole samples of about `chunk_rows` rows chosen by
sample_id (the filter reaches the Parquet scan; history.parquet is in sample order, so a range
reads only the row groups that hold it), each range aggregated before the next is read, so
memory stays near one range plus `series x 2 * window` rows whatever the history's length:

1. The run's latest `2 * window` samples. A series observed in each of them (in an ordinary run,
   every series) has them as its own latest samples, so a row's window is its sample's rank
   among the run's samples: no ranking per series.
2. Any other series (a layer that skips samples, gradients of some samples only, a layer that
   stopped): its rows only, read back from the newest sample, each series' latest `2 * window`
   samples kept, and a series set aside once it has that many (older ranges cannot change it),
   until none is left or the start is reached.

The same reads serve history.parquet at removal and a live run's parts in the command line,
which shows the `recent` window only (`previous=False`): a series' recent window is its latest
`window` samples whether `window` or `2 * window` are looked for, so read 1 reads the run's
latest `window` samples and read 2 keeps `window` per series, half of each.
Means are summed exactly on the host (`math.fsum`), so they do not depend on the order the
engine hands the values over in.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import polars as pl

from torchinstruments.rundir.layout import HISTORY_SCHEMA
from torchinstruments.rundir.marks import is_mark

__all__ = [
    "SERIES_KEY",
    "TENSOR_KEY",
    "WINDOW_CHUNK_ROWS",
    "check_window",
    "finite_or_none",
    "sample_rows",
    "window_mean",
    "window_summaries",
]

# One tensor of one layer call, and one of its metrics: the keys of result.json and the CLI.
# `mode` is part of it: a train sample and an eval sample of one tensor are never one series
# (their windows, extrema, first and latest are each their own), in a plain loop that calls
# model.eval() as under a trainer callback with record_eval.
TENSOR_KEY = ("layer", "call_index", "signal", "tensor_path", "mode")
SERIES_KEY = (*TENSOR_KEY, "metric")

# Rows read at a time, by default (the command line): 2**18, two fifths of a row group of
# history.parquet. `rundir.series_stats` passes its own `chunk_rows`, a fifth, to bound removal's peak.
WINDOW_CHUNK_ROWS = 2**18

# Grouped as categoricals: grouping on their integer codes is about twice as fast, and a range
# is held in a fraction of the memory; strings again in the result.
_STRINGS = ("layer", "signal", "tensor_path", "mode", "metric")

_WINDOW_SCHEMA = {
    "which": pl.Int32(),
    "actual": pl.UInt32(),
    "valid": pl.UInt32(),
    "finite": pl.UInt32(),
    "mean": pl.Float64(),
    "first_sample_id": pl.Int64(),
    "last_sample_id": pl.Int64(),
}


def finite_or_none(value: float | None) -> float | None:
    """The value if it is a finite float, else None (keeps result.json strict JSON)."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


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


def _series_rows(lf: pl.LazyFrame) -> pl.LazyFrame:
    """The rows windows are made of: no marker rows; the series key (strings as categoricals),
    sample_id and value."""
    return lf.filter(~is_mark()).select(
        *(pl.col(c).cast(pl.Categorical) if c in _STRINGS else pl.col(c) for c in SERIES_KEY),
        pl.col("sample_id"),
        pl.col("value"),
    )


def sample_rows(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Per sample_id, its rows (`rows`), marker rows left out: what `window_summaries` reads by."""
    return lf.filter(~is_mark()).group_by("sample_id").agg(rows=pl.len())


def _ranges(samples: pl.DataFrame, chunk_rows: int) -> Iterator[pl.DataFrame]:
    """`samples` (sample_id, rows; newest first) cut into consecutive runs of about
    `chunk_rows` rows, each at least one sample."""
    before = samples.get_column("rows").cum_sum() - samples.get_column("rows")
    piece = samples.with_columns(_piece=before // max(chunk_rows, 1))
    yield from (p.drop("_piece") for p in piece.partition_by("_piece", maintain_order=True))


def _read(lf: pl.LazyFrame, samples: pl.DataFrame) -> pl.LazyFrame:
    """The rows of a run of consecutive `samples` (a sample_id range: it reaches the scan)."""
    ids = samples.get_column("sample_id")
    return lf.filter(pl.col("sample_id").is_between(ids.min(), ids.max()))


def _aggregate(rows: pl.DataFrame, window: int) -> pl.DataFrame:
    """Per series and window (`which` = (rank - 1) // window, rank 1 the series' latest sample):
    `actual`, `valid`, the finite values, and the sample range."""
    value = pl.col("value")
    return (
        rows.with_columns(which=((pl.col("rank") - 1) // window).cast(pl.Int32))
        .group_by(*SERIES_KEY, "which")
        .agg(
            actual=pl.col("sample_id").n_unique(),
            valid=value.count(),
            finite_values=value.filter(value.is_finite()),
            first_sample_id=pl.col("sample_id").min(),
            last_sample_id=pl.col("sample_id").max(),
        )
    )


def _combine(pieces: list[pl.DataFrame]) -> pl.DataFrame:
    """`_aggregate` of ranges that share no sample, as one."""
    if len(pieces) == 1:
        return pieces[0]
    return (
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


def _in_every_latest(
    lf: pl.LazyFrame, latest: pl.DataFrame, window: int, chunk_rows: int
) -> pl.DataFrame:
    """Read 1: `_aggregate` of the series observed in each of the `latest` samples (the run's
    latest `2 * window`, or `window` for the recent window alone, newest first), ranked by the
    run's sample order."""
    ranks = latest.with_columns(rank=pl.int_range(1, pl.len() + 1, dtype=pl.UInt32))
    pieces = []
    for part in _ranges(ranks, chunk_rows):
        rows = _read(lf, part).join(part.lazy().drop("rows"), on="sample_id").collect()
        pieces.append(_aggregate(rows, window))
        del rows  # before the next range is read
    if not pieces:
        return pl.DataFrame()
    windows = _combine(pieces)
    every = (
        windows.group_by(SERIES_KEY)
        .agg(n=pl.col("actual").sum())
        .filter(pl.col("n") == latest.height)
        .drop("n")
    )
    return windows.join(every, on=SERIES_KEY, how="semi", nulls_equal=True)


def _latest_samples(rows: pl.DataFrame, depth: int) -> pl.DataFrame:
    """The rows of each series' latest `depth` distinct samples, with their `rank` (1 = the
    series' latest sample)."""
    rank = pl.col("sample_id").rank("dense", descending=True).over(SERIES_KEY)
    return rows.with_columns(rank=rank).filter(pl.col("rank") <= depth)


def _each_its_own(
    lf: pl.LazyFrame,
    samples: pl.DataFrame,
    pending: pl.DataFrame,
    window: int,
    chunk_rows: int,
    depth: int,
) -> pl.DataFrame:
    """Read 2: `_aggregate` of the `pending` series, each ranked by its own samples, read back
    from the newest of `samples` until each has `depth` (`2 * window`, or `window` for the
    recent window alone) or the start is reached."""
    done: list[pl.DataFrame] = []
    kept: pl.DataFrame | None = None
    for part in _ranges(samples, chunk_rows):
        rows = _read(lf, part).join(pending.lazy(), on=SERIES_KEY, how="semi", nulls_equal=True)
        rows = rows.collect()
        kept = _latest_samples(rows if kept is None else pl.concat([kept, rows]), depth)
        del rows
        deep = kept.group_by(SERIES_KEY).agg(n=pl.col("sample_id").n_unique())
        full = deep.filter(pl.col("n") == depth).drop("n")
        if full.height:
            # The ranges read hold whole samples, newest first: older ones cannot change these.
            done.append(kept.join(full, on=SERIES_KEY, how="semi", nulls_equal=True))
            kept = kept.join(full, on=SERIES_KEY, how="anti", nulls_equal=True).drop("rank")
            pending = pending.join(full, on=SERIES_KEY, how="anti", nulls_equal=True)
        else:
            kept = kept.drop("rank")
        if not pending.height:
            break
    if kept is not None and kept.height:
        done.append(_latest_samples(kept, depth))
    return _aggregate(pl.concat(done), window) if done else pl.DataFrame()


def check_window(window: object) -> None:
    """Refuses a window size that is not an int >= 1 (bool excluded), in the library's one style."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")


def window_summaries(
    lf: pl.LazyFrame,
    window: int,
    *,
    samples: pl.DataFrame | None = None,
    series: pl.DataFrame | None = None,
    chunk_rows: int = WINDOW_CHUNK_ROWS,
    previous: bool = True,
) -> pl.DataFrame:
    """Per series, its `recent` (`which` 0) and `previous` (`which` 1) windows: the one
    implementation behind result.json and every command of the command line.

    Columns: the series key (strings), `which`, `actual` (samples in the window), `valid`
    (non-null values in it), `finite` (its finite values: those `mean` is over; fewer than
    `valid` only where a hand-edited or concatenated history holds a NaN or an infinity),
    `mean` (`window_mean` of its finite values), `first_sample_id`, `last_sample_id`. A
    series with fewer than `window + 1` samples has no `previous` row.

    Args:
        lf: history rows (history.parquet, or the parts of a live run); marker rows are left out
            here.
        window: samples per window (>= 1).
        samples: `sample_rows(lf)`, when the caller has it already (None: read here).
        series: the series key of every series of `lf`, when the caller has it (None: read here).
        chunk_rows: about how many rows are read at a time.
        previous: whether the `previous` windows are wanted (False: `recent` rows only, read
            from half the samples; the command line's).
    """
    check_window(window)
    rows = _series_rows(lf)
    if samples is None or series is None:
        samples, series = pl.collect_all(
            [sample_rows(lf), rows.select(SERIES_KEY).unique()], engine="streaming"
        )
    series = series.select(
        pl.col(c).cast(pl.Categorical) if c in _STRINGS else c for c in SERIES_KEY
    )
    newest = samples.select("sample_id", "rows").sort("sample_id", descending=True)
    depth = 2 * window if previous else window  # samples looked for per series
    found = [_in_every_latest(rows, newest.head(depth), window, chunk_rows)]
    pending = series
    if found[0].height:
        pending = series.join(found[0], on=SERIES_KEY, how="anti", nulls_equal=True)
    if pending.height:
        found.append(_each_its_own(rows, newest, pending, window, chunk_rows, depth))
    found = [f for f in found if f.height]
    if not found:
        schema = {name: HISTORY_SCHEMA[name] for name in SERIES_KEY}
        return pl.DataFrame(schema={**schema, **_WINDOW_SCHEMA})
    frame = pl.concat(found)
    return frame.select(
        *(pl.col(c).cast(pl.String) if c in _STRINGS else pl.col(c) for c in SERIES_KEY),
        pl.col("which"),
        pl.col("actual", "valid").cast(pl.UInt32),
        pl.col("finite_values").list.len().cast(pl.UInt32).alias("finite"),
        pl.Series("mean", _means(frame.get_column("finite_values")), dtype=pl.Float64),
        pl.col("first_sample_id", "last_sample_id"),
    )


def _means(finite_values: pl.Series) -> list[float | None]:
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
