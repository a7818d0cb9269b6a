"""`torchinstruments compare DIR_A DIR_B`: two matched runs side by side, as measured differences.

Design decisions:

- Per series (layer, call, signal, tensor path, metric): each run's recent-window mean (the same
  definition as `show` and result.json, over each run's own latest samples), their difference
  `B - A`, and the first sample at which the two runs differ by more than `--tolerance`.
- Samples are matched on `sample_id` (runs sampled with `EveryNForwardsSampler` on the same
  schedule: sample k is the same step in both) or on `forward_index` (`--x forward_index`, e.g.
  ranks whose samplers differ). A series measured twice in one sample (two backwards) is matched
  occurrence by occurrence.
- "Differ" means `|B - A| > tolerance`, or a value in one run and a null in the other. Only
  measured differences: no verdicts, scores or thresholds of our own (the default tolerance is 0,
  i.e. any difference).
- Rank directories (`stats/rank-000`, `stats/rank-001`) are two runs like any others.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.cli.reader import SERIES_KEY, RunFacts, read_history, select, window_of
from torchinstruments.cli.show import Selection, facts_dict, ordered, summary
from torchinstruments.cli.text import number, plural, render_frame, table
from torchinstruments.records import OUTPUT

COLUMNS = (
    "layer",
    "module_type",
    "call_index",
    "signal",
    "tensor_path",
    "metric",
    "mean_a",
    "mean_b",
    "difference",
    "window_a",
    "window_b",
    "matched_samples",
    "first_difference",
    "value_a_at_first_difference",
    "value_b_at_first_difference",
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


def _matched_values(directory: Path, selection: Selection, x: str) -> pl.DataFrame:
    """Series key, x, occurrence number within (series, x), and value."""
    return read_history(
        directory,
        lambda lf: (
            select(
                lf,
                layers=selection.layers,
                signals=selection.signals,
                metrics=selection.metrics,
            )
            .sort(x, "_write_order")
            .with_columns(_occurrence=pl.int_range(pl.len()).over(*SERIES_KEY, x))
            .select(*SERIES_KEY, x, "_occurrence", "value")
        ),
    )


def first_differences(a: pl.DataFrame, b: pl.DataFrame, x: str, tolerance: float) -> pl.DataFrame:
    """Per series: matched samples, and the first x (with both values) where A and B differ."""
    keys = [*SERIES_KEY, x, "_occurrence"]
    joined = a.join(b, on=keys, how="inner", suffix="_b", nulls_equal=True).rename(
        {"value": "value_a"}
    )
    one_null = pl.col("value_a").is_null() != pl.col("value_b").is_null()
    differ = one_null | ((pl.col("value_b") - pl.col("value_a")).abs() > tolerance)
    first = pl.col(x).filter(differ).min()
    at_first = differ & (pl.col(x) == first)
    return joined.group_by(SERIES_KEY).agg(
        matched_samples=pl.col(x).n_unique(),
        first_difference=first,
        value_a_at_first_difference=pl.col("value_a").filter(at_first).first(),
        value_b_at_first_difference=pl.col("value_b").filter(at_first).first(),
    )


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
        raise ValueError(f"tolerance={tolerance!r} is not allowed: expected a number >= 0")
    facts_a, summary_a = summary(directory_a, selection)
    window = window_of(facts_a, selection.window)
    selection = Selection(selection.layers, selection.signals, selection.metrics, window)
    facts_b, summary_b = summary(directory_b, selection)

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
    diffs = first_differences(
        _matched_values(directory_a, selection, x),
        _matched_values(directory_b, selection, x),
        x,
        tolerance,
    )
    frame = (
        both.join(diffs, on=SERIES_KEY, how="left", nulls_equal=True)
        .with_columns(
            module_type=pl.coalesce("module_type_a", "module_type_b"),
            difference=pl.col("mean_b") - pl.col("mean_a"),
            matched_samples=pl.col("matched_samples").fill_null(0),
        )
        .select(COLUMNS)
    )
    return Comparison(facts_a, facts_b, window, x, tolerance, ordered(frame, facts_a))


def _text(c: Comparison, width: int) -> str:
    """The comparison as an 80-column table with a header that says what each column is."""
    lines: list[str] = []
    marks = [
        f"{tag}: {line}; their values are in the windows below"
        for tag, facts in (("A", c.facts_a), ("B", c.facts_b))
        for line in facts.marked_lines()
    ]
    for note in (
        f"A: {c.facts_a.directory} ({c.facts_a.state.split(' (')[0]})",
        f"B: {c.facts_b.directory} ({c.facts_b.state.split(' (')[0]})",
        *marks,
        "mean A, mean B: the mean over each run's recent window of up to "
        f"{plural(c.window, 'sample')}.",
        "B - A: their difference (mean B minus mean A).",
        f"first diff: the first {c.x} (of the matched ones) where |B - A| > {c.tolerance:g} or "
        f"only one value is null; '-' = none. matched: how many samples were measured in both "
        f"runs (matched on {c.x}).",
    ):
        lines += textwrap.wrap(note, width)
    if c.frame.is_empty():
        return "\n".join([*lines, "", "(no rows match the selection)"])
    windows = c.frame.filter(pl.col("window_a") != pl.col("window_b"))
    headers = ["layer", "signal", "metric", "mean A", "mean B", "B - A", "first diff", "matched"]
    numeric = [False, False, False, True, True, True, True, True]
    several_calls = set(c.frame.filter(pl.col("call_index") > 0)["layer"].to_list())
    rows = []
    for r in c.frame.iter_rows(named=True):
        name = r["layer"] or "<root>"
        if r["layer"] in several_calls:
            name += f"#{r['call_index']}"
        first = r["first_difference"]
        rows.append(
            [
                name + r["tensor_path"],
                "out" if r["signal"] == OUTPUT else "grad",
                r["metric"],
                number(r["mean_a"]),
                number(r["mean_b"]),
                number(r["difference"]),
                "-" if first is None else str(first),
                str(r["matched_samples"]),
            ]
        )
    whole = [False, False, True, False, False, False, False, False]
    lines += ["", *table(headers, rows, numeric=numeric, width=width, whole=whole)]
    only = c.frame.filter(pl.col("mean_a").is_null() | pl.col("mean_b").is_null())
    notes = []
    if only.height:
        notes.append(f"'-' in a mean: no finite value in that run ({only.height} series).")
    if windows.height:
        notes.append(
            f"note: the two windows cover different samples for {plural(windows.height, 'series', 'series')} "
            "(see --format csv: window_a, window_b)."
        )
    for note in notes:
        lines += textwrap.wrap(note, width)
    return "\n".join(lines)


def render(c: Comparison, *, fmt: str, width: int) -> str:
    """The comparison in one of the formats."""
    if fmt == "text":
        return _text(c, width)
    facts: dict[str, Any] = {
        "a": facts_dict(c.facts_a, c.window),
        "b": facts_dict(c.facts_b, c.window),
        "x": c.x,
        "tolerance": c.tolerance,
        "difference": "mean_b - mean_a",
    }
    return render_frame(c.frame, fmt, facts)


__all__ = ["COLUMNS", "Comparison", "compare", "first_differences", "render"]
