"""Drawing shared by `plot`, `heatmap` and their forms for a parent of rank runs: the optional
matplotlib's error, the step axis, and the trend figure (`trend_figure`); the heatmap's grid
image is `pictures_grid`. Commands import these; no command imports another command's module.

Design decisions of the trend figure:

- One panel per (metric, signal): rows are metrics, columns are `output` and `output_gradient`
  (their scales differ by orders of magnitude, so they never share an axis); inside a panel,
  one line per tensor (named as in every command, `text.tensor_label`: an eval series is a line
  of its own, labelled `[eval]`), one point per sample. The x axis is `sample_id`,
  `forward_index` or `step`, and its label says which.
- A null value (unavailable, with a reason in history) is a gap in the line, never a 0, and
  an `x` in the line's colour at the bottom of the panel marks each such sample, so a line that
  ends at a null does not look like a series that stopped. A panel with no finite value at all
  (a tensor that is NaN at every sample) has no y scale, which would read as values near 0, but
  the words `NO_VALUE`. The x axis ticks whole numbers only (a single sample is at 0, not
  among fractions of a sample either side).
- At most `max_tensors` tensors (traversal order) are drawn, so lines stay tellable apart; the
  figure title says how many were left out and how to choose (`--layers REGEX`).
- Lines that share values stay visible: each tensor has its own hollow marker shape and line
  style, and lines drawn first have larger markers and wider lines, so a line drawn later on
  top of an equal one leaves the earlier one's rim showing (several layers with
  zero_fraction 0 are one point of several rings, not one colour).
- `yscale`: "linear" (default), "log" (a panel with values <= 0 falls back to "symlog" and its
  title says so) or "symlog" (linear within the smallest nonzero |value|, logarithmic beyond),
  for panels where one tensor's scale flattens the others. The scale and the linear threshold
  are chosen from the lines drawn only: a tensor left out (`max_tensors`, the selection) never
  turns a log panel into symlog.
- matplotlib is optional (the checkout's `plot` extra); it is imported only when
  drawing, with the Agg canvas and no pyplot, so drawing never touches a display or global
  figure state.
- The PNG's text metadata ("Description") lists the panels and the x column as JSON, so a
  script (or a test) can read back what the image shows.
- Labels longer than MAX_LABEL_CHARS are shortened by one rule for every figure (`shorten`:
  `...` and the name's end, which tells nested layers apart; heatmap's rows too), and the
  legend is as wide as its longest label, so a 173-character layer name leaves the panels their
  width. The full names stay in the PNG's metadata ("tensors"; "legend" holds what is drawn),
  and `plot` prints them when it shortened one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.cli.reader import TENSOR_KEY, RunFacts, layer_order, metric_order
from torchinstruments.cli.text import plural, tensor_label
from torchinstruments.records import SIGNALS
from torchinstruments.rundir.shell import MATPLOTLIB_INSTALL, literal_if_unclear

__all__ = [
    "DEFAULT_MAX_TENSORS",
    "DEFAULT_METRICS",
    "DPI",
    "LEGEND_WIDTH_IN",
    "MAX_LABEL_CHARS",
    "MISSING_MATPLOTLIB",
    "NO_STEP",
    "PANEL_HEIGHT_IN",
    "PANEL_WIDTH_IN",
    "X_LABELS",
    "YSCALES",
    "MatplotlibMissingError",
    "PlotResult",
    "TensorKey",
    "checked_folder",
    "checked_png",
    "default_metrics",
    "literal",
    "matplotlib_missing",
    "metrics_left_out_line",
    "shorten",
    "tensor_order",
    "trend_figure",
    "write_trends",
]

# What `plot` draws without --metrics, of one run and of a parent of rank runs alike: a figure
# that reads on a laptop screen (8 panels), not every metric (18 panels, 2,160 px tall).
DEFAULT_METRICS = ("mean", "std", "zero_fraction", "nonfinite_fraction")

NO_STEP = (
    "no sample of {directory} that matches the selection has a step (history's step column is "
    "null: a trainer callback or torchinstruments.set_step(model, step) gives it); use --x "
    "sample_id or --x forward_index"
)
MISSING_MATPLOTLIB = (
    "torchinstruments plot needs matplotlib, which is an optional dependency: install it with "
    f"{MATPLOTLIB_INSTALL}."
)


class MatplotlibMissingError(ImportError):
    """matplotlib is not installed."""


def matplotlib_missing(command: str) -> MatplotlibMissingError:
    """The error `command` (plot or heatmap) raises when matplotlib is not installed."""
    return MatplotlibMissingError(MISSING_MATPLOTLIB.replace(" plot ", f" {command} "))


X_LABELS = {
    "sample_id": "sample_id (n-th sampled root forward)",
    "forward_index": "forward_index (n-th root forward, sampled or not)",
    "step": "step (the trainer's global step, or the value given with set_step)",
}
PANEL_WIDTH_IN = 4.6
PANEL_HEIGHT_IN = 2.3
LEGEND_WIDTH_IN = 2.4
LEGEND_CHAR_IN = 0.075  # inches of a 9 pt legend character, to size the legend to its labels
MAX_LABEL_CHARS = 48  # the most characters of a tensor's label in a figure (see `shorten`)
DPI = 100
DEFAULT_MAX_TENSORS = 10
NULL_MARK = "x"
YSCALES = ("linear", "log", "symlog")
# One (marker, line style) per drawn tensor, all distinct for up to 10 tensors (any number of
# tensors past that repeats them with another colour).
MARKERS = ("o", "s", "^", "D", "v", "p", "h", "<", ">", "8")
LINE_STYLES = ("-", "--", "-.", ":")
# The most tensors the legend names one by one: past it, its last entry counts the others (the
# PNG's Description metadata names every one). With `--max-tensors 3000` the legend had an
# entry per line, ran off the image and covered the panels.
LEGEND_TENSORS = 30
LEGEND_ROW_IN = 0.25  # the height of a legend entry, its largest marker included


@dataclass(frozen=True)
class PlotResult:
    """What was drawn: file, pixel size, panels (metric, signal), tensors drawn and left out."""

    path: Path
    width_px: int
    height_px: int
    x: str
    panels: tuple[tuple[str, str], ...]
    tensors: tuple[str, ...]  # full labels
    left_out: tuple[str, ...]
    yscales: tuple[str, ...] = ()
    styles: tuple[tuple[str, str], ...] = ()
    metrics_left_out: tuple[str, ...] = ()
    null_marks: int = 0  # samples marked as a null value, over all panels
    legend: tuple[str, ...] = ()  # the tensors' labels as the legend shows them (`shorten`)


def default_metrics(
    rows: pl.DataFrame, facts: RunFacts, chosen: tuple[str, ...] | None
) -> tuple[pl.DataFrame, tuple[str, ...]]:
    """`rows` of DEFAULT_METRICS only, and the metrics left out (in the run's order), when no
    metrics are `chosen` (`--metrics`) and the run has any of them; otherwise `rows` and ()."""
    if chosen is not None:
        return rows, ()
    present = metric_order(rows["metric"].unique().to_list(), facts.run)
    if not set(present) & set(DEFAULT_METRICS):
        return rows, ()  # a run of custom metrics only: draw them all
    left_out = tuple(m for m in present if m not in DEFAULT_METRICS)
    return rows.filter(pl.col("metric").is_in(DEFAULT_METRICS)), left_out


def metrics_left_out_line(prog: str, result: PlotResult) -> str | None:
    """The stderr line naming the metrics a default plot did not draw (None: none left out)."""
    if not result.metrics_left_out:
        return None
    drawn = ", ".join(dict.fromkeys(m for m, _ in result.panels))
    return (
        f"{prog}: drew {drawn}; not drawn without --metrics: "
        f"{', '.join(result.metrics_left_out)} (--metrics m1,m2 chooses)"
    )


def shorten(text: str) -> str:
    """`text`, or when longer than MAX_LABEL_CHARS, `...` and its end (a nested layer's name
    differs from its siblings' at the end)."""
    return text if len(text) <= MAX_LABEL_CHARS else "..." + text[-(MAX_LABEL_CHARS - 3) :]


def _said(path: Path) -> str:
    """A path the user gave, in an error, by index.md's rule (`literal_if_unclear`)."""
    return literal_if_unclear(str(path))


def checked_png(output: Path) -> Path:
    """`output`, once it is a path `plot` can write its PNG to (checked before anything is
    read or drawn, for a run and a parent of rank runs alike).

    Raises:
        ValueError: naming -o and the fix: a name not ending in .png (the file would be a PNG
            whatever its name says), a folder that does not exist, or a folder's own name (a
            folder `x.png`: the save ended in a traceback, IsADirectoryError).
    """
    if output.is_dir():
        raise ValueError(
            f"-o {_said(output)} is a folder; give the PNG file's path in it, such as "
            f"{_said(output / 'trends.png')}"
        )
    if output.suffix.lower() != ".png":
        raise ValueError(
            f"-o {_said(output)}: plot writes a PNG image; give a file name ending in .png"
        )
    if not output.parent.is_dir():
        raise ValueError(
            f"-o {_said(output)}: the folder {_said(output.parent)} does not exist; create it, "
            "or choose a PNG path in an existing folder"
        )
    return output


def checked_folder(output_dir: Path) -> Path:
    """`output_dir`, once it is an existing folder `heatmap` can write its PNGs into.

    Raises:
        ValueError: naming -o/--output-dir and the fix.
    """
    if not output_dir.is_dir():
        raise ValueError(
            f"-o/--output-dir {_said(output_dir)} is not an existing folder; create it, or "
            "choose an existing one"
        )
    return output_dir


def literal(text: str) -> str:
    """`text` as matplotlib must be given it to draw it as written: each `$` escaped, since
    matplotlib reads text between two `$` as a formula (mathtext), which would draw a layer named
    `cost$5$` as `cost5` and make one named `$\\frac{$` fail the whole command."""
    return text.replace("$", r"\$")


def _labels(keys: list[tuple[str, int, str, str]], rows: pl.DataFrame) -> list[str]:
    """Legend labels: the tensor and its module type, e.g. `3[0] (LSTM)` (each written as
    `tensor_label` writes a name)."""
    calls = set(rows.filter(pl.col("call_index") > 0)["layer"].to_list())
    types = dict(rows.select("layer", "module_type").unique("layer").iter_rows())
    return [
        f"{tensor_label(*k, calls=k[0] in calls)} ({literal_if_unclear(types[k[0]])})" for k in keys
    ]


TensorKey = tuple[str, int, str, str]  # layer, call_index, tensor_path, mode


def tensor_order(catalog: pl.DataFrame, facts: RunFacts) -> list[TensorKey]:
    """The tensors of `catalog` (rows with the tensor key) in drawing order: the layers'
    traversal order, then call, tensor path, train before eval."""
    layers = layer_order(catalog["layer"].unique().to_list(), facts.run)
    rank = {name: i for i, name in enumerate(layers)}
    return sorted(
        {(r[0], r[1], r[3], r[4]) for r in catalog.select(TENSOR_KEY).unique().iter_rows()},
        key=lambda k: (rank[k[0]], k[1], k[2], k[3] != "train"),
    )


def _style(i: int, count: int) -> dict[str, Any]:
    """The i-th of `count` lines: its own marker and style; earlier lines wider and larger (so
    a line drawn over another leaves it visible), the first `len(MARKERS)` only: grown with
    `count`, the first of 3,000 lines was 1,000 points wide and filled the panel."""
    larger = max(0, min(count, len(MARKERS)) - 1 - i)
    return {
        "marker": MARKERS[i % len(MARKERS)],
        "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
        "markersize": 4 + 1.5 * larger,
        "linewidth": 1 + 0.35 * larger,
        "markerfacecolor": "none",
        "color": f"C{i % 10}",
    }


def _scale(ax: Any, values: list[float], yscale: str) -> str:
    """Apply `yscale` to a panel; returns the scale used (log falls back to symlog at <= 0)."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if yscale == "linear" or not finite:
        return "linear"
    if yscale == "log" and min(finite) > 0:
        ax.set_yscale("log")
        return "log"
    nonzero = [abs(v) for v in finite if v != 0]
    ax.set_yscale("symlog", linthresh=min(nonzero) if nonzero else 1.0)
    return "symlog"


NO_VALUE = "no finite value to draw"


def _no_value(ax: Any) -> None:
    """A panel without a finite value (every value null, or no row): no y scale, which would
    read as values near 0 (matplotlib's default -0.05..0.05), but words saying so."""
    ax.set_yticks([])
    ax.text(0.5, 0.5, NO_VALUE, transform=ax.transAxes, ha="center", va="center", fontsize=8)


def _runs_on(xs: list[Any], ys: list[float]) -> tuple[list[Any], list[float]]:
    """`xs`, `ys` with a gap (a NaN point) wherever x steps back: over `step`, a fit resumed
    from a checkpoint behind the last step an earlier attempt recorded starts again at a lower
    step, and a line joining the earlier attempt's last point to it would draw a trend running
    backwards; each stretch is drawn on its own, in the tensor's style."""
    gapped_x: list[Any] = []
    gapped_y: list[float] = []
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if i and x is not None and xs[i - 1] is not None and x < xs[i - 1]:
            gapped_x.append(xs[i - 1])
            gapped_y.append(float("nan"))
        gapped_x.append(x)
        gapped_y.append(y)
    return gapped_x, gapped_y


def trend_figure(
    rows: pl.DataFrame,
    facts: RunFacts,
    x: str,
    max_tensors: int,
    yscale: str = "linear",
    *,
    title: str | None = None,
    catalog: pl.DataFrame | None = None,
    xs: pl.Series | None = None,
) -> tuple[Any, PlotResult]:
    """Build the matplotlib Figure and describe it (path left empty); `title` says what the
    lines are (default: `N tensors`). `rows` may hold the drawn tensors' rows only when
    `catalog` (`plot_catalog`: every tensor, module type, signal and metric, which choose the
    tensors, panels and labels) and `xs` (every x) say what the whole selection holds.

    Raises:
        MatplotlibMissingError: if matplotlib is not installed.
        ValueError: if `yscale` is not one of YSCALES.
    """
    if yscale not in YSCALES:
        raise ValueError(f"yscale must be one of {YSCALES}, got {yscale!r}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise matplotlib_missing("plot") from exc

    catalog = rows if catalog is None else catalog
    keys = tensor_order(catalog, facts)
    drawn, left_out = keys[:max_tensors], keys[max_tensors:]
    metrics = metric_order(catalog["metric"].unique().to_list(), facts.run)
    signals = [s for s in SIGNALS if s in set(catalog["signal"].to_list())]
    ncols, nrows = max(1, len(signals)), max(1, len(metrics))
    labels = _labels(drawn, catalog)
    legend = [shorten(label) for label in labels]
    legend_in = max(LEGEND_WIDTH_IN, LEGEND_CHAR_IN * max(map(len, legend), default=0) + 0.6)
    figure = Figure(
        figsize=(PANEL_WIDTH_IN * ncols + legend_in, PANEL_HEIGHT_IN * nrows + 0.9),
        dpi=DPI,
        layout="constrained",
    )
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False, sharex=True)
    styles = [_style(i, len(drawn)) for i in range(len(drawn))]
    panels = []
    scales = []
    null_marks = 0
    for i, metric in enumerate(metrics):
        for j, signal in enumerate(signals):
            ax = axes[i][j]
            panels.append((metric, signal))
            panel = rows.filter(pl.col("metric") == metric, pl.col("signal") == signal)
            shown: list[float] = []  # the drawn lines' values: they alone choose the scale
            for style, label, (layer, call_index, tensor_path, mode) in zip(
                styles, legend, drawn, strict=True
            ):
                line = panel.filter(
                    pl.col("layer") == layer,
                    pl.col("call_index") == call_index,
                    pl.col("tensor_path") == tensor_path,
                    pl.col("mode") == mode,
                )
                if line.is_empty():
                    continue
                shown += line["value"].drop_nulls().to_list()
                ax.plot(
                    *_runs_on(line[x].to_list(), line["value"].fill_null(float("nan")).to_list()),
                    label=label,
                    **style,
                )
                nulls = line.filter(pl.col("value").is_null())[x].to_list()
                if nulls:  # at the panel's bottom edge, in the line's colour
                    null_marks += len(nulls)
                    ax.plot(
                        nulls,
                        [0.02] * len(nulls),
                        transform=ax.get_xaxis_transform(),
                        marker=NULL_MARK,
                        linestyle="none",
                        color=style["color"],
                        markersize=7,
                        clip_on=False,
                    )
            used = _scale(ax, shown, yscale)
            scales.append(used)
            if not any(math.isfinite(v) for v in shown):
                _no_value(ax)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # x counts samples, forwards
            fallback = " (symlog: values <= 0)" if yscale == "log" and used == "symlog" else ""
            ax.set_title(literal(f"{metric} of {signal}{fallback}"), fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            if i == nrows - 1:
                ax.set_xlabel(X_LABELS[x], fontsize=8)
    at = (rows[x] if xs is None else xs).drop_nulls().unique().to_list()
    if len(at) == 1:  # one x: its own tick, not a fraction of a sample either side
        for ax in axes.flat:
            ax.set_xticks(at)
    handles, entries = _legend_entries(styles, legend, Line2D)
    if null_marks:
        handles.append(Line2D([], [], marker=NULL_MARK, linestyle="none", color="black"))
        entries.append("x at the bottom:\nnull value (reason\nin history)")
    figure.legend(handles, entries, loc="outside right upper", fontsize=9, title="tensor")
    lines_in = sum(entry.count("\n") + 1 for entry in entries) + 1  # and the legend's title
    panels_in = PANEL_HEIGHT_IN * nrows + 0.9
    figure.set_size_inches(figure.get_size_inches()[0], max(panels_in, LEGEND_ROW_IN * lines_in))
    where = "/".join(facts.directory.parts[-2:]) or str(facts.directory)
    title = f"{where}: {title or plural(len(drawn), 'tensor')}"
    if left_out:
        title += f" ({len(left_out)} more left out: choose with --layers or --max-tensors)"
    figure.suptitle(literal(title), fontsize=10)
    width, height = figure.get_size_inches()
    result = PlotResult(
        path=Path(),
        width_px=round(width * DPI),
        height_px=round(height * DPI),
        x=x,
        panels=tuple(panels),
        tensors=tuple(labels),
        left_out=tuple(_labels(left_out, catalog)),
        yscales=tuple(scales),
        styles=tuple((s["marker"], s["linestyle"]) for s in styles),
        null_marks=null_marks,
        legend=tuple(legend),
    )
    return figure, result


def _legend_entries(
    styles: list[dict[str, Any]], legend: list[str], line: Any
) -> tuple[list[Any], list[str]]:
    """The legend's handles and texts: a line per tensor up to `LEGEND_TENSORS`, past it the
    first `LEGEND_TENSORS - 1` and an entry that counts the others."""
    shown = len(styles) if len(styles) <= LEGEND_TENSORS else LEGEND_TENSORS - 1
    handles = [line([], [], **style) for style in styles[:shown]]
    entries = [literal(entry) for entry in legend[:shown]]
    if shown < len(styles):
        handles.append(line([], [], linestyle="none"))
        entries.append(f"and {len(styles) - shown} more\n(the PNG's Description\nnames each)")
    return handles, entries


def write_trends(figure: Any, result: PlotResult, output: Path) -> PlotResult:
    """Save `trend_figure`'s figure as a PNG whose metadata describes it; `result` with its path."""
    description = json.dumps(
        {
            "x": result.x,
            "panels": [list(p) for p in result.panels],
            "tensors": list(result.tensors),
            "legend": list(result.legend),
            "yscales": list(result.yscales),
            "styles": [list(s) for s in result.styles],
        }
    )
    figure.savefig(output, format="png", dpi=DPI, metadata={"Description": description})
    return dataclasses.replace(result, path=Path(output))
