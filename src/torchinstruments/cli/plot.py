"""`torchinstruments plot DIR`: PNG small multiples of metric trends, output and output_gradient.

Design decisions:

- One panel per (metric, signal): rows are metrics, columns are `output` and `output_gradient`
  (their scales differ by orders of magnitude, so they never share an axis); inside a panel,
  one line per tensor (layer, call, tensor path), one point per sample. The x axis is
  `sample_id` or `forward_index` and its label says which.
- A null value (unavailable, with a reason in history) is a gap in the line, never a 0.
- At most `max_tensors` tensors (traversal order) are drawn, so lines stay tellable apart; the
  figure title and a message on stderr say how many were left out and how to choose
  (`--layers REGEX`).
- matplotlib is optional (`pip install "torchinstruments[plot]"`); it is imported only here, with
  the Agg canvas and no pyplot, so plotting never touches a display or global figure state.
- The PNG's text metadata ("Description") lists the panels and the x column as JSON, so a
  script (or a test) can read back what the image shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.cli.reader import (
    TENSOR_KEY,
    RunFacts,
    layer_order,
    metric_order,
    read_facts,
    read_history,
    select,
)
from torchinstruments.cli.show import Selection
from torchinstruments.records import SIGNALS

X_LABELS = {
    "sample_id": "sample_id (n-th sampled root forward)",
    "forward_index": "forward_index (n-th root forward, sampled or not)",
}
PANEL_WIDTH_IN = 4.6
PANEL_HEIGHT_IN = 2.3
LEGEND_WIDTH_IN = 2.4
DPI = 100
DEFAULT_MAX_TENSORS = 10
MISSING_MATPLOTLIB = (
    "torchinstruments plot needs matplotlib, which is an optional dependency: install it with "
    '`pip install "torchinstruments[plot]"` (from a checkout: `uv sync --extra plot`), or '
    "`pip install matplotlib`."
)


class MatplotlibMissingError(ImportError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class PlotResult:
    """What was drawn: file, pixel size, panels (metric, signal), tensors drawn and left out."""

    path: Path
    width_px: int
    height_px: int
    x: str
    panels: tuple[tuple[str, str], ...]
    tensors: tuple[str, ...]
    left_out: tuple[str, ...]


def tensor_label(layer: str, call_index: int, tensor_path: str, calls: bool) -> str:
    """`layer`, `layer#call` for layers called several times, then the tensor path."""
    return (layer or "<root>") + (f"#{call_index}" if calls else "") + tensor_path


def _labels(keys: list[tuple[str, int, str]], rows: pl.DataFrame) -> list[str]:
    """Legend labels: the tensor and its module type, e.g. `3[0] (LSTM)`."""
    calls = set(rows.filter(pl.col("call_index") > 0)["layer"].to_list())
    types = dict(rows.select("layer", "module_type").unique("layer").iter_rows())
    return [f"{tensor_label(*k, calls=k[0] in calls)} ({types[k[0]]})" for k in keys]


def plot_rows(directory: Path, selection: Selection, x: str) -> pl.DataFrame:
    """The rows to draw: tensor key, metric, x and value, in write order."""
    if x not in X_LABELS:
        raise ValueError(f"x={x!r} is not allowed: expected one of {tuple(X_LABELS)}")
    return read_history(
        directory,
        lambda lf: (
            select(
                lf, layers=selection.layers, signals=selection.signals, metrics=selection.metrics
            )
            .sort(x, "_write_order")
            .select(*TENSOR_KEY, "module_type", "metric", x, "value")
        ),
    )


def _figure(
    rows: pl.DataFrame, facts: RunFacts, x: str, max_tensors: int
) -> tuple[Any, PlotResult]:
    """Build the matplotlib Figure and describe it (path left empty)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as exc:
        raise MatplotlibMissingError(MISSING_MATPLOTLIB) from exc

    layers = layer_order(rows["layer"].unique().to_list(), facts.run)
    rank = {name: i for i, name in enumerate(layers)}
    keys = sorted(
        {(r[0], r[1], r[3]) for r in rows.select(TENSOR_KEY).unique().iter_rows()},
        key=lambda k: (rank[k[0]], k[1], k[2]),
    )
    drawn, left_out = keys[:max_tensors], keys[max_tensors:]
    metrics = metric_order(rows["metric"].unique().to_list(), facts.run)
    signals = [s for s in SIGNALS if s in set(rows["signal"].to_list())]
    ncols, nrows = max(1, len(signals)), max(1, len(metrics))
    figure = Figure(
        figsize=(PANEL_WIDTH_IN * ncols + LEGEND_WIDTH_IN, PANEL_HEIGHT_IN * nrows + 0.9),
        dpi=DPI,
        layout="constrained",
    )
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False, sharex=True)
    colors = [f"C{i % 10}" for i in range(len(drawn))]
    labels = _labels(drawn, rows)
    panels = []
    for i, metric in enumerate(metrics):
        for j, signal in enumerate(signals):
            ax = axes[i][j]
            panels.append((metric, signal))
            panel = rows.filter(pl.col("metric") == metric, pl.col("signal") == signal)
            for color, label, (layer, call_index, tensor_path) in zip(
                colors, labels, drawn, strict=True
            ):
                line = panel.filter(
                    pl.col("layer") == layer,
                    pl.col("call_index") == call_index,
                    pl.col("tensor_path") == tensor_path,
                )
                if line.is_empty():
                    continue
                ax.plot(
                    line[x].to_list(),
                    line["value"].fill_null(float("nan")).to_list(),
                    marker=".",
                    color=color,
                    label=label,
                )
            ax.set_title(f"{metric} of {signal}", fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            if i == nrows - 1:
                ax.set_xlabel(X_LABELS[x], fontsize=8)
    handles = [Line2D([], [], marker=".", color=color) for color in colors]
    figure.legend(handles, labels, loc="outside right upper", fontsize=8, title="tensor")
    where = "/".join(facts.directory.parts[-2:]) or str(facts.directory)
    title = f"{where}: {len(drawn)} tensor(s)"
    if left_out:
        title += f" ({len(left_out)} more left out: choose with --layers or --max-tensors)"
    figure.suptitle(title, fontsize=10)
    width, height = figure.get_size_inches()
    result = PlotResult(
        path=Path(),
        width_px=round(width * DPI),
        height_px=round(height * DPI),
        x=x,
        panels=tuple(panels),
        tensors=tuple(labels),
        left_out=tuple(_labels(left_out, rows)),
    )
    return figure, result


def plot(
    directory: Path,
    output: Path,
    selection: Selection,
    *,
    x: str = "sample_id",
    max_tensors: int = DEFAULT_MAX_TENSORS,
) -> PlotResult:
    """Draw the selected trends of a run into a PNG.

    Args:
        directory: a finished, live or crashed run.
        output: the PNG to write (its directory must exist).
        selection: layers (regex), signals and metrics to draw.
        x: "sample_id" or "forward_index".
        max_tensors: the most tensors (lines per panel) to draw, >= 1.

    Returns:
        A `PlotResult` describing the image.

    Raises:
        MatplotlibMissingError: if matplotlib is not installed.
        ValueError: if nothing matches the selection, or an argument is out of range.
    """
    if max_tensors < 1:
        raise ValueError(f"max_tensors={max_tensors!r} is not allowed: expected an int >= 1")
    facts = read_facts(directory)
    rows = plot_rows(directory, selection, x)
    if rows.is_empty():
        raise ValueError(f"no history rows in {directory} match the selection")
    figure, result = _figure(rows, facts, x, max_tensors)
    description = json.dumps(
        {"x": x, "panels": [list(p) for p in result.panels], "tensors": list(result.tensors)}
    )
    figure.savefig(output, format="png", dpi=DPI, metadata={"Description": description})
    return PlotResult(
        Path(output),
        result.width_px,
        result.height_px,
        result.x,
        result.panels,
        result.tensors,
        result.left_out,
    )


__all__ = ["MISSING_MATPLOTLIB", "MatplotlibMissingError", "PlotResult", "plot", "plot_rows"]
