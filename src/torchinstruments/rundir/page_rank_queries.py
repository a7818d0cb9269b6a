"""The ready Polars queries of a parent of rank runs' index.md (`rundir.page_ranks`): one setup
block that reads every rank as its own page reads it, then per-rank counts, the latest values
side by side, the spread across ranks, and the first departure as `compare PARENT` finds it.

Design decision: the queries are plain code a user runs without the library, so what they tell
of a rank is told by the files and, for a rank not finished, by its run lock, as the page's
table tells it (`lock.writer_ended`): a rank whose process died is never "in progress" in one
and ended in the other.
"""

from __future__ import annotations

from torchinstruments.rundir.cut_finish import finisher_text
from torchinstruments.rundir.layout import STATE_FILE
from torchinstruments.rundir.lock import writer_ended_text
from torchinstruments.rundir.page_history import history_functions
from torchinstruments.rundir.page_sections import quoted as _q

__all__ = ["SHOWN_ROWS", "parent_blocks", "parent_setup"]

SHOWN_ROWS = 50


def parent_setup(parent: str) -> str:
    """The setup block: every rank's history, state and world size, read as each rank's own
    page reads them."""
    return f'''import json
from pathlib import Path

import polars as pl

parent = Path({_q(parent)})


{history_functions()}


def rank_history(directory: Path) -> pl.LazyFrame | None:
    """A rank's rows, as its own index.md reads them; None before its first part."""
    try:
        return history_of(directory)
    except NoPartYet:
        return None


def state_of(directory: Path) -> dict | None:
    """A rank's {STATE_FILE} (None before it has one): its status ("in progress" also for a
    rank whose process died: `rank_state` tells) and its run's world size."""
    state = directory / {_q(STATE_FILE)}
    return json.loads(state.read_text(encoding="utf-8")) if state.is_file() else None


rank_dirs = {{
    int(d.name.removeprefix("rank-")): d
    for d in sorted(parent.glob("rank-*"))
    if d.is_dir() and d.name.removeprefix("rank-").isdigit()
}}
rank_states = {{rank: state_of(d) for rank, d in rank_dirs.items()}}


{writer_ended_text()}


{finisher_text()}


def rank_state(directory: Path, state: dict | None) -> str:
    """A rank's state as the page's table tells it: its state file's status, a rank not
    finished told by its run lock now (its state file says "in progress" also once its
    process died)."""
    if state is None:
        return "no state file"
    if state["status"] != "in progress":
        return state["status"]
    ended = writer_ended(directory)
    if ended is None:
        return "in progress, or its process died (its lock cannot be read here)"
    if not ended:
        return "in progress"
    if state.get("removal_step"):
        return f"not finished: its process ended during {{finisher(state)}} (killed or crashed)"
    return "not finished: its process ended without closing the run (killed or crashed)"


rank_status = {{rank: rank_state(d, rank_states[rank]) for rank, d in rank_dirs.items()}}
world_size = max((s["run"].get("world_size") or 0 for s in rank_states.values() if s), default=0)
no_directory = [rank for rank in range(world_size) if rank not in rank_dirs]
if no_directory:
    print(
        f"missing: no directory for rank {{', '.join(map(str, no_directory))}} (it never "
        "attached, or wrote elsewhere): what it saw is unknown"
    )
histories = {{rank: rank_history(d) for rank, d in rank_dirs.items()}}
unread = [rank for rank, h in histories.items() if h is None]  # said, never read as no rows
if unread:
    print(
        f"left out: rank {{', '.join(map(str, unread))}} wrote no part yet (in progress "
        "before its first sample, or its process died before it); run this block again later"
    )
if len(unread) == len(histories):
    raise SystemExit(f"{{parent}}: no rank has written a part yet; run this block again later")
ranks = pl.concat([h for h in histories.values() if h is not None])  # `rank` tells them apart
# train and eval apart; a layer name of another module type on some rank (a pipeline split) too
SERIES = ["layer", "module_type", "call_index", "signal", "tensor_path", "mode", "metric"]


def show(frame: pl.DataFrame, most: int | None = None) -> None:
    """Print the rows as CSV (full precision, none hidden), or say how many and print `most`."""
    if most is not None and frame.height > most:
        print(f"{{frame.height}} rows, the first {{most}}:")
        frame = frame.head(most)
    print(frame.write_csv(), end="")'''


def parent_blocks(layer: str) -> list[tuple[str, str]]:
    """The other blocks, each `(title, code)`; `layer` is the one the spread block reads."""
    return [
        (
            "Samples and rows per rank, as read at setup (a rank that sampled less, or stopped, "
            "shows here; a rank with no row read has 0 samples and rows where it is known to "
            "hold none, finished or still before its first part, and unknown counts (null) where "
            "its process ended before a row reached the disk, as has one the world size expects "
            "but no directory holds; `state` is as the table above tells "
            'it: a rank not finished is "in progress" while its process holds its run lock, '
            '"not finished: its process ended ..." once none does):',
            """states = pl.LazyFrame(
    {
        "rank": [*rank_dirs, *no_directory],
        "state": list(rank_status.values())
        + ["no directory"] * len(no_directory),
    },
    schema={"rank": pl.Int32, "state": pl.String},
)
per_rank = (
    states.join(
        ranks.group_by("rank").agg(
            samples=pl.col("sample_id").n_unique(), last_sample=pl.col("sample_id").max(), rows=pl.len()
        ),
        on="rank",
        how="left",
    )
    .with_columns(  # no row read: 0 where it holds none (finished, or live); else unknown (null)
        pl.col("samples", "rows").fill_null(
            pl.when(pl.col("state").is_in(["complete", "in progress"])).then(0)
        )
    )
    .sort("rank")
    .collect()
)
show(per_rank)""",
        ),
        (
            "Each rank's latest value of every series of one metric, ranks side by side:",
            f"""latest = (
    ranks.filter(pl.col("metric") == "mean")
    .group_by("rank", *SERIES)
    .agg(pl.col("value").sort_by("sample_id").last())
    .collect()
    .pivot("rank", index=SERIES, values="value", sort_columns=True)
    .sort(SERIES)
)
show(latest, most={SHOWN_ROWS})""",
        ),
        (
            "The spread across ranks at every sample of one layer (min, max, median, ranks):",
            f"""spread = (
    ranks.filter(pl.col("layer") == {_q(layer)}, pl.col("value").is_finite())
    .group_by(*SERIES, "sample_id")
    .agg(
        ranks=pl.len(),
        min=pl.col("value").min(),
        max=pl.col("value").max(),
        median=pl.col("value").median(),
    )
    .sort(SERIES + ["sample_id"])
    .collect()
)
show(spread, most={SHOWN_ROWS})""",
        ),
        (
            "The first sample where one rank departs from the others, as `compare PARENT` "
            "finds it: its nearest other rank's value is farther than X (for two ranks, "
            "|a - b| > X; equal values, two NaN or two like infinities, are 0 apart, a NaN or "
            "an infinity is infinitely far from any other value), or the ranks' rows differ in "
            "what they hold (a null against a value, nulls for different reasons, or no row on a "
            "rank that has the sample, its reason `no row`, but a gradient at the latest sample of "
            "a rank still in progress, which may still come: the ranks not holding what most "
            "ranks hold depart, every rank where no one kind is held by the most):",
            f"""X = 0.0  # <- the departure to look for
METRIC = "mean"  # <- the metric (one at a time: the sort below holds its rows in memory)
at = SERIES + ["sample_id"]
held = pl.when(pl.col("value").is_not_null()).then(pl.lit("a value")).otherwise("unavailable_reason")


def gap(other: pl.Expr) -> pl.Expr:
    value = pl.col("value")
    return pl.when(value == other).then(0.0).otherwise((value - other).abs().fill_nan(float("inf")))


rows = ranks.filter(pl.col("metric") == METRIC)
own = ranks.select("rank", "sample_id").unique()  # each rank's samples: a row of any series
selected = pl.LazyFrame(  # each rank's selected layers, run or not: its state file's run info
    [
        (rank, layer["name"], layer["module_type"])
        for rank, state in rank_states.items()
        if state
        for layer in state["run"]["layers"]
    ],
    schema={{"rank": pl.Int64, "layer": pl.String, "module_type": pl.String}},
    orient="row",
)
if any(not state for state in rank_states.values()):
    print(
        f"rank {{', '.join(str(r) for r, s in rank_states.items() if not s)}}: no state file, "
        "so its selected layers are unknown: a row it lacks is not looked for"
    )
live = [  # ranks in progress: a gradient of their latest sample may still come (open)
    rank
    for rank, d in rank_dirs.items()
    if rank_state(d, state_of(d)).startswith("in progress")  # its lock, told now
]
open_at = own.group_by("rank").agg(open=pl.col("sample_id").max()).filter(pl.col("rank").is_in(live))
still = (pl.col("signal") == "output_gradient") & (pl.col("sample_id") == pl.col("open"))
missing = (  # no row of a series on a rank that has the sample and the layer, another the row
    rows.select(at).unique()
    .join(own, on="sample_id")
    .join(selected, on=["rank", "layer", "module_type"], how="semi")
    .join(rows.select(*at, "rank"), on=[*at, "rank"], how="anti")
    .join(open_at, on="rank", how="left")
    .filter(~still.fill_null(False))  # a live rank's open sample: no "no row" for a gradient
    .drop("open")
    .with_columns(value=pl.lit(None, pl.Float64), unavailable_reason=pl.lit("no row"))
)
nearest = (
    pl.concat([rows, missing], how="diagonal_relaxed")
    .sort(*at, "value")  # nulls first, -inf ... inf, NaN last: equal values are neighbours
    .with_columns(
        below=gap(pl.col("value").shift(1)).over(at),
        above=gap(pl.col("value").shift(-1)).over(at),
        held=held,
    )
    .with_columns(nearest_other=pl.min_horizontal("below", "above"), n=pl.len().over(*at, "held"))
    .with_columns(most=pl.col("n").max().over(at))
    .with_columns(
        kinds=pl.col("held").n_unique().over(at),
        tied=pl.col("held").filter(pl.col("n") == pl.col("most")).n_unique().over(at),
    )
)
apart = (pl.col("kinds") > 1) & ((pl.col("n") < pl.col("most")) | (pl.col("tied") > 1))
first = (
    nearest.filter((pl.col("nearest_other") > X) | apart)
    .sort("sample_id", "rank")
    .group_by(SERIES, maintain_order=True)
    .agg(
        first_sample=pl.col("sample_id").first(),
        rank=pl.col("rank").first(),
        value=pl.col("value").first(),
        unavailable_reason=pl.col("unavailable_reason").first(),
        nearest_other=pl.col("nearest_other").first(),
    )
    .sort("first_sample", *SERIES)
    .collect()
)
print(f"{{first.height}} series of {{METRIC}} where a rank departs by more than {{X}}")
show(first, most={SHOWN_ROWS})""",
        ),
    ]
