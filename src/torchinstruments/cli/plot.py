"""`torchinstruments plot DIR`: PNG small multiples of metric trends, output and output_gradient.

Design decisions (the figure's own are `pictures`'):

- The x axis is `sample_id`, `forward_index` or `step` (the trainer's global step, or
  set_step's value; samples without one are left out).
- Without `--metrics`, DEFAULT_METRICS are drawn (8 panels: a figure that reads on a laptop
  screen, not 18 panels 2,160 px tall), on one run and on a parent of rank runs alike
  (`pictures.default_metrics`, which both call); `PlotResult.metrics_left_out` names the others, and the
  command says so on stderr (`pictures.metrics_left_out_line`).
- At most `max_tensors` tensors (traversal order) are drawn; a message on stderr says how many
  were left out and how to choose (`--layers REGEX`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import polars as pl

from torchinstruments.cli.pictures import (
    DEFAULT_MAX_TENSORS,
    DEFAULT_METRICS,
    NO_STEP,
    X_LABELS,
    PlotResult,
    default_metrics,
    trend_figure,
    write_trends,
)
from torchinstruments.cli.reader import (
    TENSOR_KEY,
    read_facts,
    read_history,
)
from torchinstruments.cli.selection import Selection


def plot_rows(directory: Path, selection: Selection, x: str) -> pl.DataFrame:
    """The rows to draw: tensor key, metric, x and value, in write order."""
    if x not in X_LABELS:
        raise ValueError(f"x must be one of {tuple(X_LABELS)}, got {x!r}")
    return read_history(
        directory,
        lambda lf: (
            selection.rows(lf)
            .filter(pl.col(x).is_not_null())  # step: samples without one are left out
            .sort(x, "_write_order")
            .select(*TENSOR_KEY, "module_type", "metric", x, "value")
        ),
    )


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
    rows = plot_rows(directory, selection, x)
    rows, left_out = default_metrics(rows, facts, selection.metrics)
    if rows.is_empty() and x == "step":
        raise ValueError(NO_STEP.format(directory=directory))
    if rows.is_empty():
        raise ValueError(f"no history rows in {directory} match the selection")
    figure, result = trend_figure(rows, facts, x, max_tensors, yscale)
    result = write_trends(figure, result, output)
    return dataclasses.replace(result, metrics_left_out=left_out)


__all__ = ["DEFAULT_METRICS", "plot", "plot_rows"]
