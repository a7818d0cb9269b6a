"""result.json: the layer catalog at injection, per-tensor summaries at removal.

Design decision: the summary is computed from the merged history.parquet with Polars lazy
queries on the streaming engine, never from state kept during training, so result.json is a pure
function of history.parquet and `finalize` can rebuild it after a crash. The one exception is each
layer's `sampled_forwards` (in how many sampled forwards it was called), which at removal comes
from the observer's `RunCounts`: a call whose output holds no tensor leaves no history row. After
a crash it is rebuilt from history (sampled forwards with an output row), a lower bound. Plain group-by
aggregates (counts, first/latest, finite min/max) stream in memory proportional to the number of
tensor-metrics. The windows need each tensor-metric's last `2 * window` samples; they are found by
scanning the tail of the sample range and widening it (x4) only for the tensor-metrics that did not
yet have enough samples, so memory stays near `tensor-metrics x 2 * window` rows. The cost is one
extra pass over the tail per widening, plus one list of all sample ids (one int per sample).

Definitions (also in index.md):

- One *observation* is one history row of a tensor-metric; `observations` counts them and `valid`
  counts those with a non-null value.
- `first` / `latest`: the value (possibly null) and sample_id of the earliest / latest
  observation in history order (sample_id, then write order).
- `min` / `max`: over finite values; `sample_id` is the earliest sample holding that value.
- Windows are over the tensor-metric's own samples (distinct sample_ids in which it was observed),
  newest first: `recent` holds the latest `window` of them, `previous` the `window` before.
  `actual` = samples in the window (< window early in a run), `valid` = non-null values in it,
  `mean` = mean of its finite values (null when there are none), `first_sample_id` /
  `last_sample_id` = its sample range. A window mean averages per-sample statistics; it is not a
  statistic of the pooled elements.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.records import LayerInfo
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    HISTORY_SCHEMA,
    RESULT_FILE,
    scan_history,
    write_text_atomic,
)
from torchinstruments.rundir.marks import is_mark
from torchinstruments.rundir.shell import command_line

# One tensor of one layer call, and one of its metrics: the keys of result.json and the CLI.
TENSOR_KEY = ("layer", "call_index", "signal", "tensor_path")
SERIES_KEY = (*TENSOR_KEY, "metric")

_WIDEN = 4


def _finite(value: float | None) -> float | None:
    """The value if it is a finite float, else None (keeps result.json strict JSON)."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _dump(directory: Path, payload: list[dict[str, Any]]) -> None:
    """Write result.json atomically as strict UTF-8 JSON."""
    text = json.dumps(payload, allow_nan=False, ensure_ascii=False, indent=1) + "\n"
    write_text_atomic(directory / RESULT_FILE, text)


def write_catalog(directory: Path, layers: Sequence[LayerInfo]) -> None:
    """Write result.json as the catalog of selected layers, each with no tensors yet.

    Args:
        directory: the run's output directory.
        layers: the selected layers in traversal order.
    """
    _dump(
        directory,
        [
            {
                "layer": li.name,
                "module_type": li.module_type,
                "sampled_forwards": None,
                "tensors": [],
            }
            for li in layers
        ],
    )


def _series_stats(lf: pl.LazyFrame) -> pl.DataFrame:
    """Counts, first/latest and finite min/max (with their earliest sample_id) per series."""
    value = pl.col("value")
    finite = value.filter(value.is_finite())
    # Collected before the join: with `base` left lazy, the self-join's peak memory grew with the
    # history (measured +0.9 GB at 10 M rows, bench/history.py); collected, it stays small.
    base = (
        lf.group_by(SERIES_KEY)
        .agg(
            observations=pl.len(),
            valid=value.count(),
            first_value=value.first(),
            first_sample_id=pl.col("sample_id").first(),
            latest_value=value.last(),
            latest_sample_id=pl.col("sample_id").last(),
            min_value=finite.min(),
            max_value=finite.max(),
        )
        .collect(engine="streaming")
    )
    extremes = (
        lf.join(base.lazy().select(*SERIES_KEY, "min_value", "max_value"), on=SERIES_KEY)
        .filter((value == pl.col("min_value")) | (value == pl.col("max_value")))
        .group_by(SERIES_KEY)
        .agg(
            min_sample_id=pl.col("sample_id").filter(value == pl.col("min_value")).min(),
            max_sample_id=pl.col("sample_id").filter(value == pl.col("max_value")).min(),
        )
        .collect(engine="streaming")
    )
    return base.join(extremes, on=SERIES_KEY, how="left", nulls_equal=True).sort(SERIES_KEY)


def _tensor_latest(lf: pl.LazyFrame) -> pl.DataFrame:
    """module_type, shape, dtype and placement of the latest observation of each tensor."""
    return (
        lf.group_by(TENSOR_KEY)
        .agg(
            module_type=pl.col("module_type").last(),
            shape=pl.col("shape").last(),
            dtype=pl.col("dtype").last(),
            placement=pl.col("placement").last(),
            mesh_coordinate=pl.col("mesh_coordinate").last(),
        )
        .collect(engine="streaming")
    )


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
    return _finite(mean)


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


def _window_entry(row: dict[str, Any] | None) -> dict[str, Any]:
    """One window as it appears in result.json."""
    if row is None:
        return {
            "mean": None,
            "actual": 0,
            "valid": 0,
            "first_sample_id": None,
            "last_sample_id": None,
        }
    return {
        "mean": row["mean"],
        "actual": row["actual"],
        "valid": row["valid"],
        "first_sample_id": row["first_sample_id"],
        "last_sample_id": row["last_sample_id"],
    }


def _metric_entry(row: dict[str, Any], windows: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One metric of one tensor as it appears in result.json."""

    def at(value_key: str, sample_key: str) -> dict[str, Any]:
        value = _finite(row[value_key])
        return {"value": value, "sample_id": row[sample_key] if value is not None else None}

    first = {"value": _finite(row["first_value"]), "sample_id": row["first_sample_id"]}
    latest = {"value": _finite(row["latest_value"]), "sample_id": row["latest_sample_id"]}
    return {
        "observations": row["observations"],
        "valid": row["valid"],
        "first": first,
        "latest": latest,
        "min": at("min_value", "min_sample_id"),
        "max": at("max_value", "max_sample_id"),
        "previous": _window_entry(windows.get(1)),
        "recent": _window_entry(windows.get(0)),
    }


def summarize(
    history: Path,
    layers: Sequence[LayerInfo],
    window: int,
    layer_samples: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """The result.json payload computed from a history.parquet.

    Every layer of `layers` is listed in that order (executed or not); layers present in history
    but not in `layers` follow, sorted by name, so no data is hidden.

    Args:
        history: path of history.parquet.
        layers: the selected layers in traversal order.
        window: samples per window.
        layer_samples: sampled forwards in which each layer was called (`RunCounts`); a layer
            not in it gets 0. None counts, from history, the sampled forwards with an output row.

    Returns:
        A JSON-ready list of layer records.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} is not allowed: expected an int >= 1")
    lf = scan_history(history).filter(~is_mark())  # marks are listed by the run state
    stats = _series_stats(lf)
    latest = {tuple(r[k] for k in TENSOR_KEY): r for r in _tensor_latest(lf).iter_rows(named=True)}
    windows: dict[tuple, dict[int, dict[str, Any]]] = {}
    for r in window_summaries(lf, window).iter_rows(named=True):
        windows.setdefault(tuple(r[k] for k in SERIES_KEY), {})[r["which"]] = r
    tensors: dict[str, dict[tuple, dict[str, Any]]] = {}
    for row in stats.iter_rows(named=True):
        tkey = tuple(row[k] for k in TENSOR_KEY)
        per_layer = tensors.setdefault(row["layer"], {})
        if tkey not in per_layer:
            info = latest[tkey]
            per_layer[tkey] = {
                "call_index": row["call_index"],
                "signal": row["signal"],
                "tensor_path": row["tensor_path"],
                "shape": list(info["shape"]) if info["shape"] is not None else None,
                "dtype": info["dtype"],
                "metrics": {},
            }
            if info["placement"] is not None:  # a DTensor: what the values describe
                coordinate = info["mesh_coordinate"]
                per_layer[tkey]["placement"] = info["placement"]
                per_layer[tkey]["mesh_coordinate"] = (
                    None if coordinate is None else list(coordinate)
                )
        skey = tuple(row[k] for k in SERIES_KEY)
        per_layer[tkey]["metrics"][row["metric"]] = _metric_entry(row, windows.get(skey, {}))
    module_types = {li.name: li.module_type for li in layers}
    for tkey, info in latest.items():
        module_types.setdefault(tkey[0], info["module_type"])
    names = [li.name for li in layers]
    names += sorted(set(tensors) - set(names))
    samples = layer_samples if layer_samples is not None else _output_samples(lf)
    out = []
    for name in dict.fromkeys(names):
        entries = tensors.get(name, {})
        ordered = [entries[k] for k in sorted(entries, key=lambda k: (k[1], k[2], k[3]))]
        out.append(
            {
                "layer": name,
                "module_type": module_types[name],
                "sampled_forwards": int(samples.get(name, 0)),
                "tensors": ordered,
            }
        )
    return out


def _output_samples(lf: pl.LazyFrame) -> dict[str, int]:
    """Per layer, the distinct sample_ids with an output row."""
    frame = (
        lf.filter(pl.col("signal") == "output")
        .group_by("layer")
        .agg(samples=pl.col("sample_id").n_unique())
        .collect(engine="streaming")
    )
    return {r["layer"]: int(r["samples"]) for r in frame.iter_rows(named=True)}


def write_result(
    directory: Path,
    layers: Sequence[LayerInfo],
    window: int,
    layer_samples: Mapping[str, int] | None = None,
) -> None:
    """Write result.json with per-tensor summaries computed from `directory/history.parquet`.

    Args:
        directory: the run's output directory (history.parquet must already be merged).
        layers: the selected layers in traversal order.
        window: samples in each of the `previous` and `recent` windows.
        layer_samples: per layer, the sampled forwards in which it was called (see `summarize`).

    Raises:
        FileNotFoundError: if history.parquet does not exist (run `torchinstruments finalize`).
    """
    history = directory / HISTORY_FILE
    if not history.exists():
        raise FileNotFoundError(
            f"{history} does not exist, so result.json cannot be summarised; run "
            f"`{command_line('python', '-m', 'torchinstruments', 'finalize', directory)}` to "
            "merge history.parts/ first"
        )
    _dump(directory, summarize(history, layers, window, layer_samples))


__all__ = [
    "SERIES_KEY",
    "TENSOR_KEY",
    "summarize",
    "window_mean",
    "window_summaries",
    "write_catalog",
    "write_result",
]
