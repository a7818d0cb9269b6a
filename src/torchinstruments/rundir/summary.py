"""result.json: the layer catalog at injection, per-tensor summaries at removal.

Design decision: the summary is computed from the merged history.parquet with Polars lazy
queries on the streaming engine, never from state kept during training, so result.json is a pure
function of history.parquet and `finalize` can rebuild it after a crash. The one exception is each
layer's `sampled_forwards` (in how many sampled forwards it was called), which at removal comes
from the observer's `RunCounts`: a call whose output holds no tensor leaves no history row. After
a crash it is rebuilt from history (sampled forwards with an output row), a lower bound; when the
process died before any row reached the disk it is null (unknown), never 0. At injection it is
null too (the catalog, before anything ran).

Design decision: one pass in chunks, then one read of the latest samples, then the text in
Polars. Plain group-by aggregates (counts, first/latest, finite min/max, shape and dtype, each
tensor's dtypes' sample ranges: `rundir.dtype_spans`) are taken per chunk of
`SUMMARY_CHUNK_ROWS` rows and combined, in memory proportional to the number of
tensor-metrics; the earliest sample at the min/max comes from one Int128 key per row
(`_extreme_keys`), so every aggregate is a plain one (no per-group filter). The windows are
`rundir.windows.window_summaries`, the one implementation the command line calls too, handed
the samples and series this pass found (so it reads only the latest samples of an ordinary run,
in ranges of whole samples). Memory stays near `tensor-metrics x 2 * window` rows.
result.json's text is assembled in Polars, column by column (a tensor-metric's JSON, joined per
tensor, tensors joined per layer), and written one layer at a time; Python handles one string
per layer. Memory grows with the number of tensor-metrics in columnar frames only.
Measured (bench/removal.py, 1 M rows, 18k series): this took result.json from about 1.0 s of CPU
to 0.6 s.

Design decision: result.json is compact. No indentation (one layer per line, so `head` and `grep`
still work), and no field repeated: every metric of a tensor is observed in the same samples (one
measurement writes a row per metric), so the facts about *which samples* (`observations`,
`first_sample_id`, `latest_sample_id`, each window's `actual`, `first_sample_id`,
`last_sample_id`) are written once per tensor, and each metric holds only its values and valid
counts. A metric whose sample facts differ from its tensor's (possible only when history lost
rows, e.g. an unreadable part) carries its own values of those fields, which then win. For a
3,000-layer model this is about a third of the indented file (bench/removal.py).

Definitions (also in index.md):

- A tensor entry is one (call_index, signal, tensor_path, mode): a train sample and an eval
  sample of one tensor are never one series, so each mode has its own entry.
- One *observation* is one history row of a tensor-metric; `observations` counts them and `valid`
  counts those with a non-null value.
- `first` / `latest`: the value (possibly null) of the earliest / latest observation in history
  order (sample_id, then write order), at the tensor's `first_sample_id` / `latest_sample_id`.
- `min` / `max`: over finite values; `sample_id` is the earliest sample holding that value.
- Windows are over the tensor-metric's own samples (distinct sample_ids in which it was observed),
  newest first: `recent` holds the latest `window` of them, `previous` the `window` before.
  `actual` = samples in the window (< window early in a run), `first_sample_id` /
  `last_sample_id` = its sample range (both per tensor); per metric, `valid` = non-null values in
  it and `mean` = mean of its finite values (null when there are none). A window mean averages
  per-sample statistics; it is not a statistic of the pooled elements.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.records import LayerInfo
from torchinstruments.rundir.dtype_spans import (
    DtypeChanges,
    DtypeSpans,
    changed_dtypes,
    dtype_changes,
)
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    HISTORY_ROW_GROUP_ROWS,
    RESULT_FILE,
    replace_atomically,
    scan_history,
)
from torchinstruments.rundir.marks import is_mark
from torchinstruments.rundir.shell import tool_command
from torchinstruments.rundir.windows import (
    SERIES_KEY,
    TENSOR_KEY,
    check_window,
    finite_or_none,
    window_summaries,
)

# Rows read at a time by the summary (see `_series_summary`): a fifth of a row group of
# history.parquet (2**17 rows). The chunk's aggregates, not the decoded rows, set removal's peak:
# measured on bench/removal.py (AMD EPYC, 2 cores, one process), chain (1 M rows, 18k series),
# with 2**18-row groups: a whole group per chunk peaks at +254 MiB over the RSS before, half at
# +218 MiB, for 1.01 against 1.12 s of CPU; deep (60 steps, 3.2 M rows, 54k series): +281
# against +225 MiB, 3.03 against 3.47 s. With 655,360-row groups each chunk still decodes its
# whole group (one page per column), about 0.08 s more CPU on the chain than 2**18-row groups.
SUMMARY_CHUNK_ROWS = HISTORY_ROW_GROUP_ROWS // 5


def _encode(value: object) -> str:
    """One record (or string) as compact strict JSON (no NaN or Infinity)."""
    return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def _dump(directory: Path, lines: Iterable[str]) -> None:
    """Write result.json atomically, one layer record (JSON text) per line, as they come."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            separator = "[\n"
            for line in lines:
                f.write(separator + line)
                separator = ",\n"
            f.write("[]\n" if separator == "[\n" else "\n]\n")

    replace_atomically(directory / RESULT_FILE, write)


def write_catalog(directory: Path, layers: Sequence[LayerInfo]) -> None:
    """Write result.json as the catalog of selected layers, each with no tensors yet.

    Args:
        directory: the run's output directory.
        layers: the selected layers in traversal order.
    """
    _dump(
        directory,
        (
            _encode(
                {
                    "layer": li.name,
                    "module_type": li.module_type,
                    "sampled_forwards": None,
                    "tensors": [],
                }
            )
            for li in layers
        ),
    )


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


def _series_summary(history: Path, window: int) -> tuple[pl.DataFrame, pl.DataFrame | None]:
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


# --- result.json --------------------------------------------------------------------------------

# The facts about which samples a series was observed in; equal for every metric of a tensor.
_SAMPLE_FACTS = ("observations", "first_sample_id", "latest_sample_id")
_WINDOW_FACTS = ("actual", "first_sample_id", "last_sample_id")
_WINDOW_NAMES = ("previous", "recent")  # `which` 1 and 0 of `window_summaries`
_WINDOW_COLUMNS = ("actual", "valid", "mean", "first_sample_id", "last_sample_id")
_FACT_COLUMNS = (*_SAMPLE_FACTS, *(f"{w}_{f}" for w in _WINDOW_NAMES for f in _WINDOW_FACTS))


def _with_windows(stats: pl.DataFrame, windows: pl.DataFrame) -> pl.DataFrame:
    """`stats` with each window's columns as `previous_*` / `recent_*` (empty: actual 0)."""
    for which, name in enumerate(reversed(_WINDOW_NAMES)):
        part = windows.filter(pl.col("which") == which).select(
            *SERIES_KEY, *(pl.col(c).alias(f"{name}_{c}") for c in _WINDOW_COLUMNS)
        )
        stats = stats.join(part, on=SERIES_KEY, how="left", nulls_equal=True).with_columns(
            pl.col(f"{name}_actual", f"{name}_valid").fill_null(0)
        )
    return stats


def _finite_column(name: str) -> pl.Expr:
    """The column with non-finite values as null (keeps result.json strict JSON)."""
    return pl.when(pl.col(name).is_finite()).then(pl.col(name))


def _metric_json() -> pl.Expr:
    """One metric's entry as JSON text, for a series whose sample facts are its tensor's."""

    def at(value: str, sample: str) -> pl.Expr:
        kept = _finite_column(value)
        return pl.struct(value=kept, sample_id=pl.when(kept.is_not_null()).then(pl.col(sample)))

    return pl.struct(
        valid=pl.col("valid"),
        first=_finite_column("first_value"),
        latest=_finite_column("latest_value"),
        min=at("min_value", "min_sample_id"),
        max=at("max_value", "max_sample_id"),
        previous=pl.struct(mean=_finite_column("previous_mean"), valid=pl.col("previous_valid")),
        recent=pl.struct(mean=_finite_column("recent_mean"), valid=pl.col("recent_valid")),
    ).struct.json_encode()


def _with_tensor_facts(frame: pl.DataFrame) -> pl.DataFrame:
    """Adds `t_*`: the sample facts of each series' tensor (those of its most observed metric,
    the first on ties: all agree in a run that lost no rows), `differs`, and `metric_json`
    (null where the series' facts differ from its tensor's; those are written in Python)."""
    frame = frame.sort(SERIES_KEY)
    most = pl.col("observations") == pl.col("observations").max()
    facts = frame.group_by(TENSOR_KEY, maintain_order=True).agg(
        pl.col(*_FACT_COLUMNS, "shape", "dtype", "placement", "mesh_coordinate")
        .filter(most)
        .first()
        .name.prefix("t_")
    )
    frame = frame.join(facts, on=TENSOR_KEY, how="left", nulls_equal=True)
    differs = pl.any_horizontal(pl.col(c).ne_missing(pl.col(f"t_{c}")) for c in _FACT_COLUMNS)
    return frame.with_columns(differs=differs).with_columns(
        metric_json=pl.when(~pl.col("differs")).then(_metric_json())
    )


def _fallback_metric(row: dict[str, Any]) -> dict[str, Any]:
    """A metric entry with its own sample facts (where they differ from its tensor's)."""
    entry: dict[str, Any] = {k: row[k] for k in _SAMPLE_FACTS if row[k] != row[f"t_{k}"]}

    def at(value_key: str, sample_key: str) -> dict[str, Any]:
        value = finite_or_none(row[value_key])
        return {"value": value, "sample_id": row[sample_key] if value is not None else None}

    entry["valid"] = row["valid"]
    entry["first"] = finite_or_none(row["first_value"])
    entry["latest"] = finite_or_none(row["latest_value"])
    entry["min"] = at("min_value", "min_sample_id")
    entry["max"] = at("max_value", "max_sample_id")
    for name in _WINDOW_NAMES:
        entry[name] = {"mean": finite_or_none(row[f"{name}_mean"]), "valid": row[f"{name}_valid"]}
        for fact in _WINDOW_FACTS:
            column = f"{name}_{fact}"
            if row[column] != row[f"t_{column}"]:
                entry[name][fact] = row[column]
    return entry


def _text(frame: pl.DataFrame, column: str) -> pl.Expr:
    """A string column's values as JSON text, each distinct value encoded once by `_encode`
    (so the escaping is Python's, as everywhere in result.json); null as `null`."""
    values = frame.get_column(column).drop_nulls().unique().to_list()
    encoded = [_encode(v) for v in values]
    return pl.col(column).replace_strict(values, encoded, return_dtype=pl.String).fill_null("null")


def _number_text(column: str) -> pl.Expr:
    """An integer column as JSON text (null as `null`)."""
    return pl.col(column).cast(pl.String).fill_null("null")


def _list_text(column: str) -> pl.Expr:
    """An integer list column as JSON text (`[1,2]`; null as `null`)."""
    joined = pl.col(column).cast(pl.List(pl.String)).list.join(",")
    return pl.when(pl.col(column).is_not_null()).then("[" + joined + "]").otherwise(pl.lit("null"))


def _object_text(*fields: tuple[str, pl.Expr]) -> pl.Expr:
    """A JSON object from (key, JSON text) pairs, in that order."""
    parts: list[pl.Expr] = []
    for i, (key, text) in enumerate(fields):
        parts += [pl.lit(("{" if i == 0 else ",") + _encode(key) + ":"), text]
    return pl.concat_str([*parts, pl.lit("}")])


def _tensor_text(frame: pl.DataFrame) -> pl.Expr:
    """A tensor's entry as JSON text from its row of `_layer_texts`' tensor frame: the tensor's
    facts (`t_*`, placement and mesh_coordinate only for a DTensor), then `metrics`."""
    windows = [
        (name, _object_text(*((f, _number_text(f"t_{name}_{f}")) for f in _WINDOW_FACTS)))
        for name in _WINDOW_NAMES
    ]
    head = _object_text(
        ("call_index", _number_text("call_index")),
        ("signal", _text(frame, "signal")),
        ("tensor_path", _text(frame, "tensor_path")),
        ("mode", _text(frame, "mode")),
        ("shape", _list_text("t_shape")),
        ("dtype", _text(frame, "t_dtype")),
    )
    placement = pl.concat_str(
        pl.lit(',"placement":'),
        _text(frame, "t_placement"),
        pl.lit(',"mesh_coordinate":'),
        _list_text("t_mesh_coordinate"),
    )
    rest = _object_text(
        *((fact, _number_text(f"t_{fact}")) for fact in _SAMPLE_FACTS),
        *windows,
        ("metrics", "{" + pl.col("metrics") + "}"),
    )
    dtypes = pl.when(pl.col("dtypes").is_not_null()).then(',"dtypes":' + pl.col("dtypes"))
    return pl.concat_str(
        head.str.head(-1),
        dtypes.otherwise(pl.lit("")),
        pl.when(pl.col("t_placement").is_not_null()).then(placement).otherwise(pl.lit("")),
        "," + rest.str.tail(-1),
    )


def _layer_texts(frame: pl.DataFrame, dtypes: pl.DataFrame | None) -> dict[str, str]:
    """Per layer, the entries of its `tensors` array as JSON text (`frame`: `_with_tensor_facts`,
    sorted by layer order, tensor key and metric; `dtypes`: `changed_dtypes`).

    Assembled in Polars, column by column: the metrics' JSON (`metric_json`, or
    `_fallback_metric` in Python for the rare series whose sample facts differ from their
    tensor's), joined per tensor, each tensor's head, joined per layer. Python then handles one
    string per layer, not one row per tensor-metric.
    """
    fallback = frame.with_row_index("_row").filter(pl.col("differs"))
    own = pl.DataFrame(
        {
            "_row": fallback.get_column("_row"),
            "_own": [_encode(_fallback_metric(r)) for r in fallback.iter_rows(named=True)],
        },
        schema={"_row": pl.UInt32, "_own": pl.String},
    )
    metric = pl.concat_str(_text(frame, "metric"), pl.lit(":"), pl.coalesce("metric_json", "_own"))
    heads = (
        "t_shape",
        "t_dtype",
        "t_placement",
        "t_mesh_coordinate",
        *(f"t_{c}" for c in _FACT_COLUMNS),
    )
    tensors = (
        frame.with_row_index("_row")
        .join(own, on="_row", how="left")
        .with_columns(metric=metric)
        .group_by("_order", *TENSOR_KEY, maintain_order=True)
        .agg(pl.col(*heads).first(), metrics=pl.col("metric").str.join(","))
    )
    if dtypes is None:
        tensors = tensors.with_columns(dtypes=pl.lit(None, pl.String))
    else:
        tensors = tensors.join(
            dtypes, on=TENSOR_KEY, how="left", nulls_equal=True, maintain_order="left"
        )
    layers = (
        tensors.with_columns(tensor=_tensor_text(tensors))
        .group_by("layer", maintain_order=True)
        .agg(pl.col("tensor").str.join(","))
    )
    return dict(layers.iter_rows())


def layer_lines(
    history: Path,
    layers: Sequence[LayerInfo],
    window: int,
    layer_samples: Mapping[str, int] | None = None,
    *,
    samples_unknown: bool = False,
) -> tuple[Iterator[str], DtypeChanges]:
    """The records of result.json computed from a history.parquet, as JSON text, one layer at a
    time, and the layers whose dtype changed during the run (for index.md).

    Every layer of `layers` is listed in that order (executed or not); layers present in history
    but not in `layers` follow, sorted by name, so no data is hidden.

    Args:
        history: path of history.parquet.
        layers: the selected layers in traversal order.
        window: samples per window.
        layer_samples: sampled forwards in which each layer was called (`RunCounts`); a layer
            not in it gets 0. None counts, from history, the sampled forwards with an output row.
        samples_unknown: every layer's `sampled_forwards` is null: unknown (the process died
            before any row reached the disk), never 0.

    Returns:
        One compact JSON object per layer, as they are iterated; the `DtypeChanges`.
    """
    check_window(window)
    stats, spans = _series_summary(history, window)
    samples = layer_samples if layer_samples is not None else _output_samples(history)
    module_types = {li.name: li.module_type for li in layers}
    names = list(dict.fromkeys(li.name for li in layers))
    seen = stats.group_by("layer").agg(pl.col("module_type").last())
    for name, module_type in seen.iter_rows():  # the class when measured (a lazy module's)
        module_types[name] = module_type
    names += sorted(set(module_types) - set(names))
    order = pl.DataFrame(
        {"layer": names, "_order": range(len(names)), "module_type": map(module_types.get, names)},
        schema={"layer": pl.String, "_order": pl.Int64, "module_type": pl.String},
    )
    frame = (
        _with_tensor_facts(stats)
        .join(order.drop("module_type"), on="layer", how="left")
        .sort(
            *("_order", "call_index", "signal", "tensor_path", "mode", "metric"),
            descending=[False, False, False, False, True, False],  # train before eval
        )
    )
    del stats
    texts = _layer_texts(frame, changed_dtypes(spans))
    del frame

    def lines() -> Iterator[str]:
        for name in names:
            head = {
                "layer": name,
                "module_type": module_types[name],
                "sampled_forwards": None if samples_unknown else int(samples.get(name, 0)),
            }
            yield _encode(head)[:-1] + ',"tensors":[' + texts.pop(name, "") + "]}"

    return lines(), dtype_changes(spans, order)


def summarize(
    history: Path,
    layers: Sequence[LayerInfo],
    window: int,
    layer_samples: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """The whole result.json payload as Python objects (see `layer_lines`, which streams it)."""
    lines, _ = layer_lines(history, layers, window, layer_samples)
    return [json.loads(line) for line in lines]


def _output_samples(history: Path) -> dict[str, int]:
    """Per layer, the distinct sample_ids with an output row."""
    frame = (
        scan_history(history)
        .filter(pl.col("signal") == "output", ~is_mark())
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
    *,
    samples_unknown: bool = False,
) -> DtypeChanges:
    """Write result.json with per-tensor summaries computed from `directory/history.parquet`;
    return the layers whose dtype changed during the run (index.md names them).

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
            f"`{tool_command('finalize', directory)}` to "
            "merge history.parts/ first"
        )
    lines, changes = layer_lines(
        history, layers, window, layer_samples, samples_unknown=samples_unknown
    )
    _dump(directory, lines)
    return changes


__all__ = ["layer_lines", "summarize", "write_catalog", "write_result"]
