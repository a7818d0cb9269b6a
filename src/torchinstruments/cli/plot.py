"""`torchinstruments plot DIR`: PNG small multiples of metric trends, output and output_gradient.

Design decisions (the figure's own are `pictures`'):

- The x axis is `sample_id`, `forward_index` or `step` (the trainer's global step, or
  set_step's value; samples without one are left out).
- Without `--metrics`, DEFAULT_METRICS are drawn (8 panels: a figure that reads on a laptop
  screen, not 18 panels 2,160 px tall), on one run and on a parent of rank runs alike
  (`pictures.default_metrics`, which both call); `PlotResult.metrics_left_out` names the others, and the
  command says so on stderr (`pictures.metrics_left_out_line`).
- At most `max_tensors` tensors (traversal order) are drawn; a message on stderr says how many
  were left out and how to choose (`--layers REGEX`). They are chosen from the selection's
  names alone (`plot_catalog`, read a range of samples at a time like `cli.chunked`), and only
  their values are read (`plot_rows`): a 3,000-layer run of 100 samples (5.4 M rows) drawn with
  10 tensors peaked at 1.2 GB of RSS reading every row's value, now about 0.37 GB, with the
  same PNG, byte for byte.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import polars as pl

from torchinstruments.cli.chunked import distinct, in_range, x_counts, x_ranges
from torchinstruments.cli.pictures import (
    DEFAULT_MAX_TENSORS,
    DEFAULT_METRICS,
    NO_STEP,
    X_LABELS,
    PlotResult,
    TensorKey,
    default_metrics,
    tensor_order,
    trend_figure,
    write_trends,
)
from torchinstruments.cli.reader import (
    TENSOR_KEY,
    RunFiles,
    read_facts,
    read_history,
    read_with,
    scan_files,
)
from torchinstruments.cli.selection import Selection
from torchinstruments.rundir.shell import literal_if_unclear

_NAMES = (*TENSOR_KEY, "module_type", "metric")


def _chosen(selection: Selection, x: str) -> Callable[[pl.LazyFrame], pl.LazyFrame]:
    """The selection's rows that have an x (step: samples without one are left out)."""
    if x not in X_LABELS:
        raise ValueError(f"x must be one of {tuple(X_LABELS)}, got {x!r}")
    return lambda lf: selection.rows(lf).filter(pl.col(x).is_not_null())


def plot_catalog(directory: Path, selection: Selection, x: str) -> tuple[pl.DataFrame, pl.Series]:
    """What the selection holds, without its values: one row per tensor key, module type and
    metric, and every x (the drawing chooses its tensors, panels and labels from these), from
    one read of each range of samples (`chunked.distinct`: a range whose samples hold the same
    names hashes its first sample's only)."""
    chosen = _chosen(selection, x)

    def read(files: RunFiles) -> tuple[pl.DataFrame, pl.Series]:
        lf = scan_files(files, write_order=False)
        counts = x_counts(lf, "sample_id")
        catalog = chosen(lf.clear()).select(*_NAMES).collect()
        last = catalog
        xs = []
        # In ranges of whole samples (`cli.chunked`): one range's names at a time, never the
        # names of millions of rows together; its x from the same read.
        for bounds in x_ranges([counts], "sample_id"):
            rows = chosen(in_range(lf, "sample_id", bounds)).select(_read_columns(x))
            rows = rows.collect()
            xs.append(rows.get_column(x).unique())
            names = distinct(rows, _NAMES)
            if not names.equals(last):  # the range before's names (every range's, usually)
                catalog = pl.concat([catalog, names]).unique()
                last = names
        found = pl.concat(xs).unique() if xs else chosen(lf.clear()).select(x).collect()[x]
        return catalog, found

    return read_with(directory, read)


def _read_columns(x: str) -> list[str]:
    """The names, sample_id (for `chunked.distinct`) and x (once, where x is sample_id)."""
    return list(dict.fromkeys((*_NAMES, "sample_id", x)))


def plot_rows(
    directory: Path,
    selection: Selection,
    x: str,
    tensors: Sequence[TensorKey] | None = None,
    metrics: Sequence[str] | None = None,
) -> pl.DataFrame:
    """The rows to draw: tensor key, module type, metric, x and value, in sample then write
    order; of `tensors` and `metrics` only when given (None: all the selection's).

    Sample order, not x order: over `step`, a fit resumed behind the last step an earlier
    attempt recorded has two attempts' samples at those steps, and an x order would join them
    into one line that zigzags between the attempts; in sample order each attempt's stretch
    is a line of its own (`pictures.trend_figure` breaks it where x steps back)."""
    chosen = _chosen(selection, x)

    def query(lf: pl.LazyFrame) -> pl.LazyFrame:
        lf = chosen(lf)
        if tensors is not None:  # a filter the scan takes, then the exact tensors
            lf = lf.filter(pl.col("layer").is_in([t[0] for t in tensors]))
        if metrics is not None:
            lf = lf.filter(pl.col("metric").is_in(list(metrics)))
        order = () if x == "sample_id" else ("sample_id",)
        return lf.select(*TENSOR_KEY, "module_type", "metric", x, "value", *order)

    rows = read_history(directory, query, write_order=False).sort("sample_id", maintain_order=True)
    if tensors is None:
        return rows
    keys = pl.DataFrame(
        list(tensors),
        schema={
            "layer": pl.String,
            "call_index": pl.Int32,
            "tensor_path": pl.String,
            "mode": pl.String,
        },
        orient="row",
    )
    on = ["layer", "call_index", "tensor_path", "mode"]
    return rows.join(keys, on=on, how="semi", nulls_equal=True, maintain_order="left")


def plot(
    directory: Path,
    output: Path,
    selection: Selection,
    *,
    x: str = "sample_id",
    max_tensors: int = DEFAULT_MAX_TENSORS,
    yscale: str = "linear",
) -> PlotResult:
    """Draw the selected trends of a run into a PNG.

    Args:
        directory: a finished, live or crashed run.
        output: the PNG to write (its directory must exist).
        selection: layers (regex), signals and metrics to draw.
        x: "sample_id", "forward_index" or "step" (samples without a step are left out).
        max_tensors: the most tensors (lines per panel) to draw, >= 1.
        yscale: "linear", "log" or "symlog" (see the module docstring).

    Returns:
        A `PlotResult` describing the image.

    Raises:
        MatplotlibMissingError: if matplotlib is not installed.
        ValueError: if nothing matches the selection, or an argument is out of range.
    """
    if max_tensors < 1:
        raise ValueError(f"max_tensors must be an int >= 1, got {max_tensors!r}")
    facts = read_facts(directory)
    # What to draw is chosen from the catalog, and only the drawn tensors' values are read: a
    # 3,000-layer run's plot of 10 tensors reads 10 tensors' rows, not 5.4 M.
    catalog, xs = plot_catalog(directory, selection, x)
    catalog, left_out = default_metrics(catalog, facts, selection.metrics)
    if catalog.is_empty() and x == "step":
        raise ValueError(NO_STEP.format(directory=literal_if_unclear(str(directory))))
    if catalog.is_empty():
        raise ValueError(
            f"no history rows in {literal_if_unclear(str(directory))} match the selection"
        )
    drawn = tensor_order(catalog, facts)[:max_tensors]
    metrics = catalog["metric"].unique().to_list()
    rows = plot_rows(directory, selection, x, drawn, metrics)
    figure, result = trend_figure(rows, facts, x, max_tensors, yscale, catalog=catalog, xs=xs)
    result = write_trends(figure, result, output)
    return dataclasses.replace(result, metrics_left_out=left_out)


__all__ = ["DEFAULT_METRICS", "plot", "plot_catalog", "plot_rows"]
