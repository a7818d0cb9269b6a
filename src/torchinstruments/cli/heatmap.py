"""`torchinstruments heatmap DIR`: one PNG per metric, tensors down, samples across.

Design decisions:

- One image per metric (drawn by `pictures_grid`). Rows are tensors (layer, call, tensor path,
  mode: a tensor's eval samples are a row of their own, labelled `[eval]`, never one series with
  its train samples) in traversal order; columns are the samples in order of `sample_id` (or of
  `forward_index` with `--x forward_index`, or of `step` with `--x step`: the columns are the
  same samples, labelled by the root forward or the step they were taken at; with `step`,
  samples without one are left out and samples that share a step are adjacent columns with the
  same label).
- It reads only the columns it draws (tensor key, signal, x, value), one metric at a time, with
  filters pushed into the Parquet scan, from the CLI's reader: finished, live and crashed runs
  alike. Measured values only: nothing is ranked or judged.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from torchinstruments.cli.pictures import NO_STEP, matplotlib_missing
from torchinstruments.cli.pictures_grid import (
    SCALES,
    X_LABELS,
    Grid,
    HeatmapResult,
    build_grid,
    draw,
    file_names,
)
from torchinstruments.cli.reader import (
    RunFacts,
    metric_order,
    read_facts,
    read_history,
    select,
)
from torchinstruments.cli.selection import Selection


def grid_rows(directory: Path, metric: str, selection: Selection, x: str) -> pl.DataFrame:
    """One metric's rows: tensor key, module type, signal, x, value (only these are read).

    Names are read as Categorical: the tensor of each of millions of rows is then found by
    integer codes, not by hashing strings.
    """
    if x not in X_LABELS:
        raise ValueError(f"x must be one of {tuple(X_LABELS)}, got {x!r}")
    names = ("layer", "tensor_path", "module_type", "signal", "mode")
    # With x = step, a column is a sample (several may share a step): its sample_id too.
    xs = ("step", "sample_id") if x == "step" else (x,)
    return read_history(
        directory,
        lambda lf: (
            select(lf, layers=selection.layers, signals=selection.signals, metrics=(metric,))
            .filter(pl.col(x).is_not_null())
            .select(*(pl.col(n).cast(pl.Categorical) for n in names), "call_index", *xs, "value")
        ),
        write_order=False,  # a cell is one row: no order needed, so the filters reach the scan
    )


def read_grid(
    directory: Path, facts: RunFacts, metric: str, selection: Selection, x: str = "sample_id"
) -> Grid:
    """The Grid of one metric of a finished, live or crashed run."""
    return build_grid(grid_rows(directory, metric, selection, x), facts, metric, x)


def heatmap(
    directory: Path,
    output_dir: Path,
    selection: Selection,
    *,
    x: str = "sample_id",
    scale: str = "linear",
) -> list[HeatmapResult]:
    """Write one heatmap PNG per selected metric into `output_dir`.

    Args:
        directory: a finished, live or crashed run.
        output_dir: an existing directory for the images (`heatmap-<metric>.png`).
        selection: layers (regex), signals and metrics (None: every metric of the run).
        x: "sample_id", "forward_index" or "step" (the label and order of the columns; with
            step, samples without one are left out).
        scale: "linear", "robust" or "log", applied to each panel on its own.

    Returns:
        One `HeatmapResult` per image, in the run's metric order.

    Raises:
        MatplotlibMissingError: if matplotlib is not installed.
        ValueError: if nothing matches the selection, or an argument is out of range.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if x not in X_LABELS:
        raise ValueError(f"x must be one of {tuple(X_LABELS)}, got {x!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise matplotlib_missing("heatmap") from exc
    facts = read_facts(directory)
    present = read_history(
        directory,
        lambda lf: select(lf, layers=selection.layers, signals=selection.signals).select(
            pl.col("metric").unique()
        ),
        write_order=False,
    )["metric"].to_list()
    if not present:
        raise ValueError(f"no history rows in {directory} match the selection")
    if x == "step" and not _has_step(directory, selection):
        raise ValueError(NO_STEP.format(directory=directory))
    metrics = selection.metrics or tuple(metric_order(present, facts.run))
    absent = [m for m in metrics if m not in present]
    if absent:
        raise ValueError(
            f"no rows of metric(s) {', '.join(absent)} in {directory} for this selection; "
            f"its metrics: {', '.join(metric_order(present, facts.run))}"
        )
    results = []
    names = file_names(metrics)
    for metric in metrics:
        grid = build_grid(grid_rows(directory, metric, selection, x), facts, metric, x)
        results.append(draw(grid, facts, Path(output_dir) / names[metric], scale=scale))
    return results


def _has_step(directory: Path, selection: Selection) -> bool:
    """Whether any selected row has a step."""
    found = read_history(
        directory,
        lambda lf: (
            select(lf, layers=selection.layers, signals=selection.signals)
            .filter(pl.col("step").is_not_null())
            .select("step")
            .head(1)
        ),
        write_order=False,
    )
    return found.height > 0


__all__ = ["grid_rows", "heatmap", "read_grid"]
