"""The ready Polars queries of index.md: one setup block, then queries that each run after it.

Design decisions:

- One setup block defines `run`, `history_of(directory)` (a run's history files listed literally:
  history.parquet once finished, its completed parts while live or after a crash, and both for
  a continued run's live or killed attempt, told apart by `attempt`; Polars with
  `glob=False`, so a name holding `[`, `*` or `?` is read as named), `history`, `show` and
  `writer_ended(directory)` (the run lock probe, `lock.writer_ended_text`: the status and
  comparison queries tell a run whose process died from a live one by it, never trusting the
  state file's "in progress"). Every other block runs after it, in the same Python session, as
  printed; the tests execute them all.
- Results are printed by `show` as CSV: every row the query means, at full precision, never a
  10-row table with the middle hidden. Where a query can mean thousands of rows it says how many
  and prints the first ones, saying so.
- Missing rows are evidence: a layer that stops running, or a branch cut off from the loss
  (its gradient series stop), leaves no null value behind, only rows that are not there. The
  "series that stop" query finds them; the comparison query counts a row present in one run and
  absent in the other as a difference.
- The two-run comparison query (`other_run`, as printed this run itself, so it runs and finds
  nothing) joins the runs on series and sample and lists each series' first differing sample
  (presence flags per run, so a row in one run only differs even when its value is null, but
  a gradient that a run in progress lacks at its open latest sample, from its state file
  and its run lock (a process that ended has none open);
  nulls for different reasons differ, equal values never do, two NaN included: the same rule
  as `compare`, which a test checks series by series),
  the earliest first, ties in the order this run wrote its rows (a forward's layers in
  execution order, outputs before gradients).
- They depend on `RunInfo` only.
"""

from __future__ import annotations

from pathlib import Path

from torchinstruments.records import INTERRUPTED, RunInfo
from torchinstruments.rundir.cut_finish import finisher_text
from torchinstruments.rundir.layout import STATE_FILE
from torchinstruments.rundir.lock import writer_ended_text
from torchinstruments.rundir.page_history import history_functions
from torchinstruments.rundir.page_sections import quoted as _q
from torchinstruments.rundir.shell import tool_span

OTHER_RUN_LINE = 'other_run = run  # <- the run to compare with, e.g. Path("runs/baseline")'
# Both logs are read with every row's schema (infer_schema_length=None): Polars infers it from
# the first 100 rows by default, which left out a metric a longer run logs first later (the
# Trainer's eval_loss) and read one that is empty there as text (Lightning's val_loss).
# The Hugging Face Trainer's log as `scalars`: it logs an optimizer step's loss once
# state.global_step has counted that step, so its `step` is one more than the samples' step.
_HF_LOG = (
    'pl.DataFrame(json.loads(Path("out/trainer_state.json").read_text())["log_history"], '
    "infer_schema_length=None)"
)
HF_SCALARS = f'{_HF_LOG}.filter(pl.col("loss").is_not_null()).with_columns(pl.col("step") - 1)'
# Its evaluations: logged under the global step their forwards ran at, the eval samples' step.
HF_EVAL_SCALARS = f'{_HF_LOG}.filter(pl.col("eval_loss").is_not_null())'
# Lightning's CSVLogger log as `scalars`, one row per step: it writes each logging call's metrics
# in a row of their own, so a validation's (and an epoch's) share the step of a training row, and
# a join with both rows would give that step's samples two rows each.
LIGHTNING_SCALARS = (
    'pl.read_csv("lightning_logs/version_0/metrics.csv", infer_schema_length=None)'
    '.group_by("step", maintain_order=True).agg(pl.all().drop_nulls().first())'
)
# Its validations: run once the global step has counted the optimizer step before them, logged
# under the step before that (its count of batches that stepped), one less than the eval samples'.
LIGHTNING_EVAL_SCALARS = f'{LIGHTNING_SCALARS}.with_columns(pl.col("step") + 1)'
SHOWN_ROWS = 50
# A series' key in the queries: its mode too, so a train and an eval series are never one.
_SERIES = '"layer", "call_index", "signal", "tensor_path", "mode", "metric"'


def _setup(root: str, started_at: str) -> str:
    """The setup block: the run, how to read any run's history, and how results are printed.

    `run` is the directory that holds this run (its state file names the same start time, to the
    second): the
    current directory when Python runs in it (a copy or a moved run), else where the run was
    written; neither, and the block stops saying so, so a query never reads another run.
    """
    return f'''import json
from pathlib import Path

import polars as pl

STARTED_AT = {_q(started_at)}  # this run's start: its {STATE_FILE} says the same
WRITTEN_TO = Path({_q(root)})


def this_run() -> Path:
    """The directory holding this run: the current one (a copy, a moved run), else WRITTEN_TO."""
    for directory in (Path.cwd(), WRITTEN_TO):
        state = directory / {_q(STATE_FILE)}
        if state.is_file():
            started = json.loads(state.read_text(encoding="utf-8"))["run"].get("started_at")
            if started == STARTED_AT:
                return directory
    raise SystemExit(
        f"this page's run (started {{STARTED_AT}}, written to {{WRITTEN_TO}}) is neither in the "
        f"current directory ({{Path.cwd()}}) nor there: start Python in the folder that holds "
        "this index.md, or replace `run = this_run()` with run = Path(...); no other run is read"
    )


run = this_run()


{writer_ended_text()}


{finisher_text()}


{history_functions()}


def show(frame: pl.DataFrame, most: int | None = None) -> None:
    """Print the rows as CSV (full precision, none hidden), or say how many and print `most`."""
    if most is not None and frame.height > most:
        print(f"{{frame.height}} rows, the first {{most}}:")
        frame = frame.head(most)
    print(frame.write_csv(), end="")


history = history_of(run)'''


def _blocks(layer: str) -> list[tuple[str, str]]:
    """(title, code) of every query after the setup block."""
    series = _SERIES
    return [
        (
            f"Status and counts, from `{STATE_FILE}`, and the layers that never ran in a "
            "sampled forward (counts are null while the run is in progress: both are known "
            "once it ends, at removal or `finalize`; meanwhile the next query counts the "
            "layers with rows so far; a run the state file says is in progress whose process "
            "ended, as its run lock tells, is said interrupted, as `show` says it):",
            f"""state = json.loads((run / {_q(STATE_FILE)}).read_text(encoding="utf-8"))
counts = state["counts"]
status = state["status"]  # "in progress" also once its process died: its run lock tells
ended = writer_ended(run) if status == "in progress" else False
if ended and state.get("removal_step"):
    status = (f"interrupted during {{finisher(state)}}: no process holds the run's lock "
              "(killed or crashed); finalize completes it")
elif ended:
    status = ("interrupted: not finished, and no process holds the run's lock (its process "
              "ended without remove_observer: killed, crashed or os._exit); finalize completes it")
elif ended is None:
    status = "in progress, or interrupted (its lock cannot be read here; finalize completes it)"
print("status:", status)
if counts is None and ended is not False:  # nothing counts any more; finalize rebuilds them
    print("counts and the layers that never ran: known once finalize completes the run")
elif counts is None:  # in progress: no layer is known never to run before the run ends
    print("counts and the layers that never ran: known once the run ends")
else:
    print({{k: v for k, v in counts.items() if k != "layer_samples"}})
    if state.get("counts_recovered"):  # a 0 there is what no row said, not a count of none
        print("counts rebuilt from history after the process died: lower bounds, and a 0 is "
              "unknown unless this page's counts line says it is known")
    ran = counts.get("layer_samples", {{}})
    never = [layer["name"] for layer in state["run"]["layers"] if not ran.get(layer["name"])]
    cut = f" (the first {SHOWN_ROWS}: `never` holds all)" if len(never) > {SHOWN_ROWS} else ""
    if state.get("counts_recovered"):  # rebuilt after a crash: only what reached the disk
        print(f"layers with no row on disk: {{len(never)}}{{cut}}", never[:{SHOWN_ROWS}])
    else:
        print(f"layers that never ran in a sampled forward: {{len(never)}}{{cut}}",
              never[:{SHOWN_ROWS}])""",
        ),
        (
            "What has been written so far (rows, samples, latest sample, layers with rows):",
            """written = history.select(
    rows=pl.len(),
    samples=pl.col("sample_id").n_unique(),
    latest_sample=pl.col("sample_id").max(),
    layers=pl.col("layer").n_unique(),
).collect()
show(written)""",
        ),
        (
            "One layer's trend (one metric, by sample; `mode` keeps train and eval samples "
            "apart, each its own series, train first):",
            f"""trend = (
    history.filter(pl.col("layer") == {_q(layer)}, pl.col("signal") == "output",
                   pl.col("metric") == "mean")
    .select("mode", "call_index", "tensor_path", "sample_id", "value", "unavailable_reason")
    .sort(pl.col("mode") != "train", "mode", "call_index", "tensor_path", "sample_id")
    .collect()
)
show(trend)""",
        ),
        (
            "One metric (std of outputs) across all layers at the latest sample:",
            """latest = (
    history.filter(pl.col("signal") == "output", pl.col("metric") == "std")
    .filter(pl.col("sample_id") == pl.col("sample_id").max())
    .select("sample_id", "layer", "call_index", "tensor_path", "value", "unavailable_reason")
    .collect()
)
show(latest)""",
        ),
        (
            "All unavailable values, and why (`rows`: history rows with a null value):",
            """missing = (
    history.filter(pl.col("value").is_null())
    .group_by("layer", "signal", "metric", "unavailable_reason")
    .agg(rows=pl.len(), first_sample=pl.col("sample_id").min())
    .sort("layer", "signal", "metric")
    .collect()
)
show(missing)""",
        ),
        (
            "std of one layer's output vs its output_gradient, side by side (columns: signal; "
            "`mode` keeps train and eval samples apart, train first):",
            f"""both = (
    history.filter(pl.col("layer") == {_q(layer)}, pl.col("metric") == "std")
    .collect()
    .pivot("signal", index=["mode", "call_index", "tensor_path", "sample_id"], values="value")
    .sort(pl.col("mode") != "train", "mode", "call_index", "tensor_path", "sample_id")
)
show(both)""",
        ),
        (
            "Series that stop: missing rows are evidence. A layer that stops running, or a "
            "branch cut off from the loss (e.g. by `.detach()`), leaves no null value: its "
            "series simply end before the latest sample of their mode and signal (`stopped`: a "
            "train output series against the latest train sample, an output_gradient one "
            "against the latest train sample a backward reached; eval likewise), or its outputs "
            "get no gradient row in any sample a backward reached (`no_gradient`). A forward no "
            "backward follows (an evaluation, each token of `generate()`) expects no gradient "
            "and is in neither; a run without backward lists none. `interrupted` marker rows "
            "are no observation:",
            f"""observed = history.filter(pl.col("metric") != {_q(INTERRUPTED)})  # no marker rows
tensor = ["layer", "call_index", "tensor_path", "mode"]
latest_of_mode = (
    observed.group_by("mode", "signal").agg(mode_latest=pl.col("sample_id").max()).collect()
)
series = (
    observed.group_by(*tensor, "signal")
    .agg(
        first_sample=pl.col("sample_id").min(),
        last_sample=pl.col("sample_id").max(),
        samples=pl.col("sample_id").n_unique(),
    )
    .collect()
)
stopped = (
    series.join(latest_of_mode, on=["mode", "signal"])
    .filter(pl.col("last_sample") < pl.col("mode_latest"))
    .sort("last_sample", *tensor, "signal")
)
print("series whose last sample is before the latest of their mode and signal (mode_latest):")
show(stopped)
reached = observed.filter(pl.col("signal") == "output_gradient").select("sample_id").unique()
outputs = (  # outputs of the samples a backward reached: no other expects a gradient
    observed.filter(pl.col("signal") == "output")
    .join(reached, on="sample_id", how="semi")
    .select(tensor)
    .unique()
    .collect()
)
gradients = series.filter(pl.col("signal") == "output_gradient").select(tensor)
no_gradient = outputs.join(gradients, on=tensor, how="anti").sort(tensor)
print("tensors with output rows and no output_gradient row:")
show(no_gradient)""",
        ),
        (
            "One layer's trend by step, joined with the trainer's own logged scalars (loss, "
            "learning rate) on `step`: the trainer's global step in the Lightning and Hugging "
            "Face callbacks, or what `torchinstruments.set_step(model, step)` gave in a plain "
            "loop. Train samples only (`mode`); several samples can share a step (gradient "
            "accumulation). Set `scalars` to your trainer's log, e.g. Lightning's CSVLogger "
            f"`{LIGHTNING_SCALARS}` (one row per step: that logger writes a validation's "
            "metrics, and an epoch's, in rows of their own under the step of a training row, "
            "which would double its samples' rows) or the Hugging Face Trainer's "
            f"`{HF_SCALARS}` (`trainer.save_state()` writes that file, and each checkpoint-N/ "
            "holds one; that Trainer logs what an optimizer step computed under the global "
            "step after it, one more than the `step` of that step's samples: hence the `- 1`; "
            "the filter keeps its training entries: an evaluation's, and the summary at the "
            "end of training, share a step with one and would double its samples' rows). "
            'Evaluation samples (`record_eval`): keep `pl.col("mode") == "eval"` and '
            f"join Lightning's `{LIGHTNING_EVAL_SCALARS}` (Lightning validates once the global "
            "step has counted the optimizer step before, and logs the validation under the step "
            "before it, one less than the `step` of its samples: hence the `+ 1`; not so "
            "for a validation between the micro-batches of an accumulated step, which it logs "
            "under its samples' own step: a note above names the first) or the "
            f"Hugging Face Trainer's evaluations, `{HF_EVAL_SCALARS}` (it logs an evaluation "
            "under the step its samples carry). As printed it is an empty table (its columns: "
            "null):",
            f"""scalars = pl.DataFrame(schema={{"step": pl.Int64, "loss": pl.Float64}})  # <- your log
by_step = (
    history.filter(pl.col("layer") == {_q(layer)}, pl.col("signal") == "output",
                   pl.col("metric") == "std", pl.col("mode") == "train",
                   pl.col("step").is_not_null())
    .select("step", "sample_id", "call_index", "tensor_path", "value")
    .collect()
    .join(scalars.with_columns(pl.col("step").cast(pl.Int64)), on="step", how="left")
    .sort("step", "sample_id", "call_index", "tensor_path")
)
show(by_step, most={SHOWN_ROWS})""",
        ),
        (
            "Compare this run with another one (e.g. a baseline with the same seed and data): "
            "per series, the first sample where the two differ by more than `tolerance` "
            "(equal values never do, two NaN included), where a row or a value exists in one "
            "run only, or where both are null for different reasons (samples both runs have; `row`, "
            "`row_other` say which run has a row, so one there is a difference whatever its "
            "value, a null included, but a gradient a run in progress lacks at its latest sample, "
            "which may still come; `interrupted` marker rows are no series); the first "
            "row departs first (earliest sample, then this run's write order: a forward's "
            "layers in execution order, outputs before gradients; a row of the other run only, by "
            "name). It joins the runs a range of samples at a time (about `CHUNK_ROWS` of this "
            "run's rows), so its memory is bounded by a range, not by the runs' length. Set "
            "`other_run`; as printed "
            "it is this run, which differs from itself nowhere. "
            "`compare` (above) prints the same per series, with window means:",
            f"""{OTHER_RUN_LINE}
tolerance = 0.0  # the largest |difference| that is not a difference
series = [{series}]
other = history_of(other_run)
common = history.select("sample_id").unique().join(
    other.select("sample_id").unique(), on="sample_id"
).collect().lazy()  # every sample both runs have, whatever rows a filter below keeps
measured = pl.col("metric") != {_q(INTERRUPTED)}  # marker rows are no series


def open_sample(directory: Path, rows: pl.LazyFrame) -> int | None:
    # A run in progress: its latest sample, still open (its gradients may still come), but
    # not once its process ended (killed: no process holds its lock; nothing can still come).
    state = directory / {_q(STATE_FILE)}
    status = json.loads(state.read_text(encoding="utf-8"))["status"] if state.is_file() else None
    if status != "in progress" or writer_ended(directory):
        return None
    return rows.select(pl.col("sample_id").max()).collect().item()


open_mine, open_other = open_sample(run, history), open_sample(other_run, other)
pending = (pl.col("signal") == "output_gradient") & (  # a gradient an open sample lacks
    (~pl.col("row") & (pl.col("sample_id") == pl.lit(open_mine, pl.Int64)))
    | (~pl.col("row_other") & (pl.col("sample_id") == pl.lit(open_other, pl.Int64)))
).fill_null(False)
ranges, low, held = [], None, 0  # ranges of common samples, about CHUNK_ROWS of this run's rows
CHUNK_ROWS = 500_000  # each range is joined on its own: memory bounded by a range, not the run
per_sample = (
    history.group_by("sample_id").agg(rows=pl.len())
    .join(common, on="sample_id", how="semi").sort("sample_id").collect()
)
for sample, rows in per_sample.iter_rows():
    low, held = sample if low is None else low, held + rows
    if held >= CHUNK_ROWS:
        ranges.append((low, sample))
        low, held = None, 0
if low is not None:
    ranges.append((low, sample))


def first_in(low: int, high: int) -> pl.DataFrame:
    # Each series' first differing row among the samples from low to high.
    span = pl.col("sample_id").is_between(low, high)  # reaches the scans: only the range is read
    mine = history.filter(span).with_row_index("order").filter(measured).select(
        *series, "sample_id", "order", "value", "unavailable_reason", row=pl.lit(True)
    )  # order: write order within a sample, as this run holds its rows
    theirs = other.filter(span, measured).select(
        *series, "sample_id", value_other="value", reason_other="unavailable_reason",
        row_other=pl.lit(True)
    )
    differ = (
        mine.join(theirs, on=[*series, "sample_id"], how="full", coalesce=True)
        .join(common, on="sample_id", how="semi")
        .with_columns(pl.col("row", "row_other").fill_null(False))
        .filter(~pending)
        .filter(
            (pl.col("row") != pl.col("row_other"))  # a row in one run only, whatever its value
            | (pl.col("value").is_null() != pl.col("value_other").is_null())
            | (pl.col("unavailable_reason") != pl.col("reason_other"))  # nulls, other reasons
            | (  # equal values never differ: two NaN, or two like infinities, included
                (pl.col("value") != pl.col("value_other"))
                & ((pl.col("value") - pl.col("value_other")).abs() > tolerance)
            )
        )
    )
    earliest = differ.sort("sample_id", "order", *series, nulls_last=True)  # series: ties
    return earliest.group_by(series, maintain_order=True).first().collect()


found = [first_in(low, high) for low, high in ranges] or [first_in(0, -1)]
first = (
    pl.concat(found)  # the ranges in sample order: a series' first range holds its first row
    .group_by(series, maintain_order=True)
    .first()
    .sort("sample_id", "order", *series, nulls_last=True)  # rows of the other run only: by name
    .select(*series, first_sample="sample_id", row="row", row_other="row_other",
            value="value", value_other="value_other", reason="unavailable_reason",
            reason_other="reason_other")
)
print(f"{{first.height}} series differ (row, row_other: whether that run has a row there)")
show(first)  # every differing series, the earliest first""",
        ),
    ]


def section_queries(run: RunInfo) -> list[str]:
    root = Path(run.output_dir).as_posix()
    layer = run.layers[0].name if run.layers else ""
    lines = [
        "## Ready Polars queries",
        "",
        "Run the setup block first, then any other block in the same Python session; each "
        "runs as printed, on a finished run (history.parquet) and on a live or crashed one "
        "(its completed parts), and prints every row it means as CSV. The setup block reads "
        "this run where Python runs, if it is there (a copied or moved run directory), else "
        "where it was written, and stops if neither holds it.",
        "",
        "From a shell in this run's directory (the one holding this index.md; the interpreter is "
        "the one that wrote the run): "
        + tool_span("show", ".")
        + " (latest values and window means), "
        + tool_span("compare", "OTHER_RUN", ".")
        + ", "
        + tool_span("plot", ".")
        + " (writes trends.png here; `-o FILE` elsewhere), "
        + tool_span("heatmap", ".")
        + " (one image per metric, every tensor by every sample: `heatmap-<metric>.png` here; "
        "`-o DIR` elsewhere).",
        "",
        "Setup:",
        "",
        "```python",
        _setup(root, run.started_at),
        "```",
        "",
    ]
    for title, code in _blocks(layer):
        lines += [title, "", "```python", code, "```", ""]
    series = _SERIES
    lines += ["Ranks: with rank_policy='all' every rank writes its own `rank-NNN/` directory."]
    if run.rank is not None and run.rank_policy == "all":
        parent = Path(run.output_dir).parent.as_posix()
        lines += [
            "Compare the ranks (every row carries its rank; after setup; each read as "
            "`history_of` reads a run, a live one as far as it has written, and one with no "
            "part yet named as left out, as is one this rank's world size expects but no "
            "directory holds): "
            "each rank's mean over its samples of every series (layer, call, signal, tensor "
            "path, mode, metric; a train and an eval series apart), ranks side by side:",
            "",
            "```python",
            f"""rank_histories, left_out = [], []
for directory in sorted(d for d in Path({_q(parent)}).glob("rank-*") if d.is_dir()):
    try:
        rank_histories.append(history_of(directory))  # a live rank: what it has written
    except NoPartYet:  # said, never read as a rank without rows
        left_out.append(directory.name)
if left_out:
    print(
        f"left out: {{', '.join(left_out)}} wrote no part yet (in progress before its first "
        "sample, or its process died before it)"
    )
no_directory = [  # of this rank's world size
    r for r in range({run.world_size or 0}) if not (Path({_q(parent)}) / f"rank-{{r:03d}}").is_dir()
]
if no_directory:
    print(
        f"missing: no directory for rank {{', '.join(map(str, no_directory))}} (it never "
        "attached, or wrote elsewhere): what it saw is unknown"
    )
ranks = pl.concat(rank_histories)
series = [{series}]
by_rank = (
    ranks.group_by("rank", *series)
    .agg(pl.col("value").mean(), samples=pl.col("sample_id").n_unique())
    .sort(*series, "rank")
    .collect()
)
show(by_rank, most={SHOWN_ROWS})""",
            "```",
        ]
    else:
        lines.append(
            "Compare two of them with "
            + tool_span("compare", "stats/rank-000", "stats/rank-001")
            + ", or "
            'scan their history.parquet files together and group by `"rank"`.'
        )
    return [*lines, ""]


__all__ = [
    "HF_EVAL_SCALARS",
    "HF_SCALARS",
    "LIGHTNING_EVAL_SCALARS",
    "LIGHTNING_SCALARS",
    "OTHER_RUN_LINE",
    "SHOWN_ROWS",
    "section_queries",
]
