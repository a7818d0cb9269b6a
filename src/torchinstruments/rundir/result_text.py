"""result.json's text: the series' numbers (`rundir.series_stats`) as JSON, in Polars.

Design decision: result.json's text is assembled in Polars, column by column (a tensor-metric's
JSON, joined per tensor, tensors joined per layer); Python handles one string per layer, so
memory grows with the number of tensor-metrics in columnar frames only. Measured
(bench/removal.py, 1 M rows, 18k series): this took result.json from about 1.0 s of CPU to 0.6 s.

Design decision: result.json is compact. No indentation (one layer per line, so `head` and `grep`
still work), and no field repeated: every metric of a tensor is observed in the same samples (one
measurement writes a row per metric), so the facts about *which samples* (`observations`,
`first_sample_id`, `latest_sample_id`, each window's `actual`, `first_sample_id`,
`last_sample_id`) are written once per tensor, and each metric holds only its values and valid
counts. A metric whose sample facts differ from its tensor's (possible only when history lost
rows, e.g. an unreadable part) carries its own values of those fields, which then win. For a
3,000-layer model this is about a third of the indented file (bench/removal.py).
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl

from torchinstruments.rundir.series_stats import WINDOW_NAMES
from torchinstruments.rundir.shell import json_on_one_line
from torchinstruments.rundir.windows import SERIES_KEY, TENSOR_KEY, finite_or_none


def encode(value: object) -> str:
    """One record (or string) as compact strict JSON (no NaN or Infinity)."""
    text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    return json_on_one_line(text)  # one layer per line, whatever its name holds


# The facts about which samples a series was observed in; equal for every metric of a tensor.
_SAMPLE_FACTS = ("observations", "first_sample_id", "latest_sample_id")
_WINDOW_FACTS = ("actual", "first_sample_id", "last_sample_id")
_FACT_COLUMNS = (*_SAMPLE_FACTS, *(f"{w}_{f}" for w in WINDOW_NAMES for f in _WINDOW_FACTS))


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


def with_tensor_facts(frame: pl.DataFrame) -> pl.DataFrame:
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
    for name in WINDOW_NAMES:
        entry[name] = {"mean": finite_or_none(row[f"{name}_mean"]), "valid": row[f"{name}_valid"]}
        for fact in _WINDOW_FACTS:
            column = f"{name}_{fact}"
            if row[column] != row[f"t_{column}"]:
                entry[name][fact] = row[column]
    return entry


def _text(frame: pl.DataFrame, column: str) -> pl.Expr:
    """A string column's values as JSON text, each distinct value encoded once by `encode`
    (so the escaping is Python's, as everywhere in result.json); null as `null`."""
    values = frame.get_column(column).drop_nulls().unique().to_list()
    encoded = [encode(v) for v in values]
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
        parts += [pl.lit(("{" if i == 0 else ",") + encode(key) + ":"), text]
    return pl.concat_str([*parts, pl.lit("}")])


def _tensor_text(frame: pl.DataFrame) -> pl.Expr:
    """A tensor's entry as JSON text from its row of `layer_texts`' tensor frame: the tensor's
    facts (`t_*`, placement and mesh_coordinate only for a DTensor), then `metrics`."""
    windows = [
        (name, _object_text(*((f, _number_text(f"t_{name}_{f}")) for f in _WINDOW_FACTS)))
        for name in WINDOW_NAMES
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


def layer_texts(frame: pl.DataFrame, dtypes: pl.DataFrame | None) -> dict[str, str]:
    """Per layer, the entries of its `tensors` array as JSON text (`frame`: `with_tensor_facts`,
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
            "_own": [encode(_fallback_metric(r)) for r in fallback.iter_rows(named=True)],
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


__all__ = ["encode", "layer_texts", "with_tensor_facts"]
