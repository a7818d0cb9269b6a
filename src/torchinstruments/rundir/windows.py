"""The window summary: one definition of a series' `recent` and `previous` windows and their mean.

Design decision: result.json (`rundir.summary`) and the command line's `show` and `compare` take
their window means from `window_mean`, summed exactly on the host, so the two agree to the last
bit whatever order the engine hands the values over in. `window_summaries` computes the windows
of any history rows (history.parquet, or a live run's parts); it reads each series' latest
`2 * window` samples, widening the range (x4) only for the series that did not have enough.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import polars as pl

from torchinstruments.rundir.layout import HISTORY_SCHEMA

__all__ = ["SERIES_KEY", "TENSOR_KEY", "finite_or_none", "window_mean", "window_summaries"]

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
