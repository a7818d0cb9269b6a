"""The heatmap's image, for `heatmap` and `heatmap PARENT`: a Grid of cells, tensors down and
samples across, drawn pixel by pixel.

Design decisions:

- Output and output_gradient are two panels side by side with the same rows, each with its own
  colour scale (their values differ by orders of magnitude): `linear` (min to max), `robust`
  (2nd to 98th percentile, values beyond drawn in the end colours) or `log` (log10 when every
  value is positive, else symmetric log with a linear band around 0 of the 10th percentile of
  the nonzero magnitudes).
- Four kinds of cell, never confused: a measured value (viridis); a null value (unavailable,
  its reason is in history) in NULL_COLOUR; a nonfinite value in NONFINITE_COLOUR; and no row at
  all (the tensor was not measured at that sample: the layer did not run, or no gradient reached
  it, e.g. series that stop) in ABSENT_COLOUR. A null is never drawn as a value.
- Cells are whole pixels written into the rendered frame (no resampling): every tensor gets at
  least one pixel row and every sample one pixel column, so nothing is averaged away at 3,000
  layers (which `heatmap` draws when asked: `--max-tensors`, 60 by default). The PNG's text metadata ("Description", JSON) gives each panel's pixel box and cell
  size, the rows, the columns and the colours, so a script (or a test) finds a cell's pixels
  without guessing.
- Labels: up to LABEL_ROWS tensors, every row is labelled; beyond, rows are labelled by block:
  the deepest dotted prefix of the layer names (`blocks.12`) that gives at most LABEL_ROWS
  groups, or every k-th top-level group when even those are too many.
- matplotlib is optional (the `plot` extra) and imported only when drawing, with the Agg canvas
  and no pyplot.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from torchinstruments.cli.pictures import literal, matplotlib_missing, shorten
from torchinstruments.cli.reader import RunFacts, layer_order
from torchinstruments.cli.text import plural, tensor_label
from torchinstruments.records import SIGNALS
from torchinstruments.rundir.shell import literal_if_unclear

__all__ = [
    "ABSENT_COLOUR",
    "CELL_ABSENT",
    "CELL_NONFINITE",
    "CELL_NULL",
    "CELL_VALUE",
    "FRAME_COLOUR",
    "LABEL_ROWS",
    "NONFINITE_COLOUR",
    "NULL_COLOUR",
    "SCALES",
    "X_LABELS",
    "Grid",
    "HeatmapResult",
    "PanelBox",
    "build_grid",
    "draw",
    "file_names",
    "ordinal",
    "row_ticks",
    "top_colour",
]

CELL_ABSENT, CELL_VALUE, CELL_NULL, CELL_NONFINITE = 0, 1, 2, 3
NULL_COLOUR = (150, 150, 150)  # grey: the value is null (unavailable, reason in history)
NONFINITE_COLOUR = (255, 0, 255)  # magenta: NaN or +-inf
ABSENT_COLOUR = (255, 255, 255)  # white: no row for this tensor at this sample
COLOURMAP = "viridis"
SCALES = ("linear", "robust", "log")
ROBUST_PERCENTILES = (2.0, 98.0)
LABEL_ROWS = 60
DPI = 100
MAX_PIXELS = 80_000_000  # about 320 MB of RGBA canvas; 3,000 layers x 500 samples is 3.8 M
PNG_COMPRESSION = 3  # zlib level: large images encode several times faster than at 6
FONT_SIZE = 10  # pt at DPI 100: about 14 px, legible on a laptop screen at 100%
LABELLED_CELL_HEIGHT = 22  # px per row when every row is labelled (a 10 pt label's height)
PANEL_TARGET_HEIGHT = 720  # px; rows get fewer pixels down to 1, never less
PANEL_TARGET_WIDTH = 480
PANEL_MIN_WIDTH = 280
MAX_CELL_WIDTH = 48
CHAR_WIDTH = 7.5  # px of a 10 pt character, to size the label margin
TITLE_LINE = 18  # px per title line (11 pt)
TITLE_CHAR_WIDTH = 7.6  # px of an 11 pt character, to wrap the title to the image's width
PANEL_TITLE = 40  # px between the title and the panels (the panels' own titles)
BOTTOM = 96
COLORBAR_GAP, COLORBAR_WIDTH, COLORBAR_LABELS = 10, 16, 96
FRAME_COLOUR = (90, 90, 90)  # a panel's 1 px frame, outside its cells: white no-row cells
# at a panel's edge would otherwise merge with the page
X_LABELS = {
    "sample_id": "sample_id (n-th sampled root forward)",
    "forward_index": "forward_index of each sample (n-th root forward, sampled or not)",
    "step": "step of each sample (the trainer's global step, or the value given with set_step)",
}


@dataclass(frozen=True)
class Grid:
    """One metric's cells: `values[s, r, c]` and `cells[s, r, c]` for signal s, tensor r, column c.

    Attributes:
        metric: the metric drawn.
        x: "sample_id", "forward_index" or "step".
        signals: the panels, in SIGNALS order.
        tensors: (layer, call_index, tensor_path, mode) per row, in traversal order.
        module_types: the module type of each row's layer.
        columns: the x value of each column, ascending.
        values: float64, NaN wherever the cell holds no finite value.
        cells: uint8 CELL_* codes.
    """

    metric: str
    x: str
    signals: tuple[str, ...]
    tensors: tuple[tuple[str, int, str, str], ...]
    module_types: tuple[str, ...]
    columns: tuple[int, ...]
    values: np.ndarray
    cells: np.ndarray


@dataclass(frozen=True)
class PanelBox:
    """Where a panel's cells are in the image: left/top pixel of cell (0, 0), and cell size."""

    signal: str
    left: int
    top: int
    cell_width: int
    cell_height: int
    scale: str
    vmin: float | None
    vmax: float | None


@dataclass(frozen=True)
class HeatmapResult:
    """One image written: file, pixel size, metric, rows x columns, and its panels."""

    path: Path
    width_px: int
    height_px: int
    metric: str
    rows: int
    columns: int
    panels: tuple[PanelBox, ...]
    left_out: tuple[str, ...] = ()  # tensors (or ranks) not drawn: `--max-tensors`


def build_grid(rows: pl.DataFrame, facts: RunFacts, metric: str, x: str) -> Grid:
    """Scatter one metric's rows (from `grid_rows`) into a Grid; rows are tensors in traversal order."""
    keys = ["layer", "call_index", "tensor_path", "mode"]
    tensors = (
        rows.group_by(keys)
        .agg(pl.col("module_type").last())
        .with_columns(
            _layer=pl.col("layer").cast(pl.String),
            _path=pl.col("tensor_path").cast(pl.String),
            _type=pl.col("module_type").cast(pl.String),
            _mode=pl.col("mode").cast(pl.String),
        )
    )
    layers = layer_order(tensors["_layer"].unique().to_list(), facts.run)
    rank = {name: i for i, name in enumerate(layers)}
    tensors = (
        tensors.with_columns(_rank=pl.col("_layer").replace_strict(rank, return_dtype=pl.Int64))
        .sort("_rank", "call_index", "_path", pl.col("_mode").ne_missing("train"))
        .with_row_index("_row")
    )
    present = set(rows["signal"].unique().cast(pl.String).to_list())
    signals = tuple(s for s in SIGNALS if s in present)
    signal_index = pl.lit(0)
    for i, name in enumerate(signals[1:], start=1):
        signal_index = pl.when(pl.col("signal") == name).then(i).otherwise(signal_index)
    xs = ["step", "sample_id"] if x == "step" else [x]
    samples = rows.select(xs).unique().sort(xs).with_row_index("_col")
    located = (
        rows.join(tensors.select(*keys, "_row"), on=keys, how="left", nulls_equal=True)
        .join(samples, on=xs, how="left", nulls_equal=True)
        .select("_row", "_col", "value", _signal=signal_index)
    )
    columns = samples[x]
    n_rows, n_cols = tensors.height, columns.len()
    if len(signals) * n_rows * n_cols > MAX_PIXELS // 2:
        raise ValueError(
            f"{metric}: {n_rows} tensors x {n_cols} samples x {len(signals)} signal(s) is more "
            f"cells than one image holds ({MAX_PIXELS // 2:,}): choose fewer tensors with "
            "--layers REGEX or one signal with --signal"
        )
    col = located["_col"].to_numpy()
    row = located["_row"].to_numpy()
    sig = located["_signal"].to_numpy()
    value = located["value"].to_numpy()  # null -> NaN (a float column)
    is_null = located["value"].is_null().to_numpy()
    finite = np.isfinite(value) & ~is_null
    cells = np.full((len(signals), n_rows, n_cols), CELL_ABSENT, dtype=np.uint8)
    values = np.full((len(signals), n_rows, n_cols), np.nan)
    cells[sig, row, col] = np.where(
        is_null, CELL_NULL, np.where(finite, CELL_VALUE, CELL_NONFINITE)
    ).astype(np.uint8)
    values[sig[finite], row[finite], col[finite]] = value[finite]
    return Grid(
        metric=metric,
        x=x,
        signals=signals,
        tensors=tuple(tensors.select("_layer", "call_index", "_path", "_mode").iter_rows()),
        module_types=tuple(tensors["_type"].to_list()),
        columns=tuple(columns.to_list()),
        values=values,
        cells=cells,
    )


NO_FINITE = "no finite values"

# The legend under the panels: a colour and what a cell of it is.
SWATCHES = (
    (NULL_COLOUR, "null (unavailable; reason in history)"),
    (NONFINITE_COLOUR, "nonfinite value"),
    (ABSENT_COLOUR, "no row (not measured at that sample)"),
)
SWATCH_PX = 52  # a swatch, its gap to its text and the gap to the next entry (10 pt)


def legend_width() -> int:
    """Pixels the swatches' legend takes in one row, with the figure's margins."""
    return (
        16 + round(CHAR_WIDTH * sum(len(text) for _, text in SWATCHES)) + SWATCH_PX * len(SWATCHES)
    )


def _norm(finite: np.ndarray, scale: str) -> tuple[Any, str]:
    """The matplotlib norm of one panel's finite values, and the scale's name as drawn."""
    from matplotlib.colors import LogNorm, Normalize, SymLogNorm

    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if finite.size == 0:
        return Normalize(0.0, 1.0, clip=True), NO_FINITE
    lo, hi = float(finite.min()), float(finite.max())
    if scale == "robust":
        lo, hi = (float(v) for v in np.percentile(finite, ROBUST_PERCENTILES))
        low, high = (ordinal(round(p)) for p in ROBUST_PERCENTILES)
        name = f"robust: {low} to {high} percentile"
        if lo == hi:
            lo, hi = float(finite.min()), float(finite.max())
    elif scale == "log":
        if lo > 0 and hi > lo:
            return LogNorm(lo, hi, clip=True), "log10"
        nonzero = np.abs(finite[finite != 0])
        if nonzero.size and hi > lo:
            linthresh = float(np.percentile(nonzero, 10.0))
            return SymLogNorm(
                linthresh, vmin=lo, vmax=hi, base=10
            ), f"symlog (linear within +-{linthresh:.3g})"
        name = "linear (log needs distinct values)"
    else:
        name = "linear"
    if lo == hi:  # a constant panel: its one value in the middle colour
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad
    return Normalize(lo, hi, clip=True), name


def panel_pixels(values: np.ndarray, cells: np.ndarray, norm: Any) -> np.ndarray:
    """RGB uint8 [rows, cols, 3] of one panel: the colour map for values, fixed colours otherwise."""
    from matplotlib import colormaps

    cmap = colormaps[COLOURMAP]
    rgb = np.empty((*cells.shape, 3), dtype=np.uint8)
    rgb[...] = ABSENT_COLOUR
    rgb[cells == CELL_NULL] = NULL_COLOUR
    rgb[cells == CELL_NONFINITE] = NONFINITE_COLOUR
    measured = cells == CELL_VALUE
    if measured.any():
        rgb[measured] = cmap(np.ma.filled(norm(values[measured]), 0.0), bytes=True)[:, :3]
    return rgb


def top_colour() -> tuple[int, int, int]:
    """The colour of a panel's largest value (the top of the colour map)."""
    from matplotlib import colormaps

    r, g, b, _ = colormaps[COLOURMAP](1.0, bytes=True)
    return int(r), int(g), int(b)


def _block_starts(names: list[str], depth: int) -> list[tuple[int, str]]:
    """(first row, prefix) of each run of rows whose names share their first `depth` parts."""
    keys = [".".join(name.split(".")[:depth]) for name in names]
    return [(i, key) for i, key in enumerate(keys) if i == 0 or key != keys[i - 1]]


def row_ticks(grid: Grid, noun: str = "tensor") -> tuple[list[float], list[str], str]:
    """Y tick positions (in rows), their labels, and what a label names (a row is a `noun`).

    Up to LABEL_ROWS tensors: every row. Beyond: the deepest dotted prefix of the layer names
    that splits the rows into 2..LABEL_ROWS blocks, each labelled at its first row; when every
    prefix gives one block or too many, every k-th block of the shallowest prefix with too many
    (or every k-th row) is labelled.
    """
    n = len(grid.tensors)
    calls = {t[0] for t in grid.tensors if t[1] > 0}
    labels = [
        f"{tensor_label(*t, calls=t[0] in calls)} ({literal_if_unclear(m)})"
        for t, m in zip(grid.tensors, grid.module_types, strict=True)
    ]
    if n <= LABEL_ROWS:
        return [i + 0.5 for i in range(n)], labels, f"every {noun} (module type)"
    names = [t[0] or "<root>" for t in grid.tensors]
    depths = range(1, max(len(name.split(".")) for name in names) + 1)
    starts = {d: _block_starts(names, d) for d in depths}
    fits = [d for d in depths if 1 < len(starts[d]) <= LABEL_ROWS]
    if fits:
        chosen = starts[max(fits)]
        return [float(i) for i, _ in chosen], [k for _, k in chosen], "each block's first row"
    many = [d for d in depths if len(starts[d]) > LABEL_ROWS]
    if many:
        blocks = starts[min(many)]
        step = math.ceil(len(blocks) / LABEL_ROWS)
        chosen = blocks[::step]
        what = f"the first row of every {ordinal(step)} block"
        return [float(i) for i, _ in chosen], [k for _, k in chosen], what
    step = math.ceil(n / LABEL_ROWS)
    rows = list(range(0, n, step))
    return [i + 0.5 for i in rows], [labels[i] for i in rows], f"every {ordinal(step)} {noun}"


def ordinal(n: int) -> str:
    """`2nd`, `3rd`, `11th`, `21st`: the picture's words for every n-th row (`2th` was said)."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def column_ticks(columns: int, most: int = 8) -> list[int]:
    """Column indices to label: every k-th from 0, k in 1, 2, 5, 10, 20, 50, ... (at most `most`)."""
    steps = (m * 10**e for e in range(19) for m in (1, 2, 5))
    step = next(k for k in steps if math.ceil(columns / k) <= most)
    return list(range(0, columns, step))


def cell_size(rows: int, columns: int) -> tuple[int, int]:
    """Pixels per cell (width, height): whole pixels, at least one each."""
    if rows <= LABEL_ROWS:
        height = LABELLED_CELL_HEIGHT
    else:
        height = max(1, min(LABELLED_CELL_HEIGHT, PANEL_TARGET_HEIGHT // rows))
    width = max(1, min(MAX_CELL_WIDTH, PANEL_TARGET_WIDTH // max(1, columns)))
    width = max(width, math.ceil(PANEL_MIN_WIDTH / max(1, columns)))
    return width, height


def draw(
    grid: Grid,
    facts: RunFacts,
    output: Path,
    *,
    scale: str = "linear",
    rows_are: str | None = None,
    left_out: Sequence[str] = (),
) -> HeatmapResult:
    """Write `grid` as a PNG with its panels side by side.

    `rows_are` says in the subtitle what the rows are when they are not a run's tensors (one
    tensor's ranks: `heatmap PARENT`); its labels then count rows, not tensors. `left_out`:
    the tensors not drawn (`--max-tensors`), counted in the subtitle.

    Raises:
        MatplotlibMissingError: if matplotlib is not installed.
        ValueError: if the image would exceed MAX_PIXELS (every cell is at least one pixel).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.cm import ScalarMappable
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter
        from PIL import Image  # a dependency of matplotlib
        from PIL.PngImagePlugin import PngInfo
    except ImportError as exc:
        raise matplotlib_missing("heatmap") from exc

    n_rows, n_cols = len(grid.tensors), len(grid.columns)
    cell_w, cell_h = cell_size(n_rows, n_cols)
    panel_w, panel_h = cell_w * n_cols, cell_h * n_rows
    ticks, labels, label_kind = row_ticks(grid, "tensor" if rows_are is None else "row")
    labels = [shorten(label) for label in labels]
    left = 16 + round(CHAR_WIDTH * max((len(label) for label in labels), default=8))
    stride = panel_w + COLORBAR_GAP + COLORBAR_WIDTH + COLORBAR_LABELS
    # At least as wide as the swatches' legend, which one narrow panel would cut off.
    width = max(left + stride * len(grid.signals) + 8, legend_width())
    where = "/".join(facts.directory.parts[-2:]) or str(facts.directory)
    about = (
        f"{rows_are or plural(n_rows, 'tensor') + ' down in traversal order'} "
        f"(labelled: {label_kind})"
        + (f"; {len(left_out)} more left out (--layers or --max-tensors)" if left_out else ""),
        f"{plural(n_cols, 'sample')} across; one colour scale per panel",
    )
    chars = max(40, int((width - 16) / TITLE_CHAR_WIDTH))
    title = [f"{grid.metric}: {where}"]
    for phrase in about:  # one phrase a line; a phrase wraps only when it is wider than that
        title += textwrap.wrap(phrase, chars)
    top = 8 + TITLE_LINE * len(title) + PANEL_TITLE
    height = top + panel_h + BOTTOM
    if width * height > MAX_PIXELS:
        raise ValueError(
            f"the {grid.metric} image would be {width}x{height} px ({n_rows} tensors x {n_cols} "
            f"samples, at least one pixel each; the most is {MAX_PIXELS:,} px): choose fewer "
            "tensors with --layers REGEX or one signal with --signal"
        )
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, facecolor="white")
    canvas = FigureCanvasAgg(figure)
    boxes = []
    pasted: list[tuple[int, np.ndarray]] = []
    bottom = height - top - panel_h  # pixels from the figure's bottom edge
    for s, signal in enumerate(grid.signals):
        x0 = left + s * stride
        finite = grid.values[s][grid.cells[s] == CELL_VALUE]
        norm, scale_name = _norm(finite, scale)
        rgb = panel_pixels(grid.values[s], grid.cells[s], norm)
        pasted.append((x0, rgb))
        ax = figure.add_axes((x0 / width, bottom / height, panel_w / width, panel_h / height))
        ax.set_facecolor("none")
        ax.set_xlim(0, n_cols)
        ax.set_ylim(n_rows, 0)
        for spine in ax.spines.values():
            spine.set_linewidth(0.5)
        picks = column_ticks(n_cols)
        ax.set_xticks([p + 0.5 for p in picks], [str(grid.columns[p]) for p in picks])
        ax.set_yticks(ticks, [literal(label) for label in labels] if s == 0 else [])
        ax.tick_params(labelsize=FONT_SIZE, length=2)
        ax.set_title(signal, fontsize=FONT_SIZE + 1)
        ax.set_xlabel(X_LABELS[grid.x], fontsize=FONT_SIZE)
        cax = figure.add_axes(
            (
                (x0 + panel_w + COLORBAR_GAP) / width,
                bottom / height,
                COLORBAR_WIDTH / width,
                panel_h / height,
            )
        )
        colorbar = figure.colorbar(ScalarMappable(norm=norm, cmap=COLOURMAP), cax=cax)
        # Each tick its own number (1e-05, not "1e-5" above the bar over the panel's title).
        colorbar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
        colorbar.ax.tick_params(which="both", labelsize=FONT_SIZE - 1)
        colorbar.set_label(scale_name.split(" ")[0].rstrip(":"), fontsize=FONT_SIZE - 1)
        if not finite.size:  # no scale to read: a bar from 0 to 1 would read as values there
            colorbar.set_ticks([])
            colorbar.set_label("")
            ax.set_title(f"{signal}: {NO_FINITE}", fontsize=FONT_SIZE + 1)
        vmin, vmax = (float(norm.vmin), float(norm.vmax)) if finite.size else (None, None)
        boxes.append(PanelBox(signal, x0, top, cell_w, cell_h, scale_name, vmin, vmax))
    title_text = literal("\n".join(title))
    figure.text(8 / width, 1 - 8 / height, title_text, fontsize=FONT_SIZE + 1, va="top")
    swatches = [
        Patch(facecolor=_unit(c), edgecolor="black", linewidth=0.5, label=text)
        for c, text in SWATCHES
    ]
    figure.legend(
        handles=swatches,
        loc="lower left",
        bbox_to_anchor=(4 / width, 2 / height),
        ncols=3,
        fontsize=FONT_SIZE,
        frameon=False,
    )
    description = {
        "metric": grid.metric,
        "x": grid.x,
        "columns": list(grid.columns),
        "rows": [list(t) for t in grid.tensors],
        "left_out": list(left_out),
        "panels": [vars(b) for b in boxes],
        "colours": {
            "null": list(NULL_COLOUR),
            "nonfinite": list(NONFINITE_COLOUR),
            "absent": list(ABSENT_COLOUR),
            "top": list(top_colour()),
            "colour_map": COLOURMAP,
        },
    }
    canvas.draw()
    image = np.array(canvas.buffer_rgba())[:, :, :3]
    for x0, rgb in pasted:  # whole-pixel cells, over the drawn frame: no resampling
        image[top - 1 : top + panel_h + 1, x0 - 1 : x0 + panel_w + 1] = FRAME_COLOUR
        image[top : top + panel_h, x0 : x0 + panel_w] = np.repeat(
            np.repeat(rgb, cell_h, axis=0), cell_w, axis=1
        )
    info = PngInfo()
    info.add_text("Description", json.dumps(description))
    Image.fromarray(image).save(output, format="PNG", pnginfo=info, compress_level=PNG_COMPRESSION)
    return HeatmapResult(
        Path(output), width, height, grid.metric, n_rows, n_cols, tuple(boxes), tuple(left_out)
    )


def _unit(colour: tuple[int, int, int]) -> tuple[float, float, float]:
    """An 8-bit RGB colour as matplotlib's 0..1 floats."""
    return (colour[0] / 255, colour[1] / 255, colour[2] / 255)


def file_names(metrics: Sequence[str], prefix: str = "heatmap") -> dict[str, str]:
    """`<prefix>-<metric>.png` for each metric, characters unsafe in file names replaced by
    `_`, and no two alike (nor alike but for case, for case-insensitive disks): a metric whose
    name is safe keeps it; another whose cleaned name is taken gets `-2`, `-3`, ... (`p/q`
    beside `p_q`: `heatmap-p_q-2.png`). The command prints which file each metric went to."""
    cleaned = {m: re.sub(r"[^A-Za-z0-9_.-]", "_", m) for m in metrics}
    used: set[str] = set()
    names: dict[str, str] = {}
    # Safe names first, so that a metric called `p_q` is in heatmap-p_q.png whatever the order.
    for metric in sorted(metrics, key=lambda m: cleaned[m] != m):
        name, k = cleaned[metric], 2
        while name.casefold() in used:
            name, k = f"{cleaned[metric]}-{k}", k + 1
        used.add(name.casefold())
        names[metric] = f"{prefix}-{name}.png"
    return {m: names[m] for m in metrics}
