"""`plot PARENT` and `heatmap PARENT`: one tensor of a multi-rank run, rank by rank.

Design decision: both draw one tensor (layer, call, tensor path): the first, in traversal order,
that `--layers` matches (the first tensor of the run without it), so an image of 64 ranks stays
readable and reads only that tensor's rows from each rank. They draw with the single-run
drawing code (`pictures`, `pictures_grid`), with ranks where it has tensors: `plot` draws one
line per rank and mode (labelled `rank N: tensor`, `[eval]` for eval samples) in each metric and
signal panel (without `--metrics`, the metrics `plot DIR` draws: `pictures.default_metrics`), and `--max-tensors N` keeps the N lowest ranks, each with all its modes (ranks are
counted as ranks, lines per mode separately: `RankLines`); `heatmap` draws one image per metric with a
row per rank and a column per sample (output and output_gradient side by side), the same four
cell kinds (value, null, nonfinite, no row) as the single-run heatmap. Over `--x step` as on
one run: samples without a step are left out, and where no rank has one the command refuses
with the single run's message (exit 1), never an empty picture. Each module type in a label is
written by index.md's rule (`literal_if_unclear`), as the tensor's name is: a class named with an
escape or a line break must not rewrite or split the line that names the picture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from torchinstruments.cli.pictures import (
    DEFAULT_MAX_TENSORS,
    NO_STEP,
    PlotResult,
    default_metrics,
    matplotlib_missing,
    trend_figure,
    write_trends,
)
from torchinstruments.cli.pictures_grid import SCALES, HeatmapResult, build_grid, draw, file_names
from torchinstruments.cli.rank_runs import RankRun, parent_facts, ranks_with_history
from torchinstruments.cli.reader import (
    TENSOR_KEY,
    RunFacts,
    layer_order,
    metric_order,
    read_history,
    select,
)
from torchinstruments.cli.selection import Selection
from torchinstruments.cli.text import plural, tensor_label
from torchinstruments.rundir.ranges import ranges
from torchinstruments.rundir.shell import literal_if_unclear

TensorId = tuple[str, int, str]


def chosen_tensor(runs: Sequence[RankRun], facts: RunFacts, selection: Selection) -> TensorId:
    """The first tensor (layer, call_index, tensor_path) in traversal order that the selection
    matches in any of the ranks.

    Raises:
        ValueError: if the selection matches no row of any rank.
    """
    keys = ["layer", "call_index", "tensor_path"]
    found = pl.concat(
        [
            read_history(
                run.directory,
                lambda lf: selection.rows(lf).select(keys).unique(),
                write_order=False,
            )
            for run in runs
        ]
    ).unique()
    if found.is_empty():
        raise ValueError(
            f"no history rows in {literal_if_unclear(str(facts.directory))} match the selection"
        )
    order = {name: i for i, name in enumerate(layer_order(found["layer"].to_list(), facts.run))}
    return min(found.iter_rows(), key=lambda k: (order[k[0]], k[1], k[2]))


def _tensor_rows(
    parent: Path,
    runs: Sequence[RankRun],
    selection: Selection,
    tensor: TensorId,
    x: str,
    metrics: bool,
) -> pl.DataFrame:
    """That tensor's rows from every rank, in order of `x` (write order breaking ties), its
    `layer` renamed `rank N: layer` and its `rank` added; only its rows are decoded (the filters reach the Parquet
    scan). Rows without an `x` (a sample without a step) are left out; with `x` = step each row
    also carries its sample_id (a heatmap column is a sample, and samples may share a step).

    Raises:
        ValueError: with `x` = step, if no rank has a selected row with a step (`NO_STEP`).
    """
    layer, call_index, path = tensor
    xs = ("step", "sample_id") if x == "step" else (x,)
    frames = []
    for run in runs:
        rows = read_history(
            run.directory,
            lambda lf: (
                select(
                    lf, signals=selection.signals, metrics=selection.metrics if metrics else None
                )
                .filter(
                    pl.col("layer") == layer,
                    pl.col("call_index") == call_index,
                    pl.col("tensor_path") == path,
                    pl.col(x).is_not_null(),
                )
                .select(*TENSOR_KEY, "module_type", "metric", *xs, "value")
                .sort(*xs, maintain_order=True)  # files are in write order: ties keep it
            ),
            write_order=False,  # so that the filters reach the Parquet scan
        )
        frames.append(
            rows.with_columns(
                layer=pl.lit(f"rank {run.rank:03d}: {layer or '<root>'}"),
                rank=pl.lit(run.rank, pl.Int64),
            )
        )
    rows = pl.concat(frames)
    if rows.is_empty() and x == "step":
        raise ValueError(NO_STEP.format(directory=literal_if_unclear(str(parent))))
    return rows


@dataclass(frozen=True)
class RankLines:
    """What a picture of one tensor across ranks holds: the tensor, the ranks drawn and left
    out, and its lines (plot) or rows (heatmap) per mode: a rank with train and eval samples
    has one of each, and is still one rank."""

    tensor: TensorId
    ranks: tuple[int, ...]
    left_out: tuple[int, ...]
    per_mode: tuple[tuple[str, int], ...]
    without_history: Mapping[int, str] = dataclasses.field(default_factory=dict)
    # Each module type of the tensor's layer and the ranks drawn with it, in rank order: more
    # than one where the layer name is another module on some rank (a pipeline split).
    types: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # The ranks read that hold no row of the tensor the selection reads (a rank killed before
    # a row of it reached the disk, a pipeline stage without the layer): in no line or row.
    without_rows: tuple[int, ...] = ()

    def name(self) -> str:
        """The tensor as the commands print it (`layers.0`, `0 call 1`), with each module type
        and its ranks where they differ: `layers.0 (Linear on rank 0; Conv1d on rank 1)`, as
        `show PARENT` and `compare PARENT` name such a layer's series by type."""
        layer, call_index, path = self.tensor
        name = tensor_label(layer, call_index, path, calls=call_index > 0)
        if len(self.types) < 2:
            return name
        return f"{name} ({'; '.join(f'{literal_if_unclear(t)} on rank {ranges(at)}' for t, at in self.types)})"

    def describe(self, what: str) -> str:
        """`2 ranks (2 train lines, 2 eval lines)` for `what` = "line"."""
        each = ", ".join(f"{n} {mode} {what}{'' if n == 1 else 's'}" for mode, n in self.per_mode)
        return f"{plural(len(self.ranks), 'rank')} ({each})"


def _rank_lines(
    rows: pl.DataFrame,
    tensor: TensorId,
    without: Mapping[int, str],
    read: Sequence[RankRun],
    most: int | None = None,
) -> tuple[pl.DataFrame, RankLines]:
    """`rows` of the first `most` ranks (all of them: None), each with all its modes; the
    ranks of `read` with no row are named in `without_rows`."""
    present = sorted(set(rows["rank"].to_list()))
    empty = tuple(run.rank for run in read if run.rank not in present)
    kept = present if most is None else present[:most]
    rows = rows.filter(pl.col("rank").is_in(kept))
    lines = rows.select("rank", "mode").unique()
    modes = sorted(set(lines["mode"].to_list()), key=lambda m: (m != "train", m))
    per_mode = tuple((m, lines.filter(pl.col("mode") == m).height) for m in modes)
    by_type = (
        rows.select("module_type", "rank")
        .unique()
        .group_by("module_type")
        .agg(pl.col("rank").sort())
        .sort(pl.col("rank").list.first())
    )
    types = tuple((t, tuple(at)) for t, at in by_type.iter_rows())
    left_out = tuple(present[len(kept) :])
    return rows, RankLines(tensor, tuple(kept), left_out, per_mode, without, types, empty)


def plot_ranks(
    parent: Path,
    output: Path,
    selection: Selection,
    *,
    ranks: Sequence[int] | None = None,
    x: str = "sample_id",
    max_tensors: int = DEFAULT_MAX_TENSORS,
    yscale: str = "linear",
) -> tuple[PlotResult, RankLines]:
    """Draw one tensor's trends into a PNG: a line per rank and mode, for at most `max_tensors`
    ranks (the lowest; a rank drawn has all its modes)."""
    runs, without = ranks_with_history(parent, ranks)
    facts, _ = parent_facts(parent, runs[:1])
    tensor = chosen_tensor(runs, facts, selection)
    rows = _tensor_rows(parent, runs, selection, tensor, x, metrics=True)
    rows, left_out = default_metrics(rows, facts, selection.metrics)  # as `plot DIR` draws
    rows, lines = _rank_lines(rows, tensor, without, runs, max_tensors)
    count = sum(n for _, n in lines.per_mode)
    title = lines.describe("line")
    if lines.left_out:
        title += f" ({plural(len(lines.left_out), 'more rank')} left out: --rank or --max-tensors)"
    figure, result = trend_figure(rows, facts, x, count, yscale, title=title)
    result = write_trends(figure, result, output)
    return dataclasses.replace(result, metrics_left_out=left_out), lines


def heatmap_ranks(
    parent: Path,
    output_dir: Path,
    selection: Selection,
    *,
    ranks: Sequence[int] | None = None,
    x: str = "sample_id",
    scale: str = "linear",
    max_ranks: int | None = None,
) -> tuple[list[HeatmapResult], RankLines]:
    """One PNG per selected metric of one tensor: a row per rank and mode, a column per sample,
    for at most `max_ranks` ranks (the lowest, each with all its modes; None: all).

    Files are `heatmap-ranks-<metric>.png` in `output_dir`.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise matplotlib_missing("heatmap") from exc
    runs, without = ranks_with_history(parent, ranks)
    facts, _ = parent_facts(parent, runs[:1])
    tensor = chosen_tensor(runs, facts, selection)
    rows = _tensor_rows(parent, runs, selection, tensor, x, metrics=True)
    rows, lines = _rank_lines(rows, tensor, without, runs, max_ranks)
    metrics = metric_order(rows["metric"].unique().to_list(), facts.run)
    # Rank names sort in rank order (zero-padded), which is the order the grid's rows take.
    plain = dataclasses.replace(facts, run=None)
    # The rows are one tensor's ranks (and modes), not tensors of a run: the subtitle says so.
    about = f"tensor {lines.name()} x {lines.describe('row')} down, in rank order"
    if lines.left_out:
        about += f"; {plural(len(lines.left_out), 'more rank')} left out (--rank or --max-tensors)"
    results = []
    names = file_names(metrics, prefix="heatmap-ranks")
    for metric in metrics:
        cells = rows.filter(pl.col("metric") == metric).select(
            *(pl.col(n).cast(pl.Categorical) for n in ("layer", "tensor_path", "module_type")),
            pl.col("signal", "mode").cast(pl.Categorical),
            "call_index",
            *(("step", "sample_id") if x == "step" else (x,)),
            "value",
        )
        grid = build_grid(cells, plain, metric, x)
        results.append(
            draw(grid, facts, Path(output_dir) / names[metric], scale=scale, rows_are=about)
        )
    return results, lines


__all__ = ["RankLines", "chosen_tensor", "heatmap_ranks", "plot_ranks"]
