"""`torchinstruments show PARENT`: a directory of `rank-NNN/` runs read as one run, as the
spread across its ranks (`cli.ranks` holds `compare PARENT`).

Design decisions:

- `show PARENT`: per series, the spread across ranks of two measured values of each rank, its
  latest value and its recent-window mean (each the very number `show RANK_DIR` prints, from the
  same `show.summary`): min, max, median, the rank farthest from the cross-rank median and its
  signed distance from it (`value - median`; ties, distances within `TIE_ULPS` ulps of the
  values compared, since rounding alone separates them: the lower rank). Ranks whose value is
  null or nonfinite are left out of the spread and counted (`ranks` = ranks with a finite
  value, `ranks_not_finite`, `ranks_without_row`), and the text says which ranks lack what
  (`rank 1: no row in 4 of the 6 series read`, `latest value null in ...`, with its reason
  by index.md's rule, `literal_if_unclear`, as it quotes a user's error) and which ranks the
  world size expects but no directory holds; a spread over fewer ranks than were read shows as
  `1/2` in its `ranks` cell, never like ranks that agree. Beyond `PARENT_ROWS` rows per metric
  the text is grouped by module type (`rank_overview.py`; `--all`: every series).
  Measured values only, nothing judged.
- A rank without any history yet is not read: the others are, and the header says which ranks
  were not and why. Memory is bounded: one rank is read at a time (the spread needs two
  numbers per rank and series).
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.cli import module_types as types
from torchinstruments.cli.rank_departures import RANK_SERIES_KEY as _KEY
from torchinstruments.cli.rank_overview import PARENT_ROWS, grouped_spread, spread_rows
from torchinstruments.cli.rank_runs import (
    RankRun,
    header_lines,
    missing_ranks,
    ranks_with_history,
)
from torchinstruments.cli.reader import NotARunError, RunFacts, read_facts, window_of
from torchinstruments.cli.selection import SERIES_COLUMNS, Selection, facts_dict, ordered, summary
from torchinstruments.cli.text import number, plural, render_frame, series_table, several_calls
from torchinstruments.rundir.ranges import ranges
from torchinstruments.rundir.shell import literal_if_unclear

TIE_ULPS = 4  # farthest-rank distances this many ulps apart (of the values compared) are a tie
_EPSILON = 2.0**-52

SPREAD_COLUMNS = (
    *SERIES_COLUMNS,
    "at",
    "ranks",
    "ranks_not_finite",
    "ranks_without_row",
    "min",
    "max",
    "median",
    "farthest_rank",
    "farthest_by",
    "first_sample_id",
    "last_sample_id",
)


@dataclass(frozen=True)
class Spread:
    """`show PARENT`: the ranks read, their facts, the window and the per-series spread."""

    parent: Path
    runs: tuple[RankRun, ...]
    facts: tuple[RunFacts, ...]
    window: int
    frame: pl.DataFrame
    without_history: Mapping[int, str] = dataclasses.field(default_factory=dict)
    missing: tuple[int, ...] = ()
    gaps: tuple[str, ...] = ()
    mixed: types.Mixed = dataclasses.field(default_factory=dict)  # `module_types.mixed_types`


def _spread_of(per_rank: pl.DataFrame, value: str, sample: str, at: str, read: int) -> pl.DataFrame:
    """Per series: min, max, median over ranks of `value`, the rank farthest from the median,
    and how many of the `read` ranks have a row whose value is null or nonfinite, or no row."""
    keys = list(_KEY)
    finite = per_rank.filter(pl.col(value).is_finite()).with_columns(
        _median=pl.col(value).median().over(_KEY)
    )
    distance = (pl.col(value) - pl.col("_median")).abs()
    # Distances equal but for the rounding of `value - median` (a few ulps of the larger of the
    # two) are a tie, which goes to the lower rank: with two ranks both are always as far.
    slack = TIE_ULPS * _EPSILON * pl.max_horizontal(pl.col(value).abs(), pl.col("_median").abs())
    finite = finite.with_columns(
        _by=pl.col(value) - pl.col("_median"),
        _far=distance >= distance.max().over(_KEY) - slack,
    )
    stats = (
        finite.sort("rank")
        .group_by(_KEY, maintain_order=True)
        .agg(
            ranks=pl.len().cast(pl.Int64),
            min=pl.col(value).min(),
            max=pl.col(value).max(),
            median=pl.col("_median").first(),
            farthest_rank=pl.col("rank").filter("_far").first(),
            farthest_by=pl.col("_by").filter("_far").first(),
        )
    )
    every = per_rank.group_by(_KEY).agg(
        first_sample_id=pl.col(sample).min(),
        last_sample_id=pl.col(sample).max(),
        _present=pl.col("rank").n_unique().cast(pl.Int64),
    )
    return (
        every.join(stats, on=_KEY, how="left", nulls_equal=True)
        .with_columns(at=pl.lit(at), ranks=pl.col("ranks").fill_null(0))
        .with_columns(
            ranks_not_finite=pl.col("_present") - pl.col("ranks"),
            ranks_without_row=pl.lit(read, pl.Int64) - pl.col("_present"),
        )
        .select(*keys, "at", *SPREAD_COLUMNS[SPREAD_COLUMNS.index("at") + 1 :])
    )


def spread(parent: Path, selection: Selection, ranks: Sequence[int] | None = None) -> Spread:
    """Each rank's `show` summary, one rank at a time, then their spread per series.

    `at` is "latest" (each rank's latest value; `first_sample_id`..`last_sample_id` is the range
    of those ranks' latest samples) or "window" (each rank's recent-window mean; the range of the
    windows' last samples).
    """
    runs, without = ranks_with_history(parent, ranks)
    if not runs:
        raise NotARunError(f"{parent} has no rank-NNN/ directories")
    first_facts = read_facts(runs[0].directory)
    window = window_of(first_facts, selection.window)
    selection = dataclasses.replace(selection, window=window)
    frames, facts = [], []
    for run in runs:
        f, frame = summary(run.directory, selection)
        facts.append(f)
        frames.append(frame.with_columns(rank=pl.lit(run.rank, pl.Int64)))
    per_rank = pl.concat(frames, how="vertical_relaxed")
    latest = _spread_of(per_rank, "latest_value", "latest_sample_id", "latest", len(runs))
    recent = _spread_of(per_rank, "window_mean", "window_last_sample_id", "window", len(runs))
    view = dataclasses.replace(first_facts, directory=Path(parent).expanduser())
    frame = _ordered_spread(pl.concat([latest, recent]), view)
    missing = missing_ranks(facts, [r.rank for r in runs], without, ranks)
    return Spread(
        Path(parent).expanduser(),
        tuple(runs),
        tuple(facts),
        window,
        frame,
        without,
        missing,
        (*_gaps(per_rank, [r.rank for r in runs]), *_latest_samples(per_rank)),
        types.mixed_types(per_rank, "rank"),
    )


def _gaps(per_rank: pl.DataFrame, read: Sequence[int]) -> tuple[str, ...]:
    """`rank 1: no row in 4 of the 6 series read; latest value null in 1 (<reason>)`: per rank
    read, what it lacks of the series any rank has (ranks with the same lacks share a line)."""
    series = per_rank.select(_KEY).unique().height
    lacks: dict[str, list[int]] = {}
    for rank in read:
        mine = per_rank.filter(pl.col("rank") == rank)
        said = []
        if mine.is_empty():
            said.append("no row in any series read")
        elif mine.height < series:
            said.append(f"no row in {series - mine.height} of the {series} series read")
        null = mine.filter(pl.col("latest_value").is_null())
        if null.height:
            reason = null["latest_reason"].drop_nulls().first()
            said.append(
                f"latest value null in {plural(null.height, 'series', 'series')}"
                + (f" ({literal_if_unclear(str(reason))})" if reason else "")  # a user's error
            )
        nonfinite = mine.filter(~pl.col("latest_value").is_finite())
        if nonfinite.height:
            said.append(f"latest value nonfinite in {plural(nonfinite.height, 'series', 'series')}")
        if said:
            lacks.setdefault("; ".join(said), []).append(rank)
    return tuple(f"rank {ranges(ranks)}: {text}" for text, ranks in lacks.items())


def _latest_samples(per_rank: pl.DataFrame) -> tuple[str, ...]:
    """`latest sample: 4 on rank 0, 1 on rank 1 (...)`, where the ranks read stopped at
    different samples (uneven data, a rank that left early or was killed): each rank's
    "latest" value is then of another sample, which the spread's rows alone do not show."""
    last = (
        per_rank.filter(pl.col("latest_sample_id").is_not_null())
        .group_by("rank")
        .agg(pl.col("latest_sample_id").max())
    )
    by_sample: dict[int, list[int]] = {}
    for rank, sample in last.sort("rank").iter_rows():
        by_sample.setdefault(sample, []).append(rank)
    if len(by_sample) < 2:
        return ()
    each = ", ".join(
        f"{sample} on rank {ranges(ranks)}" for sample, ranks in sorted(by_sample.items())
    )
    return (
        f"latest sample differs: {each}; so each rank's 'latest' value is of its own latest "
        "sample, not one sample of every rank (`compare` of this parent matches them by sample)",
    )


def _ordered_spread(frame: pl.DataFrame, view: RunFacts) -> pl.DataFrame:
    """Series in display order (`show.ordered`), each series' latest row before its window row."""
    series = ordered(frame.filter(pl.col("at") == "latest"), view).select(_KEY)
    series = series.with_row_index("_pos")
    return (
        frame.join(series, on=_KEY, how="left", nulls_equal=True)
        .sort("_pos", pl.col("at") != "latest", maintain_order=True)
        .drop("_pos")
    )


def render_spread(s: Spread, *, fmt: str, width: int, every_tensor: bool = False) -> str:
    """The spread as text (one table per metric) or one row per series and `at` (machine)."""
    if fmt != "text":
        facts = {
            "parent": str(s.parent),
            "ranks": [r.rank for r in s.runs],
            "window": s.window,
            "by": "value - median (of the farthest rank)",
            "rank_facts": [facts_dict(f, s.window) for f in s.facts],
            "ranks_without_history": {str(r): why for r, why in s.without_history.items()},
            "ranks_missing": list(s.missing),
            "rank_gaps": list(s.gaps),
        }
        return render_frame(s.frame, fmt, facts)
    lines: list[str] = []
    for line in [*header_lines(s.parent, s.runs, s.facts, s.without_history, s.missing), *s.gaps]:
        lines += textwrap.wrap(line, width, subsequent_indent="  ")
    for line in types.rank_lines(s.mixed):
        lines += textwrap.wrap(line, width, subsequent_indent="  ")
    if not every_tensor and spread_rows(s.frame) > PARENT_ROWS:
        return "\n".join(lines + grouped_spread(s.frame, len(s.runs), width))
    frame = types.typed_names(s.frame, list(s.mixed))
    headers = ["layer", "sig", "at", "ranks", "min", "max", "far rank", "by"]
    read = len(s.runs)

    def cells(r: dict[str, Any]) -> list[str]:
        far = r["farthest_rank"]
        far_rank = "-" if far is None else str(far)
        ranks = str(r["ranks"]) if r["ranks"] == read else f"{r['ranks']}/{read}"
        return [ranks, number(r["min"]), number(r["max"]), far_rank, number(r["farthest_by"])]

    calls = several_calls(frame)
    for metric in frame["metric"].unique(maintain_order=True).to_list():
        part = frame.filter(pl.col("metric") == metric)
        lines += ["", f"{metric}:", *series_table(part, headers, cells, width=width, calls=calls)]
    notes = [
        f"Across {plural(len(s.runs), 'rank')}: latest = each rank's value at its latest sample; "
        f"window = each rank's mean over its recent window of up to "
        f"{plural(s.window, 'sample')}. ranks: the ranks with a finite value"
        + (
            f" ('1/{len(s.runs)}': 1 of the {len(s.runs)} read; the others have a null or "
            "nonfinite value or no row, said above)"
            if len(s.runs) > 1
            else ""
        )
        + ". min, max: over those ranks; far rank: "
        "the rank farthest from the cross-rank median, by: its value minus that median. "
        "'-': no rank has a finite value.",
    ]
    lines.append("")
    for note in notes:
        lines += textwrap.wrap(note, width)
    return "\n".join(lines)


__all__ = ["SPREAD_COLUMNS", "TIE_ULPS", "Spread", "render_spread", "spread"]
