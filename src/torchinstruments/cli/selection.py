"""What a command reads of a run, and in which order: the selection, the per-series summary.

Design decision: `show`, `compare`, the multi-rank readers, `plot` and `heatmap` all take a
`Selection` and read series through `summary` (one `chunked.summarize_series`, so their window
means are result.json's), in one display order (`ordered`); this module holds what they share,
so no command imports another command's module (the rule that two runs, or ranks, were sampled
differently is here too: `compare` and `compare PARENT` say it alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.cli.chunked import summarize_series
from torchinstruments.cli.rank_runs import RankRun
from torchinstruments.cli.reader import (
    RunFacts,
    RunFiles,
    layer_order,
    metric_order,
    read_each_with,
    read_facts,
    read_with,
    scan_files,
    select,
    window_of,
)
from torchinstruments.records import SIGNALS
from torchinstruments.rundir.attempt_ends import attempt_ends_now
from torchinstruments.rundir.index_page import page_notes
from torchinstruments.rundir.ranges import ranges
from torchinstruments.rundir.shell import literal_if_unclear
from torchinstruments.rundir.state import RunState

__all__ = [
    "COLUMNS",
    "SERIES_COLUMNS",
    "SampleApart",
    "Sampling",
    "Selection",
    "facts_dict",
    "first_sample_apart",
    "forwards_apart",
    "ordered",
    "sampled_differently",
    "samplers_in_turn",
    "sampling",
    "summarized",
    "summary",
]

# A series' key and its layer's module type: how every command's frame begins.
SERIES_COLUMNS = ("layer", "module_type", "call_index", "signal", "tensor_path", "mode", "metric")
COLUMNS = (
    *SERIES_COLUMNS,
    "latest_value",
    "latest_sample_id",
    "latest_reason",
    "window_mean",
    "window_samples",
    "window_valid",
    "window_finite",
    "window_first_sample_id",
    "window_last_sample_id",
    "observations",
    "latest_marked",
)


@dataclass(frozen=True)
class Selection:
    """What to read: a layer regex, signals, metrics (None = all), and the window size."""

    layers: str | None = None
    signals: tuple[str, ...] = SIGNALS
    metrics: tuple[str, ...] | None = None
    window: int | None = None

    def rows(self, lf: pl.LazyFrame) -> pl.LazyFrame:
        """The rows of `lf` this selection chooses, never marker rows (`reader.select`)."""
        return select(lf, layers=self.layers, signals=self.signals, metrics=self.metrics)


def ordered(frame: pl.DataFrame, facts: RunFacts) -> pl.DataFrame:
    """Rows in traversal order of layers, then call, signal, tensor path, mode (train first),
    declared metric order, module type (a layer of another type on some rank: its own rows)."""
    if frame.is_empty():
        return frame
    layers = layer_order(frame["layer"].unique().to_list(), facts.run)
    metrics = metric_order(frame["metric"].unique().to_list(), facts.run)
    return (
        frame.with_columns(
            _layer=pl.col("layer").replace_strict(layers, list(range(len(layers)))),
            _signal=pl.col("signal").replace_strict(list(SIGNALS), [0, 1], default=2),
            _metric=pl.col("metric").replace_strict(metrics, list(range(len(metrics)))),
            _mode=pl.col("mode") != "train",
        )
        .sort("_layer", "call_index", "_signal", "tensor_path", "_mode", "_metric", "module_type")
        .drop("_layer", "_signal", "_metric", "_mode")
    )


def summary(directory: Path, selection: Selection) -> tuple[RunFacts, pl.DataFrame]:
    """The run's facts and its per-series summary (columns `COLUMNS`), in display order."""
    facts = read_facts(directory)
    window = window_of(facts, selection.window)
    frame = read_with(
        directory,
        lambda files: summarize_series(
            scan_files(files, write_order=False), selection.rows, window
        ),
    )
    return facts, summarized(facts, frame)


def summarized(facts: RunFacts, frame: pl.DataFrame) -> pl.DataFrame:
    """A run's `chunked.summarize_series` frame as `summary` gives it (columns `COLUMNS`,
    display order): for `compare`, which reads it with its differences."""
    marked = pl.col("latest_sample_id").is_in(list(facts.marked), nulls_equal=False)
    frame = frame.with_columns(latest_marked=marked.fill_null(False))
    return ordered(frame.select(COLUMNS), facts)


def facts_dict(facts: RunFacts, window: int) -> dict[str, Any]:
    """Run facts as plain JSON-ready values."""
    run = facts.run
    return {
        "directory": str(facts.directory),
        "state": facts.state,
        "counts": facts.counts,
        "history_files": [str(p) for p in facts.files.paths],
        "unreadable_files": [str(p) for p in facts.files.unreadable],
        "window": window,
        "model_class": run.model_class if run else None,
        "library_version": run.library_version if run else None,
        "torch_version": run.torch_version if run else None,
        "sampler": run.sampler if run else None,  # the last attempt's
        # each attempt's (a restarted job may pass another sampler); null: unknown. One per
        # attempt, a folded entry's for each of its attempts (`rundir.attempt_folds`)
        "attempt_samplers": [a.sampler for a in facts.run_state.attempts for _ in a.numbers]
        if facts.run_state
        else [],
        # how each ended, as show's attempts line says it
        "attempt_ends": _each_attempt(
            facts.run_state, attempt_ends_now(facts.run_state, facts.directory)
        )
        if facts.run_state
        else [],
        "started_at": run.started_at if run else None,
        "selected_layers": len(run.layers) if run else None,
        "focus_layers": list(run.focus_layers) if run else None,
        "rank": run.rank if run else None,
        "marked_samples": {str(k): v for k, v in sorted(facts.marked.items())},
        # index.md's notes, in full (the text view begins each)
        "notes": list(page_notes(facts.run_state)) if facts.run_state else [],
    }


def _each_attempt(state: RunState, per_entry: list[str]) -> list[str]:
    """`per_entry` (one value per entry of the state's attempts) as one value per attempt: a
    folded entry's for each attempt it stands for (`rundir.attempt_folds`)."""
    return [v for a, v in zip(state.attempts, per_entry, strict=True) for _ in a.numbers]


# Each attempt of a run and its sampler (None: unknown, a state file from before they were kept).
Sampling = tuple[tuple[int, str | None], ...]


def sampling(facts: RunFacts) -> Sampling | None:
    """The sampler of each of the run's attempts (`.state.json`; without one, the run's own,
    as attempt 0); None without run info.

    Why every attempt's: the run info's sampler is the last attempt's, and a job restarted
    with another sampler has samples the last one never chose. The last attempt's, where the
    state predates per-attempt samplers, is the run's (`rundir.attempts.sampler_line`'s rule).
    """
    if facts.run is None:
        return None
    attempts = facts.run_state.attempts if facts.run_state is not None else ()
    said = [(a.attempt, a.sampler) for a in attempts] or [(0, facts.run.sampler)]
    if said[-1][1] is None:
        said[-1] = (said[-1][0], facts.run.sampler)
    return tuple(said)


def samplers_in_turn(s: Sampling) -> tuple[str, ...]:
    """The known samplers of `s` in the order they took over (a repeat of the one before is not
    a change; an unknown one is left out): two runs sampled alike have the same."""
    out: list[str] = []
    for _, sampler in s:
        if sampler is not None and (not out or out[-1] != sampler):
            out.append(sampler)
    return tuple(out)


def _said(label: str, s: Sampling) -> str:
    """`A: <sampler>`, or one `A, attempts 0-1: <sampler>` per run of attempts with one."""
    groups: list[tuple[list[int], str | None]] = []
    for attempt, sampler in s:
        if groups and groups[-1][1] == sampler:
            groups[-1][0].append(attempt)
        else:
            groups.append(([attempt], sampler))
    if len(groups) == 1:
        return f"{label}: {_shown(groups[0][1])}"
    return "; ".join(
        f"{label}, attempt{'s' if len(at) > 1 else ''} {ranges(at)}: {_shown(sampler)}"
        for at, sampler in groups
    )


def _shown(sampler: str | None) -> str:
    """A sampler's description by index.md's rule (`literal_if_unclear`: a user's `describe()`
    holding an escape must not rewrite the terminal), or `unknown`."""
    return literal_if_unclear(sampler) if sampler else "unknown"


def sampled_differently(
    samplings: Sequence[tuple[str, Sampling]], x: str, runs: str = "runs"
) -> str | None:
    """The warning said first when runs matched on `x` were not sampled alike, or None:
    `samplings` holds each run's (or group of runs') label and `sampling`. Alike means the
    same samplers in the same turn (`samplers_in_turn`) over all attempts, not only the last
    attempt's: a run restarted with another sampler has samples its last one never chose."""
    if len({samplers_in_turn(s) for _, s in samplings}) < 2:
        return None
    hint = " (--x forward_index matches them by root forward)" if x == "sample_id" else ""
    each = "; ".join(_said(label, s) for label, s in samplings)
    return (
        f"warning: the {runs} were sampled differently ({each}): the same {x} may be a "
        f"different step in each{hint}."
    )


# A sample_id that is a different root forward or step on some rank, and each rank's
# (rank, forward_index, step, kind of forward: `EVALUATION`, `TRAINING` or `UNREACHED`) there.
SampleApart = tuple[int, tuple[tuple[int, int, int | None, str], ...]]

EVALUATION, TRAINING, UNREACHED = "evaluation", "training", "unreached"


def first_sample_apart(runs: Sequence[RankRun]) -> SampleApart | None:
    """The first sample_id whose forward_index or step differs across the ranks that have it
    (a rank without a step differs from none), or that is another kind of forward on some
    ranks than on others, with each rank's values there; None where every shared sample_id
    agrees.

    Samplers that read the same on every rank can still sample different root forwards: the
    default clock-based one decides on each rank's own clock, and a rank that ran a forward
    the others did not (an extra evaluation batch) is a step apart from then on. Matched on
    sample_id, ranks then compare different steps, which `compare PARENT` must say. Without
    steps, a sampler on forward_index (`EveryNForwardsSampler`) takes the same forward_index
    on every rank, so where a rank's extra forward was of another kind only the rows tell it:
    a sample is an evaluation forward where every row is eval mode with grad disabled (a
    `torch.no_grad()` evaluation, a trainer's validation), never where a rank only froze some
    modules (eval mode, grad on), so a pipeline stage of frozen layers is no evaluation; and a
    training forward no backward reached where it has no gradient row although a later sample
    of that rank has one (an extra training forward, its loss never backpropagated, no
    optimizer step taken): a sample after the last one with a gradient row on disk may still
    get its backward, or have it in a buffer not yet written, so it is never called that.
    An extra training forward whose backward ran leaves rows like any step's: nothing tells it.
    Six columns of each rank's history, one row per sample, streamed.
    """

    def read(files: list[RunFiles]) -> pl.DataFrame:
        frames = [
            scan_files(held, write_order=False)
            .group_by("sample_id")
            .agg(
                pl.col("forward_index").first(),
                pl.col("step").first(),
                ((pl.col("mode") == "eval") & ~pl.col("grad_enabled")).all().alias("evaluation"),
                (pl.col("signal") == "output_gradient").any().alias("backward"),
            )
            .with_columns(rank=pl.lit(run.rank, pl.Int64))
            for run, held in zip(runs, files, strict=True)
        ]
        return pl.concat(frames, how="vertical").collect(engine="streaming")

    samples = read_each_with([run.directory for run in runs], read)
    # rows reach the disk in the order they were written, so a gradient row of a later sample
    # on disk means this sample's backward, had it run, would be there too (a live rank's
    # latest samples, whose rows are still buffered, are never called unreached)
    reached = pl.col("sample_id").filter(pl.col("backward")).max().over("rank")
    samples = samples.with_columns(
        kind=pl.when("evaluation")
        .then(pl.lit(EVALUATION))
        .when(pl.col("backward") | ~(pl.col("sample_id") < reached).fill_null(False))
        .then(pl.lit(TRAINING))
        .otherwise(pl.lit(UNREACHED))
    )
    apart = (
        samples.group_by("sample_id")
        .agg(
            pl.col("rank").n_unique().alias("ranks"),
            pl.col("forward_index").n_unique().alias("forwards"),
            pl.col("step").drop_nulls().n_unique().alias("steps"),  # set_step on rank 0 alone
            pl.col("kind").n_unique().alias("kinds"),
        )
        .filter(
            pl.col("ranks") > 1,
            (pl.col("forwards") > 1) | (pl.col("steps") > 1) | (pl.col("kinds") > 1),
        )
    )
    if apart.is_empty():
        return None
    first: int = apart.select(pl.col("sample_id").min()).item()
    there = samples.filter(pl.col("sample_id") == first).sort("rank")
    return first, tuple(there.select("rank", "forward_index", "step", "kind").iter_rows())


def forwards_apart(apart: SampleApart) -> str:
    """The warning said first when one sampler took different root forwards on the ranks."""
    sample_id, there = apart
    by_kind = len({kind for *_, kind in there}) > 1
    each = "; ".join(
        f"rank {rank}: forward_index {index}, step {'none' if step is None else step}"
        + (_kind(kind) if by_kind else "")
        for rank, index, step, kind in there
    )
    by_forward = len({index for _, index, _, _ in there}) > 1
    hint = " (--x forward_index matches them by root forward)" if by_forward else ""
    return (
        f"warning: the ranks sampled different root forwards: sample_id {sample_id} is {each}; "
        f"from there on the same sample_id may be a different step in each{hint}."
    )


def _kind(kind: str) -> str:
    """What a rank's sample was, where the ranks' samples differ in it."""
    if kind == EVALUATION:
        return ", an evaluation forward (eval mode, grad disabled)"
    if kind == UNREACHED:
        return (
            ", a training forward no backward reached (no gradient row, where a later sample "
            "has one: a forward the others did not run, say)"
        )
    return ", a training forward (a module in train mode, or grad enabled)"
