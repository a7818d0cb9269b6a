"""`show PARENT`'s text view of a big model: per metric, one row per module type, signal and `at`.

Design decision: the spread across ranks has four rows per tensor and metric (output and
gradient, latest and window), so 100 layers printed per tensor are over 2,000 lines. Like
`show DIR` (`overview.py`), a text table of more than `PARENT_ROWS` rows per metric is grouped:
per metric, one row per (module type, signal and mode, at) with how many tensors it holds, how
many of them have a spread over fewer ranks than were read, the smallest and largest value of
any rank, and the widest spread of one tensor (its max - min across ranks) with that tensor's
farthest rank. Measured values only; which tensor holds them is one `--layers REGEX`, `--all`
or `--format csv` away.
"""

from __future__ import annotations

import textwrap
from itertools import product

import polars as pl

from torchinstruments.cli.overview import OVERVIEW_TENSORS, type_table
from torchinstruments.cli.text import number, plural, signal_short
from torchinstruments.records import SIGNALS
from torchinstruments.rundir.shell import literal_if_unclear

__all__ = ["PARENT_ROWS", "grouped_spread", "spread_rows"]

PARENT_ROWS = OVERVIEW_TENSORS  # the most rows a metric's per-series table has, as `show DIR`'s
_GROUP = ("metric", "module_type", "signal", "mode", "at")
_MODES = ("train", "eval")


def spread_rows(frame: pl.DataFrame) -> int:
    """The rows of the largest metric's per-series table (one per series and `at`)."""
    if frame.is_empty():
        return 0
    return frame.group_by("metric").len()["len"].max()  # type: ignore[return-value]


def _groups(frame: pl.DataFrame, read: int) -> pl.DataFrame:
    """Per metric, module type, signal, mode and `at`: tensors, partial spreads, the smallest
    and largest value of any rank, the widest spread and its farthest rank."""
    width = pl.col("max") - pl.col("min")
    widest = width.fill_null(-1.0).arg_max()
    return frame.group_by(_GROUP, maintain_order=True).agg(
        tensors=pl.len(),
        partial=(pl.col("ranks") < read).sum(),
        low=pl.col("min").min(),
        high=pl.col("max").max(),
        widest=width.max(),
        far=pl.when(width.max().is_not_null()).then(pl.col("farthest_rank").get(widest)),
    )


def grouped_spread(frame: pl.DataFrame, read: int, width: int) -> list[str]:
    """The grouped text view of a parent's spread frame (`rank_spread.Spread.frame`, display order)."""
    groups = _groups(frame, read)
    types = list(dict.fromkeys(frame["module_type"].to_list()))  # traversal order of first use
    headers = ["type", "sig", "at", "tensors", "partial", "min", "max", "widest", "far rank"]
    numeric = [False, False, False, True, True, True, True, True, True]
    tensors = frame.select(pl.struct("layer", "call_index", "tensor_path").n_unique()).item()
    intro = (
        f"{tensors} tensors of {frame['layer'].n_unique()} layers: one row per module type, "
        "signal and at (--all: one row per series)."
    )
    out = ["", *textwrap.wrap(intro, width)]
    for metric in frame["metric"].unique(maintain_order=True).to_list():
        part = groups.filter(pl.col("metric") == metric)
        by_key = {
            (r["module_type"], r["signal"], r["mode"], r["at"]): r
            for r in part.iter_rows(named=True)
        }
        rows = []
        named: set[str] = set()  # a type is named on its first row only (wrapped, never cut)
        for module_type, signal, mode, at in product(types, SIGNALS, _MODES, ("latest", "window")):
            r = by_key.get((module_type, signal, mode, at))
            if r is None:
                continue
            rows.append(
                [
                    "" if module_type in named else literal_if_unclear(module_type),
                    signal_short(signal) + ("" if mode == "train" else f" [{mode}]"),
                    at,
                    str(r["tensors"]),
                    str(r["partial"]),
                    number(r["low"]),
                    number(r["high"]),
                    number(r["widest"]),
                    "-" if r["far"] is None else str(r["far"]),
                ]
            )
            named.add(module_type)
        out += ["", f"{metric}:", *type_table(headers, rows, numeric, width)]
    note = (
        f"Across {plural(read, 'rank')}, per row's tensors: latest = each rank's value at its "
        "latest sample, window = each rank's recent-window mean. partial: tensors whose spread "
        f"is over fewer than the {read} ranks read (the others have a null or nonfinite value "
        "or no row). min, max: the smallest and largest finite value of any rank; widest: the "
        "largest max - min across ranks of one tensor; far rank: that tensor's rank farthest "
        "from its cross-rank median. '-': no finite value. [eval]: samples taken in eval mode, "
        "never summarized with train ones. Every series: --all, --layers REGEX, --rank N or "
        "--format csv."
    )
    return [*out, "", *textwrap.wrap(note, width)]
