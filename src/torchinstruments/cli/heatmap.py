"""`torchinstruments heatmap DIR`: one PNG per metric, tensors down, samples across.

Design decisions:

- One image per metric (drawn by `pictures_grid`). Rows are tensors (layer, call, tensor path,
  mode: a tensor's eval samples are a row of their own, labelled `[eval]`, never one series with
  its train samples) in traversal order; columns are the samples in order of `sample_id` (or of
  `forward_index` with `--x forward_index`, or of `step` with `--x step`: the columns are the
  same samples, labelled by the root forward or the step they were taken at; with `step`,
  samples without one are left out and samples that share a step are adjacent columns with the
  same label).
- At most `max_tensors` tensors are drawn (default `DEFAULT_MAX_TENSORS`, the most rows the
  image labels one by one, `pictures_grid.LABEL_ROWS`), the first in traversal order, the same
  in every metric's image: 3,000 tensors drawn whole are a row of about one pixel each with
  labels no one reads. The image's subtitle and the command (on stderr) say how many were left
  out; `--layers REGEX` chooses others, `--max-tensors N` draws more (each tensor keeps at least
  one pixel row, so nothing is averaged away).
- It reads only the columns it draws (tensor key, signal, x, value), with filters pushed into
  the Parquet scan, from the CLI's reader: finished, live and crashed runs alike; the drawn
  tensors are chosen from the selection's names, and only their values read, every metric's in
  one read where `max_tensors` leaves some out (their rows are then few), else a metric at a time.
  Measured values only: nothing is ranked or judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from torchinstruments.cli.chunked import distinct, in_range, x_counts, x_ranges
from torchinstruments.cli.pictures import NO_STEP, TensorKey, matplotlib_missing, tensor_order
from torchinstruments.cli.pictures_grid import (
    LABEL_ROWS,
    SCALES,
    X_LABELS,
    Grid,
    HeatmapResult,
    build_grid,
    draw,
    file_names,
)
from torchinstruments.cli.reader import (
    TENSOR_KEY,
    RunFacts,
    RunFiles,
    metric_order,
    read_facts,
    read_history,
    read_with,
    scan_files,
    select,
)
from torchinstruments.cli.selection import Selection
from torchinstruments.cli.text import tensor_label
from torchinstruments.rundir.shell import literal_if_unclear

DEFAULT_MAX_TENSORS = LABEL_ROWS
_KEY = ("layer", "call_index", "tensor_path", "mode")
_KEY_SCHEMA = {
    "layer": pl.String,
    "call_index": pl.Int32,
    "tensor_path": pl.String,
    "mode": pl.String,
}


def grid_rows(
    directory: Path,
    metric: str,
    selection: Selection,
    x: str,
    tensors: Sequence[TensorKey] | None = None,
) -> pl.DataFrame:
    """One metric's rows: tensor key, module type, signal, x, value (only these are read), of
    `tensors` only when given (None: every tensor of the selection).

    Names are read as Categorical: the tensor of each of millions of rows is then found by
    integer codes, not by hashing strings.
    """
    return _metrics_rows(directory, (metric,), selection, x, tensors).drop("metric")


def drawn_rows(
    directory: Path,
    metrics: Sequence[str],
    selection: Selection,
    x: str,
    tensors: Sequence[TensorKey],
) -> dict[str, pl.DataFrame]:
    """`grid_rows` of each of `metrics`, of the drawn `tensors`, from one read of the history:
    at most `max_tensors` tensors, whose rows of every metric together are few (a read per
    metric decoded the names of every row of the history once per metric)."""
    frame = _metrics_rows(directory, tuple(metrics), selection, x, tensors)
    parts = frame.partition_by("metric", as_dict=True, include_key=False)
    empty = frame.clear().drop("metric")
    return {metric: parts.get((metric,), empty) for metric in metrics}


def _metrics_rows(
    directory: Path,
    metrics: tuple[str, ...],
    selection: Selection,
    x: str,
    tensors: Sequence[TensorKey] | None,
) -> pl.DataFrame:
    """`grid_rows` of `metrics` together, with their `metric`."""
    if x not in X_LABELS:
        raise ValueError(f"x must be one of {tuple(X_LABELS)}, got {x!r}")
    names = ("layer", "tensor_path", "module_type", "signal", "mode")
    # With x = step, a column is a sample (several may share a step): its sample_id too.
    xs = ("step", "sample_id") if x == "step" else (x,)

    def query(lf: pl.LazyFrame) -> pl.LazyFrame:
        lf = select(lf, layers=selection.layers, signals=selection.signals, metrics=metrics)
        lf = lf.filter(pl.col(x).is_not_null())
        if tensors is not None:  # a filter the scan takes, then the exact tensors
            lf = lf.filter(pl.col("layer").is_in(sorted({t[0] for t in tensors})))
            keys = pl.DataFrame(list(tensors), schema=_KEY_SCHEMA, orient="row").lazy()
            lf = lf.join(keys, on=list(_KEY), how="semi", nulls_equal=True)
        return lf.select(
            *(pl.col(n).cast(pl.Categorical) for n in names), "call_index", *xs, "value", "metric"
        )

    # A cell is one row: no order needed, so the filters reach the scan.
    return read_history(directory, query, write_order=False)


def selected_tensors(
    directory: Path, facts: RunFacts, selection: Selection, metrics: Sequence[str], x: str
) -> list[TensorKey]:
    """Every tensor of the selection with a row of one of `metrics` that has an x, in
    traversal order (train before eval): the rows the images may draw, from names alone, read
    a range of samples at a time (`cli.chunked`), never the names of millions of rows at once."""

    def read(files: RunFiles) -> pl.DataFrame:
        lf = select(
            scan_files(files, write_order=False),
            layers=selection.layers,
            signals=selection.signals,
            metrics=metrics,
        ).filter(pl.col(x).is_not_null())
        names = last = lf.clear().select(TENSOR_KEY).collect()
        for bounds in x_ranges(
            [x_counts(scan_files(files, write_order=False), "sample_id")], "sample_id"
        ):
            rows = in_range(lf, "sample_id", bounds).select(*TENSOR_KEY, "sample_id").collect()
            found = distinct(rows, TENSOR_KEY)  # one sample's keys hashed, where they repeat
            if not found.equals(last):  # the range before's (every range's, usually)
                names, last = pl.concat([names, found]).unique(), found
        return names

    return tensor_order(read_with(directory, read), facts)


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
    max_tensors: int = DEFAULT_MAX_TENSORS,
) -> list[HeatmapResult]:
    """Write one heatmap PNG per selected metric into `output_dir`.

    Args:
        directory: a finished, live or crashed run.
        output_dir: an existing directory for the images (`heatmap-<metric>.png`).
        selection: layers (regex), signals and metrics (None: every metric of the run).
        x: "sample_id", "forward_index" or "step" (the label and order of the columns; with
            step, samples without one are left out).
        scale: "linear", "robust" or "log", applied to each panel on its own.
        max_tensors: the most tensors (rows) to draw, the first in traversal order, >= 1; the
            same tensors in every image.

    Returns:
        One `HeatmapResult` per image, in the run's metric order, each naming the tensors
        left out (`HeatmapResult.left_out`).

    Raises:
        MatplotlibMissingError: if matplotlib is not installed.
        ValueError: if nothing matches the selection, or an argument is out of range.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if x not in X_LABELS:
        raise ValueError(f"x must be one of {tuple(X_LABELS)}, got {x!r}")
    if max_tensors < 1:
        raise ValueError(f"max_tensors must be an int >= 1, got {max_tensors!r}")
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
        raise ValueError(
            f"no history rows in {literal_if_unclear(str(directory))} match the selection"
        )
    if x == "step" and not _has_step(directory, selection):
        raise ValueError(NO_STEP.format(directory=literal_if_unclear(str(directory))))
    metrics = selection.metrics or tuple(metric_order(present, facts.run))
    absent = [m for m in metrics if m not in present]
    if absent:
        raise ValueError(
            f"no rows of metric(s) {', '.join(absent)} in {directory} for this selection; "
            f"its metrics: {', '.join(metric_order(present, facts.run))}"
        )
    tensors = selected_tensors(directory, facts, selection, metrics, x)
    drawn = tensors[:max_tensors] if len(tensors) > max_tensors else None  # None: all
    calls = {t[0] for t in tensors if t[1] > 0}  # layers called several times: `name#call`
    left_out = tuple(tensor_label(*t, calls=t[0] in calls) for t in tensors[max_tensors:])
    results = []
    names = file_names(metrics)
    # The drawn tensors' rows of every metric in one read; every tensor's, a metric at a time.
    together = None if drawn is None else drawn_rows(directory, metrics, selection, x, drawn)
    for metric in metrics:
        rows = grid_rows(directory, metric, selection, x) if together is None else together[metric]
        grid = build_grid(rows, facts, metric, x)
        output = Path(output_dir) / names[metric]
        results.append(draw(grid, facts, output, scale=scale, left_out=left_out))
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


__all__ = [
    "DEFAULT_MAX_TENSORS",
    "drawn_rows",
    "grid_rows",
    "heatmap",
    "read_grid",
    "selected_tensors",
]
