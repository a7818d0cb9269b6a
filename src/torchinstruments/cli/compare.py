"""`torchinstruments compare DIR_A DIR_B`: two matched runs side by side, as measured differences.

Design decisions:

- Per series (layer, call, signal, tensor path, metric): each run's recent-window mean (the same
  definition as `show` and result.json, over each run's own latest samples), their difference
  `B - A`, and the first sample at which the two runs differ by more than `--tolerance`.
- Samples are matched on `sample_id` (runs sampled with `EveryNForwardsSampler` on the same
  schedule: sample k is the same step in both) or on `forward_index` (`--x forward_index`, e.g.
  ranks whose samplers differ). A series with several rows in one sample is matched occurrence
  by occurrence (in write order). The library's own runs never hold one (a sample records a
  tensor's gradient from the first backward only, a layer's calls have distinct call_index,
  and a resumed run's sample_id and forward_index continue); only hand-edited or concatenated
  histories do, and they are compared, not refused.
- "Differ" means `|B - A| > tolerance` (equal values never differ: two equal infinities, or two
  NaN, which the library never writes but a hand-edited history may hold, are no difference),
  a value in one run and a null in the other (or nulls for different reasons), or a row in
  one run and none in the other at a sample both runs have (a series that stops or starts in one
  run: a branch cut off from the loss leaves no null, only rows that are not there). The samples
  a run has are all of its own (a row of any series, marker rows too), never only the selected
  rows', so a series' first difference is the same whatever `--layers`, `--signal` or
  `--metrics` select it with. Only
  measured differences: no verdicts, scores or thresholds of our own (the default tolerance is 0,
  i.e. any difference).
- Series in one run only, series that stop or start in one run, and runs sampled differently
  (the samplers of every attempt, or the window, or attempts that begin at different samples:
  `cli.attempts_apart`) are said in words, the latter first: a reader
  of the table alone would otherwise read "no difference" or a null into them.
- The header's run directories, like the tensor names, are written by index.md's rule
  (`literal_if_unclear`): a directory named with an escape must not rewrite the terminal.
- A matched sample is `cli.matching`'s, the same as `compare PARENT`'s: both runs have the row,
  each with a value, or each a null for the same reason. A live run's latest sample is open
  (`matching.open_sample`): a gradient row it lacks there is no difference, and is said.
- Rank directories (`stats/rank-000`, `stats/rank-001`) are two runs like any others.
- Both runs' summaries (the means, as `show` reads them) come from the differences' read of
  each range (`cli.differences`), so each run is read once, plus its windows' latest samples;
  matched on forward_index, that holds where each run's forward_index goes up with its
  sample_id (every run the library writes); where one's does not (a hand-edited or
  concatenated history), the summaries are read by sample as `show` reads them.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.cli import module_types
from torchinstruments.cli.attempts_apart import attempts_apart
from torchinstruments.cli.chunked import summarize_series, with_windows
from torchinstruments.cli.differences import Differences, differences, first_differences
from torchinstruments.cli.matching import matched_legend, open_line, pending
from torchinstruments.cli.reader import (
    SERIES_KEY,
    TENSOR_KEY,
    RunFacts,
    RunFiles,
    read_each_with,
    read_facts,
    read_history,
    scan_files,
    window_of,
)
from torchinstruments.cli.selection import (
    SERIES_COLUMNS,
    Selection,
    facts_dict,
    ordered,
    sampled_differently,
    sampling,
    summarized,
)
from torchinstruments.cli.text import (
    TEXT_SERIES,
    earliest,
    notes_lines,
    number,
    plural,
    render_frame,
    series_name,
    series_table,
    several_calls,
    signal_short,
)
from torchinstruments.rundir.ranges import listed
from torchinstruments.rundir.shell import literal_if_unclear

# The text view's most lines of series that stop or start in one run, unless --all (its most
# series: `text.TEXT_SERIES`).
TEXT_NOTES = 20

COLUMNS = (
    *SERIES_COLUMNS,
    "mean_a",
    "mean_b",
    "difference",
    "window_a",
    "window_b",
    "matched_samples",
    "first_difference",
    "value_a_at_first_difference",
    "value_b_at_first_difference",
    "samples_a",
    "first_a",
    "last_a",
    "samples_b",
    "first_b",
    "last_b",
)


@dataclass(frozen=True)
class Comparison:
    """Both runs' facts, the window size and x column used, and the per-series table."""

    facts_a: RunFacts
    facts_b: RunFacts
    window: int
    x: str
    tolerance: float
    frame: pl.DataFrame
    mixed: module_types.Mixed = field(default_factory=dict)  # a layer of another type in B
    no_samples: tuple[str, ...] = ()  # "A", "B": the runs whose history holds no row at all
    open_samples: tuple[int | None, int | None] = (None, None)  # A's, B's `matching.open_sample`


def compare(
    directory_a: Path,
    directory_b: Path,
    selection: Selection,
    *,
    tolerance: float = 0.0,
    x: str = "sample_id",
) -> Comparison:
    """Compare two runs series by series.

    Args:
        directory_a: run A (finished, live or crashed).
        directory_b: run B.
        selection: layers, signals, metrics and window (None: run A's own window).
        tolerance: the largest |B - A| that does not count as a difference (>= 0).
        x: "sample_id" or "forward_index", the column samples are matched on.

    Returns:
        A `Comparison` whose frame has the columns `COLUMNS`, one row per series in either run.
    """
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    facts_a, facts_b = read_facts(directory_a), read_facts(directory_b)
    window = window_of(facts_a, selection.window)
    selection = Selection(selection.layers, selection.signals, selection.metrics, window)
    summary_a, summary_b, found = read_each_with(
        [directory_a, directory_b],
        lambda files: _read_together(files, selection, tolerance, (facts_a, facts_b), x),
    )
    summary_a, summary_b = summarized(facts_a, summary_a), summarized(facts_b, summary_b)

    def side(frame: pl.DataFrame, tag: str) -> pl.DataFrame:
        return frame.select(
            *SERIES_KEY,
            pl.col("module_type").alias(f"module_type_{tag}"),
            pl.col("window_mean").alias(f"mean_{tag}"),
            pl.when(pl.col("window_first_sample_id").is_not_null())
            .then(pl.format("{}-{}", "window_first_sample_id", "window_last_sample_id"))
            .alias(f"window_{tag}"),
        )

    both = side(summary_a, "a").join(
        side(summary_b, "b"), on=SERIES_KEY, how="full", coalesce=True, nulls_equal=True
    )
    extent_a, extent_b = found.extents
    frame = (
        both.join(found.diffs, on=SERIES_KEY, how="left", nulls_equal=True)
        .join(extent_a, on=SERIES_KEY, how="left", nulls_equal=True)
        .join(extent_b, on=SERIES_KEY, how="left", nulls_equal=True)
        .with_columns(
            module_type=pl.coalesce("module_type_a", "module_type_b"),
            difference=pl.col("mean_b") - pl.col("mean_a"),
            matched_samples=pl.col("matched_samples").fill_null(0),
            samples_a=pl.col("samples_a").fill_null(0),
            samples_b=pl.col("samples_b").fill_null(0),
        )
        .select(COLUMNS)
    )
    kinds = pl.concat(
        [
            summary_a.select("layer", "module_type", run=pl.lit("A")),
            summary_b.select("layer", "module_type", run=pl.lit("B")),
        ]
    )
    mixed = module_types.mixed_types(kinds, "run")
    # A run without a single row (no sample taken) is said as such, not as every layer absent.
    empty = tuple(
        tag
        for tag, directory, found in (("A", directory_a, summary_a), ("B", directory_b, summary_b))
        if found.is_empty() and not _holds_a_row(directory)
    )
    frame = ordered(frame, facts_a)
    return Comparison(facts_a, facts_b, window, x, tolerance, frame, mixed, empty, found.opens)


def _read_together(
    files: list[RunFiles],
    selection: Selection,
    tolerance: float,
    facts: tuple[RunFacts, RunFacts],
    x: str,
) -> tuple[pl.DataFrame, pl.DataFrame, Differences]:
    """Both runs' `chunked.summarize_series` frames and their `differences` on `x`, from one
    read of each range (the summaries' latest rows come with the differences; only the
    windows' latest samples are read again, by `chunked.with_windows`), or, where a range of x
    is not a range of samples (`Differences.in_order`), the summaries read by sample."""
    lf_a, lf_b = (scan_files(f, write_order=False) for f in files)
    found = differences(lf_a, lf_b, selection, x, tolerance, facts)
    window = selection.window
    assert window is not None  # set by `compare` from run A's
    if not found.in_order:
        summary_a, summary_b = (summarize_series(lf, selection.rows, window) for lf in (lf_a, lf_b))
        return summary_a, summary_b, found
    summary_a, summary_b = (
        with_windows(lf, selection.rows, window, latest, rows)
        for lf, latest, rows in zip((lf_a, lf_b), found.latest, found.sample_rows, strict=True)
    )
    return summary_a, summary_b, found


def _holds_a_row(directory: Path) -> bool:
    """Whether the run's history holds any row, whatever the selection (its first row only)."""
    found = read_history(directory, lambda lf: lf.head(1).select(pl.len()), write_order=False)
    return found.item() > 0


def warnings_of(c: Comparison) -> list[str]:
    """`warning: ...` lines for runs that were not sampled alike, and for layers of a different
    module type in each (matched by name; said before the table)."""
    run_a, run_b = c.facts_a.run, c.facts_b.run
    sampling_a, sampling_b = sampling(c.facts_a), sampling(c.facts_b)
    out = [
        f"warning: {tag} recorded no samples (its history holds no rows): nothing of it is "
        f"compared, and every series is absent in {tag}."
        for tag in c.no_samples
    ]
    if run_a is None or run_b is None or sampling_a is None or sampling_b is None:
        return out + module_types.run_warnings(c.mixed)
    apart = sampled_differently([("A", sampling_a), ("B", sampling_b)], c.x)
    out += [] if apart is None else [apart]
    restarted = attempts_apart([("A", c.facts_a), ("B", c.facts_b)], c.x, "runs")
    out += [] if restarted is None else [restarted]
    if run_a.history.window != run_b.history.window:
        out.append(
            f"warning: the runs' own windows differ (A: {run_a.history.window}, B: {run_b.history.window}); "
            f"both means here are over up to {plural(c.window, 'sample')} (--window N)."
        )
    return out + module_types.run_warnings(c.mixed)


def _span(first: int | None, last: int | None) -> str:
    return "none" if first is None else (str(first) if first == last else f"{first}-{last}")


def extent_notes(c: Comparison) -> list[str]:
    """One line per tensor and signal whose samples differ between the runs (both have rows),
    in order of where they part: `side grad: sample_id 0-7 in A, 0-3 in B (B stops after 3)`."""
    both = c.frame.filter(pl.col("samples_a") > 0, pl.col("samples_b") > 0)
    for mine, other, at in (("a", "b", c.open_samples[0]), ("b", "a", c.open_samples[1])):
        # It lacks only its open sample's gradient (`first_differences`): no parting.
        both = both.filter(
            ~(pending(f"last_{other}", at) & (pl.col("first_a") == pl.col("first_b")))
            | (pl.col(f"samples_{other}") != pl.col(f"samples_{mine}") + 1)
        )
    parted = (
        both.filter(
            (pl.col("first_a") != pl.col("first_b")) | (pl.col("last_a") != pl.col("last_b"))
        )
        .unique([*TENSOR_KEY, "first_a", "last_a", "first_b", "last_b"], maintain_order=True)
        .with_columns(
            _parts=pl.min_horizontal(
                pl.max_horizontal("first_a", "first_b"), pl.min_horizontal("last_a", "last_b") + 1
            )
        )
        .sort("_parts", maintain_order=True)
    )
    lines = []
    calls = several_calls(c.frame)
    for r in parted.iter_rows(named=True):
        what = []
        for tag, other in (("A", "b"), ("B", "a")):
            mine = tag.lower()
            if r[f"first_{mine}"] > r[f"first_{other}"]:
                what.append(f"{tag} starts at {r[f'first_{mine}']}")
            if r[f"last_{mine}"] < r[f"last_{other}"]:
                what.append(f"{tag} stops after {r[f'last_{mine}']}")
        lines.append(
            f"  {series_name(r, calls)} {signal_short(r['signal'])}: {c.x} "
            f"{_span(r['first_a'], r['last_a'])} in A, {_span(r['first_b'], r['last_b'])} in B "
            f"({', '.join(what)})"
        )
    return lines


def _absent_notes(c: Comparison) -> list[str]:
    """Which layers have rows in one run only (none of the selected series in the other)."""
    out = []
    for tag, mine, other in (("A", "a", "b"), ("B", "b", "a")):
        if ("B" if tag == "A" else "A") in c.no_samples:
            continue  # every layer: said first, as the other run's recording no samples
        by_layer = c.frame.group_by("layer", maintain_order=True).agg(
            mine=pl.col(f"samples_{mine}").max(), other=pl.col(f"samples_{other}").max()
        )
        only = by_layer.filter(pl.col("mine") > 0, pl.col("other") == 0)["layer"].to_list()
        if only:
            names = listed([literal_if_unclear(name) or "<root>" for name in only])
            out.append(
                f"only in {tag} ({plural(len(only), 'layer')}, no row in the other run): {names}."
            )
    return out


def shown_series(c: Comparison, every: bool = False) -> tuple[pl.DataFrame, list[str]]:
    """The rows the text table prints, and the lines that say what it leaves out.

    Up to TEXT_SERIES series, all in traversal order; beyond, unless `every`, the TEXT_SERIES
    that differ earliest (`text.earliest` by first difference: those that differ before those
    that do not), and a line saying how many series (of how many layers) are not shown, how
    many of them differ, and how to see them.
    """
    if every or c.frame.height <= TEXT_SERIES:
        return c.frame, []
    shown, rest = earliest(c.frame, "first_difference", TEXT_SERIES)
    differ = rest.filter(pl.col("first_difference").is_not_null())
    layers = rest.select(pl.col("layer").n_unique()).item()
    head = (
        f"The {TEXT_SERIES} of {plural(c.frame.height, 'series', 'series')} whose first "
        f"difference comes earliest, earliest first (ties in traversal order):"
    )
    tail = (
        f"{rest.height} more series not shown, in {plural(layers, 'layer')} "
        f"({differ.height} of them differ, the others are equal at every matched sample): --all "
        "prints every series, --layers REGEX or --metrics M1,M2 chooses, --format csv holds "
        "every row."
    )
    return shown, [head, tail]


def _notes_said(c: Comparison) -> list[str]:
    """Each run's notes, as `show` begins them (what it did not record, and why), under its
    tag: a comparison never reads past them silently."""
    lines = []
    for tag, facts in (("A", c.facts_a), ("B", c.facts_b)):
        head, *rest = notes_lines(facts.notes) or [""]
        lines += [f"{tag} {head}", *rest] if head else []
    return lines


def _text(c: Comparison, width: int, every: bool = False) -> str:
    """The comparison as an 80-column table with a header that says what each column is
    (beyond TEXT_SERIES series, unless `every`, the earliest to differ: `shown_series`)."""
    lines: list[str] = []
    marks = [
        f"{tag}: {line}; their values are in the windows below"
        for tag, facts in (("A", c.facts_a), ("B", c.facts_b))
        for line in facts.marked_lines()
    ]
    for note in (
        *warnings_of(c),
        f"A: {literal_if_unclear(str(c.facts_a.directory))} ({c.facts_a.state.split(' (')[0]})",
        f"B: {literal_if_unclear(str(c.facts_b.directory))} ({c.facts_b.state.split(' (')[0]})",
        *marks,
        *_notes_said(c),
        *open_lines(c),
        "mean A, mean B: the mean over each run's recent window of up to "
        f"{plural(c.window, 'sample')}.",
        "B - A: their difference (mean B minus mean A).",
        f"first diff: the first {c.x} both runs have where |B - A| > {c.tolerance:g}, only "
        "one value is null (or the nulls' reasons differ), or only one run has a row; '-' = "
        "none.",
        matched_legend("both runs", c.x),
    ):
        lines += textwrap.wrap(note, width)
    if c.frame.is_empty():
        return "\n".join([*lines, "", "(no rows match the selection)"])
    windows = c.frame.filter(pl.col("window_a") != pl.col("window_b"))
    headers = ["layer", "signal", "metric", "mean A", "mean B", "B - A", "first diff", "matched"]

    def cells(r: dict[str, Any]) -> list[str]:
        first = r["first_difference"]
        return [
            "absent" if r["samples_a"] == 0 else number(r["mean_a"]),
            "absent" if r["samples_b"] == 0 else number(r["mean_b"]),
            number(r["difference"]),
            "-" if first is None else str(first),
            str(r["matched_samples"]),
        ]

    shown, limits = shown_series(c, every)
    lines.append("")
    if limits:
        lines += textwrap.wrap(limits[0], width)
    calls = several_calls(c.frame)
    table = series_table(shown, headers, cells, width=width, wrap_first=True, calls=calls)
    lines += table
    for line in limits[1:]:
        lines += textwrap.wrap(line, width)
    present = (pl.col("samples_a") > 0) & (pl.col("samples_b") > 0)
    no_finite = c.frame.filter(
        (pl.col("mean_a").is_null() & (pl.col("samples_a") > 0))
        | (pl.col("mean_b").is_null() & (pl.col("samples_b") > 0))
    )
    notes = []
    if (c.frame["mode"] != "train").any():
        notes.append(
            "[eval]: samples taken in eval mode, a series of their own (compared with the other "
            "run's eval samples only, never with train ones)."
        )
    if no_finite.height:
        notes.append(
            f"'-' in a mean: no finite value in that run's window "
            f"({plural(no_finite.height, 'series', 'series')})."
        )
    absent = _absent_notes(c)
    if absent or c.frame.filter(~present).height:
        notes.append("absent: the series has no row in that run.")
        notes += absent
    if windows.filter(present).height:
        notes.append(
            f"note: the two windows cover different samples for "
            f"{plural(windows.filter(present).height, 'series', 'series')} "
            "(see --format csv: window_a, window_b)."
        )
    for note in notes:
        lines += textwrap.wrap(note, width)
    parted = extent_notes(c)
    if parted:
        lines += textwrap.wrap(
            f"series that stop or start in one run ({plural(len(parted), 'tensor')}, "
            "earliest first; --format csv: first_a, last_a, first_b, last_b):",
            width,
        )
    if len(parted) > TEXT_NOTES and not every:
        more = len(parted) - TEXT_NOTES
        parted = [*parted[:TEXT_NOTES], f"  ... {plural(more, 'more tensor')} (--all: every one)"]
    lines += [
        wrapped
        for line in parted
        for wrapped in textwrap.wrap(line, width, subsequent_indent="    ")
    ]
    return "\n".join(lines)


def open_lines(c: Comparison) -> list[str]:
    """What the comparison says of each live run's open sample (`matching.open_line`): in the
    text's header, and on stderr beside csv and markdown, whose rows cannot hold it."""
    return [
        open_line(t, c.x, at, "difference")
        for t, at in zip("AB", c.open_samples, strict=True)
        if at is not None
    ]


def render(c: Comparison, *, fmt: str, width: int, every_series: bool = False) -> str:
    """The comparison in one of the formats (text: at most TEXT_SERIES series unless
    `every_series`; the machine formats always hold every series)."""
    if fmt == "text":
        return _text(c, width, every_series)
    facts: dict[str, Any] = {
        "a": facts_dict(c.facts_a, c.window),
        "b": facts_dict(c.facts_b, c.window),
        "x": c.x,
        "tolerance": c.tolerance,
        "difference": "mean_b - mean_a",
        "warnings": warnings_of(c),
        "open_samples": {
            t: at for t, at in zip("ab", c.open_samples, strict=True) if at is not None
        },
    }
    return render_frame(c.frame, fmt, facts)


__all__ = [
    "COLUMNS",
    "TEXT_SERIES",
    "Comparison",
    "compare",
    "extent_notes",
    "first_differences",
    "open_lines",
    "render",
    "shown_series",
    "warnings_of",
]
