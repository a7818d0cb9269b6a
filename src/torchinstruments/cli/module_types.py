"""One layer name, different module types: on different ranks of a parent, or in two runs.

Design decision: a series is named by its layer's qualified name, so the stages of a pipeline
split (rank 0's `layers.0` a Linear, rank 1's `layers.0` a Conv1d) would read as one series and
their values as one spread. The readers of a parent of rank runs keep a series apart per module
type (one row each, over the ranks that have it, named `layers.0 (Linear)` in the text) and say
which layers differ on which ranks; the two-run `compare` matches by name (a model changed
between two runs, GELU for ReLU, is what it is asked to compare) and warns first, naming the
types. Only the first `LISTED` layers are named; the count says how many there are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import polars as pl

from torchinstruments.records import RunInfo
from torchinstruments.rundir.ranges import listed, ranges
from torchinstruments.rundir.shell import literal_if_unclear

__all__ = [
    "LISTED",
    "Mixed",
    "catalog_mixed",
    "mixed_types",
    "rank_lines",
    "run_warnings",
    "said",
    "typed_names",
]

LISTED = 5
_CATALOG = {"layer": pl.String, "module_type": pl.String, "rank": pl.Int64}

# layer -> module type -> where it has that type (ranks, or run labels), in first-seen order.
Mixed = Mapping[str, Mapping[str, Sequence[object]]]


def mixed_types(rows: pl.DataFrame, where: str) -> dict[str, dict[str, list[object]]]:
    """The layers of `rows` (columns layer, module_type, `where`) with more than one module type,
    each type with the values of `where` it appears in (sorted; types in order of the first)."""
    found = rows.select("layer", "module_type", where).unique()
    several = found.group_by("layer").agg(pl.col("module_type").n_unique().alias("_types"))
    found = found.join(several.filter(pl.col("_types") > 1), on="layer", how="semi")
    out: dict[str, dict[str, list[object]]] = {}
    for layer, module_type, at in found.sort("layer", where, "module_type").iter_rows():
        out.setdefault(layer, {}).setdefault(module_type, []).append(at)
    return out


def said(mixed: Mixed, place: Callable[[Sequence[object]], str]) -> str:
    """`layers.0 (Linear on rank 0; Conv1d on rank 1), ... (N more)`: the first LISTED layers of
    `mixed` with each type and where it is (`place` words the ranks or runs)."""
    names = list(mixed)
    each = [
        f"{literal_if_unclear(layer) or '<root>'} ("
        + "; ".join(f"{literal_if_unclear(t)} {place(at)}" for t, at in mixed[layer].items())
        + ")"
        for layer in names
    ]
    return listed(each, LISTED)


def typed_names(frame: pl.DataFrame, layers: Sequence[str]) -> pl.DataFrame:
    """`frame` with each of `layers` named `layer (ModuleType)` in its `layer` column: the text
    view's name for a series kept apart per module type."""
    if not layers:
        return frame
    typed = pl.format("{} ({})", pl.col("layer"), pl.col("module_type"))
    return frame.with_columns(
        layer=pl.when(pl.col("layer").is_in(list(layers))).then(typed).otherwise(pl.col("layer"))
    )


def catalog_mixed(
    ranks: Sequence[tuple[int, RunInfo | None]],
) -> dict[str, dict[str, list[object]]]:
    """`mixed_types` of the ranks' selected layers, from each rank's run info (no history
    read; a rank without one is left out)."""
    rows = [(li.name, li.module_type, rank) for rank, run in ranks if run for li in run.layers]
    return mixed_types(pl.DataFrame(rows, schema=_CATALOG, orient="row"), "rank")


def rank_lines(mixed: Mixed) -> list[str]:
    """The line a parent's text says first when some layer differs in type across ranks."""
    if not mixed:
        return []
    return [
        f"{len(mixed)} layer{'s' if len(mixed) > 1 else ''} of a different module type on "
        "different ranks, kept apart (a row per type, over the ranks that have it, named "
        f"`layer (Type)`): {said(mixed, lambda at: f'on rank {ranges(int(str(r)) for r in at)}')}"
    ]


def run_warnings(mixed: Mixed) -> list[str]:
    """The warning `compare A B` says first when some layer differs in type between the runs."""
    if not mixed:
        return []
    return [
        f"warning: {len(mixed)} layer{'s' if len(mixed) > 1 else ''} of a different module type "
        f"in A and B, compared by name: {said(mixed, lambda at: 'in ' + ' and '.join(map(str, at)))}."
    ]
