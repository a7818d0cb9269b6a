"""`torchinstruments compare PARENT`: the ranks of a directory of `rank-NNN/` runs compared with
each other (`cli.rank_spread` holds `show PARENT`, `cli.ranks_draw` `plot` and `heatmap`).

Design decisions:

- A parent is a directory that holds no run itself and has `rank-NNN/` subdirectories (what
  `rank_policy="all"` writes). `--rank 0,2-3` picks ranks (by the number in the directory's
  name); one rank alone is read exactly like that rank's own directory.
- `compare PARENT`: per series, the first sample (matched on `--x`) at which one rank departs
  from the others by more than `--tolerance`: its nearest other rank's value is farther than the
  tolerance (with two ranks, `|a - b| > tolerance`, the two-run `compare`'s rule), or at which
  the ranks' rows differ in what they hold (a null against a value, or nulls for different
  reasons, or no row on a rank that has the sample while another rank has the row: the
  two-run `compare`'s difference, `cli.matching`; its reason `no row`). There the ranks whose
  kind (a value, a null's reason, or no row) is not the one held by more ranks than every other
  depart, and every rank departs where no kind is (two ranks, one null: both, as two ranks whose values
  differ both do); `by` is then null. Nonfinite values (hand-edited or concatenated histories
  only) take part as in the two-run `compare`: equal ones are 0 apart, a NaN or an infinity is
  infinitely far from any other value (`by` inf). So two ranks depart exactly where the
  two-run `compare` of their directories differs, but on a layer one of them does not select
  (absent in one run there; compared here among the ranks that have it); a series measured
  twice in a sample is matched occurrence by occurrence. A live rank's latest sample is open
  (`matching.open_sample`): a gradient row it lacks there is no departure, as it is no
  difference in the two-run `compare`, and the header says so.
  `matched` counts the two-run `compare`'s matched samples (`cli.matching`): at least two
  ranks with a value each, or a null each for the same reason.
  Matched on sample_id, it warns first when the ranks' samplers differ (the two-run rule) or
  when one sample_id is a different root forward or step on some rank (`first_sample_apart`).
- A rank without any history yet (killed, or still running, before its first part) is not
  read: the others are, and the output says which ranks were not and why (`show` and `compare`
  text in their header, elsewhere one line on stderr); only a parent where no rank has history
  is refused. `compare` then matches the ranks it read (`matched` 0 where fewer than two have
  the sample).
- Memory is bounded by streaming (`show`: one rank at a time, `cli.rank_spread`): `compare`
  reads all ranks together in ranges of `x` of about
  `DEPARTURE_BATCH_ROWS` rows of all ranks (history is ordered by sample, so each range reads
  only the Parquet row groups that hold it), the ranges cut from each rank's x column alone and
  each range's per-series result folded into one as it comes; plot and heatmap read one
  tensor's rows.
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
from torchinstruments.cli.attempts_apart import attempts_apart
from torchinstruments.cli.chunked import in_range, x_counts, x_ranges
from torchinstruments.cli.matching import matched_legend, open_line, open_sample
from torchinstruments.cli.rank_departures import batch_departures, combine_departures
from torchinstruments.cli.rank_runs import (
    RankRun,
    header_lines,
    missing_ranks,
    ranks_with_history,
)
from torchinstruments.cli.reader import (
    RunFacts,
    RunFiles,
    read_each_with,
    read_facts,
    scan_files,
)
from torchinstruments.cli.selection import (
    SERIES_COLUMNS,
    SampleApart,
    Sampling,
    Selection,
    first_sample_apart,
    forwards_apart,
    ordered,
    sampled_differently,
    samplers_in_turn,
    sampling,
)
from torchinstruments.cli.text import (
    TEXT_SERIES,
    earliest,
    number,
    plural,
    render_frame,
    series_table,
    several_calls,
)
from torchinstruments.rundir.ranges import ranges

# A range's working frame is a few hundred bytes a row: 2**18 rows (the chunk of `cli.chunked`)
# keeps it near a hundred MB, where 2**20 took half a GB.
DEPARTURE_BATCH_ROWS = 1 << 18
DEPARTURE_COLUMNS = (
    *SERIES_COLUMNS,
    "ranks",
    "matched_samples",
    "first_departure",
    "departing_ranks",
    "departing_values",
    "departing_reasons",
    "nearest_other",
)


# --- compare: the first departure of one rank --------------------------------------------------


@dataclass(frozen=True)
class Departures:
    """`compare PARENT`: the ranks, x, tolerance and the per-series first departure."""

    parent: Path
    runs: tuple[RankRun, ...]
    facts: tuple[RunFacts, ...]
    x: str
    tolerance: float
    frame: pl.DataFrame
    without_history: Mapping[int, str] = dataclasses.field(default_factory=dict)
    apart: SampleApart | None = None  # `selection.first_sample_apart` (x sample_id, one sampler)
    mixed: types.Mixed = dataclasses.field(default_factory=dict)  # from the ranks' layer catalogs
    missing: tuple[int, ...] = ()  # `rank_runs.missing_ranks`, said as `show PARENT` says them
    open_samples: Mapping[int, int] = dataclasses.field(default_factory=dict)  # rank -> its x


def _rank_scan(
    runs: Sequence[RankRun], files: Sequence[RunFiles], selection: Selection
) -> pl.LazyFrame:
    """Every chosen rank's selected rows (series key, x, occurrence, rank, value), streamed."""
    frames = []
    for run, held in zip(runs, files, strict=True):
        lf = selection.rows(scan_files(held, write_order=False))
        frames.append(lf.with_columns(rank=pl.lit(run.rank, pl.Int64)))
    return pl.concat(frames, how="vertical")


def _x_counts(files: Sequence[RunFiles], x: str) -> list[pl.DataFrame]:
    """Each rank's rows per `x`, from its x column alone: the ranges are cut from these, so
    finding them reads one integer column, not the selection's name columns of every row
    (which held more than the largest range does). Counting every row, not the selected ones,
    only makes a range smaller than its budget where the selection is narrow."""
    return [x_counts(scan_files(held, write_order=False), x) for held in files]


def departures(
    parent: Path,
    selection: Selection,
    *,
    ranks: Sequence[int] | None = None,
    tolerance: float = 0.0,
    x: str = "sample_id",
    budget_rows: int = DEPARTURE_BATCH_ROWS,
) -> Departures:
    """Per series, the first x at which one rank's value is more than `tolerance` from every
    other rank's (see the module docstring); read in x ranges of about `budget_rows` rows."""
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    runs, without = ranks_with_history(parent, ranks)
    if len(runs) + len(without) < 2:
        raise ValueError(f"compare across ranks needs at least 2 ranks; {parent} has {len(runs)}")
    facts = [read_facts(run.directory) for run in runs]
    layers = pl.DataFrame(  # each rank's selected layers (a rank without run info: none)
        [
            (run.rank, li.name, li.module_type)
            for run, f in zip(runs, facts, strict=True)
            if f.run is not None
            for li in f.run.layers
        ],
        schema={"rank": pl.Int64, "layer": pl.String, "module_type": pl.String},
        orient="row",
    )

    def read(files: list[RunFiles]) -> tuple[pl.DataFrame, dict[int, int]]:
        lf = _rank_scan(runs, files, selection)
        # Each range's result is folded in as it comes: one frame per series at a time, never
        # one per range (a range's per-series frame is as large as the whole result).
        frame = combine_departures([])
        counts = _x_counts(files, x)
        own = pl.concat(  # each rank's own samples: a row of any series, marker rows too
            [
                c.select(x, rank=pl.lit(run.rank, pl.Int64))
                for run, c in zip(runs, counts, strict=True)
            ]
        )
        opens = {  # each live rank's open sample (`matching.open_sample`)
            run.rank: at
            for run, f, c in zip(runs, facts, counts, strict=True)
            if (at := open_sample(f, c, x)) is not None
        }
        pending = pl.DataFrame(
            list(opens.items()), schema={"rank": pl.Int64, x: pl.Int64}, orient="row"
        )
        for bounds in x_ranges(counts, x, budget_rows):
            mine = own.filter(pl.col(x).is_between(*bounds))
            lf_range = in_range(lf, x, bounds)
            batch = batch_departures(lf_range, x, tolerance, mine, layers, pending)
            frame = combine_departures([frame, batch])
        return frame, opens

    frame, opens = read_each_with([run.directory for run in runs], read)
    view = dataclasses.replace(facts[0], directory=Path(parent).expanduser())
    # Read only where the samplers' own warning does not already say it (one sampler).
    turns = {samplers_in_turn(s) for f in facts if (s := sampling(f)) is not None}
    one_sampler = len(turns) < 2
    apart = first_sample_apart(runs) if x == "sample_id" and one_sampler else None
    return Departures(
        Path(parent).expanduser(),
        tuple(runs),
        tuple(facts),
        x,
        tolerance,
        ordered(frame, view),
        without,
        apart,
        types.catalog_mixed([(r.rank, f.run) for r, f in zip(runs, facts, strict=True)]),
        missing_ranks(facts, [r.rank for r in runs], without, ranks),
        opens,
    )


def departure_warnings(d: Departures) -> list[str]:
    """The two-run `compare`'s warning when the ranks were sampled differently (the same rule,
    `selection.sampled_differently`), ranks with the same sampler named together; with one
    sampler, a warning when a sample_id is still a different root forward or step on some
    rank (`Departures.apart`); and where the ranks' attempts begin at different samples
    (`cli.attempts_apart`)."""
    by_sampler: dict[tuple[str, ...], tuple[Sampling, list[int]]] = {}
    for run, f in zip(d.runs, d.facts, strict=True):
        s = sampling(f)
        if s is not None:
            by_sampler.setdefault(samplers_in_turn(s), (s, []))[1].append(run.rank)
    labelled = [(f"rank {ranges(ranks)}", s) for s, ranks in by_sampler.values()]
    warning = sampled_differently(labelled, d.x, "ranks")
    if warning is None and d.apart is not None:
        warning = forwards_apart(d.apart)
    labels = [(f"rank {run.rank}", f) for run, f in zip(d.runs, d.facts, strict=True)]
    restarted = attempts_apart(labels, d.x, "ranks")
    return [w for w in (warning, restarted) if w is not None]


def open_lines(d: Departures) -> list[str]:
    """What the departures say of each live rank's open sample (`matching.open_line`): in the
    text's header, and on stderr beside csv and markdown, whose rows cannot hold it."""
    return [open_line(f"rank {r}", d.x, at, "departure") for r, at in d.open_samples.items()]


def render_departures(d: Departures, *, fmt: str, width: int, every_series: bool = False) -> str:
    """The departures as an 80-column table, or one row per series (machine formats); a
    warning first when the ranks were sampled differently. Beyond TEXT_SERIES series, unless
    `every_series`, the table holds those whose first departure comes earliest (`earliest`),
    and says how many it leaves out."""
    if fmt != "text":
        facts = {
            "parent": str(d.parent),
            "ranks": [r.rank for r in d.runs],
            "x": d.x,
            "tolerance": d.tolerance,
            "departs": (
                "the rank's nearest other rank is farther than tolerance, or its row holds a "
                "null (or a null's reason, or a value) that most ranks' rows do not (every rank "
                "where no kind is held by the most)"
            ),
            "ranks_without_history": {str(r): why for r, why in d.without_history.items()},
            "ranks_missing": list(d.missing),
            "warnings": departure_warnings(d),
            "open_samples": {str(r): at for r, at in d.open_samples.items()},
        }
        frame = d.frame
        if fmt != "json":  # csv and markdown cells hold no lists: `0;1` (a null: empty)
            frame = frame.with_columns(
                pl.col(c)
                .list.eval(pl.element().cast(pl.String).fill_null(""))
                .list.join(";", ignore_nulls=False)
                for c in ("departing_ranks", "departing_values", "departing_reasons")
            )
        return render_frame(frame, fmt, facts)
    lines: list[str] = []
    for line in [
        *departure_warnings(d),
        *header_lines(d.parent, d.runs, d.facts, d.without_history, d.missing),
        *types.rank_lines(d.mixed),
        *open_lines(d),
        f"first departure: the first {d.x} at which one rank's value is more than "
        f"{d.tolerance:g} from every other rank's (its nearest other rank is farther; a NaN "
        "or an infinity is infinitely far from any value but an equal one), or at "
        "which the ranks' rows differ in what they hold (a null against a value, nulls "
        "for different reasons, or no row of the series on a rank that has the sample: the "
        "ranks not holding what most ranks hold depart, every rank where no one kind is held "
        "by the most); ranks: the ranks departing there, by: that distance, 'null' where they "
        "depart by a null or a missing row alone; '-' = none.",
        matched_legend("at least 2 of the ranks", d.x),
    ]:
        lines += textwrap.wrap(line, width, subsequent_indent="  ")
    if d.frame.is_empty():
        return "\n".join([*lines, "", "(no rows match the selection)"])
    headers = ["layer", "signal", "metric", "first dep", "ranks", "by", "matched"]

    def cells(r: dict[str, Any]) -> list[str]:
        first, by = r["first_departure"], r["nearest_other"]
        return [
            "-" if first is None else str(first),
            "-" if first is None else ranges(r["departing_ranks"]),
            "null" if first is not None and by is None else number(by),
            str(r["matched_samples"]),
        ]

    frame, rest = d.frame, d.frame.clear()
    lines.append("")
    if not every_series and d.frame.height > TEXT_SERIES:
        frame, rest = earliest(d.frame, "first_departure", TEXT_SERIES)
        lines += textwrap.wrap(
            f"The {TEXT_SERIES} of {d.frame.height} series whose first departure comes "
            "earliest, earliest first (ties in traversal order):",
            width,
        )
    named = types.typed_names(frame, list(d.mixed))
    lines += series_table(named, headers, cells, width=width, calls=several_calls(d.frame))
    if rest.height:
        departing = rest.filter(pl.col("first_departure").is_not_null()).height
        layers = rest.select(pl.col("layer").n_unique()).item()
        more = (
            f"{rest.height} more series not shown, in {plural(layers, 'layer')} ({departing} of "
            "them with a departure): --all prints every series, --layers REGEX, --metrics M1,M2 "
            "or --rank chooses, --format csv holds every row."
        )
        lines += textwrap.wrap(more, width)
    return "\n".join(lines)


__all__ = [
    "DEPARTURE_COLUMNS",
    "Departures",
    "departure_warnings",
    "departures",
    "open_lines",
    "render_departures",
]
