"""result.json's numbers: one pass over history in chunks, one row per series.

Design decision: plain group-by aggregates (counts, first/latest, finite min/max, shape and
dtype, each tensor's dtypes' sample ranges: `rundir.dtype_spans`) are taken per chunk of
`SUMMARY_CHUNK_ROWS` rows and combined, in memory proportional to the number of
tensor-metrics; the earliest sample at the min/max comes from one Int128 key per row
(`_extreme_keys`), so every aggregate is a plain one (no per-group filter). The windows are
`rundir.windows.window_summaries`, the one implementation the command line calls too, handed
the samples and series this pass found (so it reads only the latest samples of an ordinary run,
in ranges of whole samples). Memory stays near `tensor-metrics x 2 * window` rows. The text of
result.json is `rundir.result_text`'s; which layers it lists, `rundir.summary`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from torchinstruments.rundir.dtype_spans import DtypeSpans
from torchinstruments.rundir.layout import HISTORY_ROW_GROUP_ROWS, scan_history
from torchinstruments.rundir.marks import is_mark
from torchinstruments.rundir.windows import SERIES_KEY, window_summaries

# Rows read at a time by the summary (see `series_summary`): a fifth of a row group of
# history.parquet (2**17 rows). The chunk's aggregates, not the decoded rows, set removal's peak:
# measured on bench/removal.py (AMD EPYC, 2 cores, one process), chain (1 M rows, 18k series),
# with 2**18-row groups: a whole group per chunk peaks at +254 MiB over the RSS before, half at
# +218 MiB, for 1.01 against 1.12 s of CPU; deep (60 steps, 3.2 M rows, 54k series): +281
# against +225 MiB, 3.03 against 3.47 s. With 655,360-row groups each chunk still decodes its
# whole group (one page per column), about 0.08 s more CPU on the chain than 2**18-row groups.
SUMMARY_CHUNK_ROWS = HISTORY_ROW_GROUP_ROWS // 5


# Which windows a series row holds, as `previous_*` / `recent_*` columns: `which` 1 and 0 of
# `window_summaries`.
WINDOW_NAMES = ("previous", "recent")
_WINDOW_COLUMNS = ("actual", "valid", "mean", "first_sample_id", "last_sample_id")


# `_extreme_keys`: an Int128 is (value's order) * 2**64 + (a sample's order in [0, 2**64)).
_LOW = 2**64
_HALF = 2**63
_FLIP = 0x7FFF_FFFF_FFFF_FFFF


def _extreme_keys(chunk: pl.DataFrame) -> pl.DataFrame:
    """`chunk` with `low_key` / `high_key`: integers whose minimum / maximum over a series give
    its finite minimum / maximum and the earliest sample holding it, in one plain aggregate.

    Why: the earliest sample at the minimum needs the minimum first (a filter per group, most
    of the summary's cost), and Polars' `min_by` / `arg_min` may pick any of equal values. An
    Int128 ordered as (value, sample) for the minimum, (value, -sample) for the maximum, has one
    minimum whatever the ties. The value's part is its order-preserving integer image (its bits,
    with -0.0 as 0.0 since the two are equal values, and negative floats' magnitude bits
    flipped); null where the value is not finite.
    """
    value = pl.col("value")
    bits = pl.when(value == 0.0).then(pl.lit(0.0)).otherwise(value).reinterpret(dtype=pl.Int64)
    ordered = pl.when(bits < 0).then(bits ^ _FLIP).otherwise(bits)
    image = pl.when(value.is_finite()).then(ordered.cast(pl.Int128) * _LOW)
    sample = pl.col("sample_id").cast(pl.Int128)
    return chunk.with_columns(image=image).with_columns(
        low_key=pl.col("image") + (sample + _HALF), high_key=pl.col("image") + (_HALF - 1 - sample)
    )


def _chunk_stats(chunk: pl.DataFrame) -> pl.DataFrame:
    """Counts, first/latest, finite min/max (with `_extreme_keys`), and the latest
    module_type, shape, dtype, placement and mesh_coordinate, per series of one chunk of
    history (in history order)."""
    value, sample = pl.col("value"), pl.col("sample_id")
    finite = value.filter(value.is_finite())
    return (
        _extreme_keys(chunk)
        .group_by(SERIES_KEY)
        .agg(
            observations=pl.len(),
            valid=value.count(),
            first_value=value.first(),
            first_sample_id=sample.first(),
            latest_value=value.last(),
            latest_sample_id=sample.last(),
            min_value=finite.min(),
            low_key=pl.col("low_key").min(),
            max_value=finite.max(),
            high_key=pl.col("high_key").max(),
            module_type=pl.col("module_type").last(),
            shape=pl.col("shape").last(),
            dtype=pl.col("dtype").last(),
            placement=pl.col("placement").last(),
            mesh_coordinate=pl.col("mesh_coordinate").last(),
        )
    )


def _combine_stats(frames: Sequence[pl.DataFrame]) -> pl.DataFrame:
    """`_chunk_stats` of consecutive stretches of history (in history order), as one."""
    return (
        pl.concat(frames)
        .group_by(SERIES_KEY, maintain_order=True)
        .agg(
            pl.col("observations", "valid").sum(),
            pl.col("module_type", "shape", "dtype", "placement", "mesh_coordinate").last(),
            pl.col("first_value", "first_sample_id").first(),
            pl.col("latest_value", "latest_sample_id").last(),
            pl.col("min_value", "low_key").min(),
            pl.col("max_value", "high_key").max(),
        )
        .select(frames[0].columns)
    )


def _extreme_samples(stats: pl.DataFrame) -> pl.DataFrame:
    """`stats` with `min_sample_id` / `max_sample_id` read from their `_extreme_keys`."""
    return stats.with_columns(
        min_sample_id=(pl.col("low_key") % _LOW - _HALF).cast(pl.Int64),
        max_sample_id=(_HALF - 1 - pl.col("high_key") % _LOW).cast(pl.Int64),
    ).drop("low_key", "high_key")


def series_summary(history: Path, window: int) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """One row per series: `_chunk_stats`' columns, then `previous_*` / `recent_*`; and each
    tensor's dtypes with their first and last sample (`rundir.dtype_spans`).

    One pass over history.parquet in chunks of `SUMMARY_CHUNK_ROWS` rows (history order is
    sample order, so a chunk continues the one before it), each chunk's aggregates combined with
    those so far, with each sample's rows; then the windows, from `rundir.windows`' one
    implementation given those samples and series. Memory: one chunk, plus frames the size of
    the number of series (the windows' with up to `2 * window` samples per series), whatever the
    history's length.
    """
    # Strings as categoricals while aggregating: grouping on their integer codes is about twice
    # as fast and holds a chunk in a fraction of the memory; strings again at the end.
    strings = (
        *("layer", "signal", "tensor_path", "mode", "metric"),
        *("module_type", "dtype", "placement"),
    )
    columns = (
        *(pl.col(c).cast(pl.Categorical) if c in strings else pl.col(c) for c in SERIES_KEY),
        pl.col("sample_id"),
        pl.col("value"),
        pl.col("module_type", "dtype", "placement").cast(pl.Categorical),
        pl.col("shape"),
        pl.col("mesh_coordinate"),
    )
    scan = scan_history(history)
    total = scan.select(pl.len()).collect().item()

    def chunk(offset: int) -> pl.LazyFrame:
        """Rows [offset, offset + SUMMARY_CHUNK_ROWS) of history, marks left out (the run
        state lists them)."""
        return scan.slice(offset, SUMMARY_CHUNK_ROWS).filter(~is_mark()).select(columns)

    # Chunks' aggregates are combined once they hold about a chunk's rows: each combine groups
    # them all at once, so a history of many chunks and many series is not regrouped per chunk.
    pending: list[pl.DataFrame] = []
    samples: list[pl.DataFrame] = []
    spans = DtypeSpans()
    for offset in range(0, max(total, 1), SUMMARY_CHUNK_ROWS):
        rows = chunk(offset).collect()
        spans.add(rows, pending)  # before this chunk's stats join them
        pending.append(_chunk_stats(rows))
        samples.append(rows.group_by("sample_id").agg(rows=pl.len()))
        del rows  # before the next chunk is read
        if len(pending) > 1 and sum(f.height for f in pending) >= SUMMARY_CHUNK_ROWS:
            pending = [_combine_stats(pending)]
    stats = pending[0] if len(pending) == 1 else _combine_stats(pending)
    del pending
    # A sample may span two chunks: its rows are the sum of its parts'.
    sample_rows = pl.concat(samples).group_by("sample_id").agg(pl.col("rows").sum())
    del samples
    windows = window_summaries(
        scan,
        window,
        samples=sample_rows,
        series=stats.select(SERIES_KEY),
        chunk_rows=SUMMARY_CHUNK_ROWS,
    )
    stats = _extreme_samples(stats).with_columns(pl.col(strings).cast(pl.String))
    return _with_windows(stats, windows), spans.spans()


def _with_windows(stats: pl.DataFrame, windows: pl.DataFrame) -> pl.DataFrame:
    """`stats` with each window's columns as `previous_*` / `recent_*` (empty: actual 0)."""
    for which, name in enumerate(reversed(WINDOW_NAMES)):
        part = windows.filter(pl.col("which") == which).select(
            *SERIES_KEY, *(pl.col(c).alias(f"{name}_{c}") for c in _WINDOW_COLUMNS)
        )
        stats = stats.join(part, on=SERIES_KEY, how="left", nulls_equal=True).with_columns(
            pl.col(f"{name}_actual", f"{name}_valid").fill_null(0)
        )
    return stats


__all__ = ["SUMMARY_CHUNK_ROWS", "WINDOW_NAMES", "series_summary"]
