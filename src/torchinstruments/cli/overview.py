"""`show`'s text view of a big model: per metric, one row per module type and signal.

Design decision: one row per tensor stops being readable long before 3,000 layers (9 metrics x
3,000 rows is 27,000 lines). Beyond OVERVIEW_TENSORS tensors, `show` prints per metric a table
with one row per (module type, signal): how many tensors it holds, how many of their latest
values are null, how many series stopped before the run's latest sample (missing rows are
evidence: a branch cut off from the loss shows as gradient series that stop), and the smallest,
median and largest of the tensors' latest values. The numbers are spreads of measured values
only; which tensor holds them is one `--layers REGEX`, `--all` or `--format csv` away.
"""

from __future__ import annotations

import textwrap

import polars as pl

from torchinstruments.cli.reader import RunFacts, metric_order
from torchinstruments.cli.text import number, table
from torchinstruments.records import OUTPUT, OUTPUT_GRADIENT, SIGNALS
from torchinstruments.rundir.shell import literal_if_unclear

OVERVIEW_TENSORS = 60
_SHORT = {OUTPUT: "out", OUTPUT_GRADIENT: "grad"}


def tensor_count(frame: pl.DataFrame) -> int:
    """Distinct tensors (layer, call, tensor path) in `show`'s summary frame: rows per metric."""
    if frame.is_empty():
        return 0
    return frame.select(pl.struct("layer", "call_index", "tensor_path").n_unique()).item()


def group_rows(frame: pl.DataFrame, latest_all: int) -> pl.DataFrame:
    """Per metric, module type, signal and mode: tensors, nulls, stopped series (older than
    the latest sample of their mode; `latest_all` when all are train), min/median/max.

    Train and eval series are separate rows: an eval series is never summarized with train ones.
    """
    latest = pl.col("latest_value")
    own_latest = pl.col("latest_sample_id").max().over("mode")
    if set(frame["mode"].unique().to_list()) <= {"train"}:
        own_latest = pl.lit(latest_all)
    return (
        frame.with_columns(_latest=own_latest)
        .group_by("metric", "module_type", "signal", "mode", maintain_order=True)
        .agg(
            tensors=pl.len(),
            null=latest.is_null().sum(),
            stopped=(pl.col("latest_sample_id") < pl.col("_latest")).sum(),
            low=latest.filter(latest.is_finite()).min(),
            median=latest.filter(latest.is_finite()).median(),
            high=latest.filter(latest.is_finite()).max(),
        )
    )


def type_table(
    headers: list[str], rows: list[list[str]], numeric: list[bool], width: int
) -> list[str]:
    """A grouped table whose first column is the module type: a type too long for its column
    goes whole on a line of its own above its rows, never cut (`LayerNorm`, `GroupNorm` and
    `RMSNorm` cut to their ends would all read `...orm`), and the signal column is never cut
    either (`out [eval]`)."""
    whole = [False, True] + [False] * (len(headers) - 2)
    return table(headers, rows, numeric=numeric, width=width, whole=whole, wrap_first=True)


def overview_tables(frame: pl.DataFrame, facts: RunFacts, width: int) -> list[str]:
    """The grouped text view: one table per metric, rows = (module type, signal)."""
    latest_all = frame.select(pl.col("latest_sample_id").max()).item()
    groups = group_rows(frame, latest_all)
    types = list(dict.fromkeys(frame["module_type"].to_list()))  # traversal order of first use
    headers = ["type", "signal", "tensors", "null", "stopped", "min", "median", "max"]
    numeric = [False, False, True, True, True, True, True, True]
    layers = frame["layer"].n_unique()
    intro = (
        f"{tensor_count(frame)} tensors of {layers} layers: one row per module type and signal "
        "(--all: one row per tensor)."
    )
    out = ["", *textwrap.wrap(intro, width)]
    for metric in metric_order(frame["metric"].unique().to_list(), facts.run):
        part = groups.filter(pl.col("metric") == metric)
        by_key = {(r["module_type"], r["signal"], r["mode"]): r for r in part.iter_rows(named=True)}
        rows = []
        for module_type in types:
            named = False  # a type is named on its first row only (wrapped whole, never cut)
            for signal, mode in ((s, m) for s in SIGNALS for m in ("train", "eval")):
                r = by_key.get((module_type, signal, mode))
                if r is None:
                    continue
                rows.append(
                    [
                        "" if named else literal_if_unclear(module_type),
                        _SHORT[signal] + ("" if mode == "train" else f" [{mode}]"),
                        str(r["tensors"]),
                        str(r["null"]),
                        str(r["stopped"]),
                        number(r["low"]),
                        number(r["median"]),
                        number(r["high"]),
                    ]
                )
                named = True
        out += ["", f"{metric}:", *type_table(headers, rows, numeric, width)]
    note = (
        "min / median / max: over the tensors of a row, of each tensor's latest value (finite "
        "values only; '-': none). null: tensors whose latest value is null (the reason is in "
        f"history). stopped: tensors whose latest sample is older than sample_id {latest_all} "
        "(their series stopped: a layer that no longer runs, or a gradient that no longer "
        "arrives; an [eval] row: older than the latest eval sample). [eval]: samples taken in "
        "eval mode, never summarized with train ones. Every tensor: --all, --layers REGEX, or "
        "--format csv."
    )
    return [*out, "", *textwrap.wrap(note, width)]


__all__ = ["OVERVIEW_TENSORS", "group_rows", "overview_tables", "tensor_count", "type_table"]
