"""index.md: what a run directory holds and how to read it, for a person and for an LLM.

Design decision: the page is rendered from `RunInfo` (and `RunCounts` at removal) only, never
from the data, so it can be written at injection, before any sample exists, and rewritten at
removal in constant time. It embeds the `RunInfo` fields as a JSON block between fixed markers, so
`torchinstruments finalize` can rebuild the page after a crash without the Python process that
started the run. The cost: the page must be kept in step with the schema and the summary by hand;
the tests execute every query in it against a real history.parquet to catch drift.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from torchinstruments.reasons import REASONS
from torchinstruments.records import LayerInfo, RunCounts, RunInfo
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    HISTORY_SCHEMA,
    INDEX_FILE,
    PARTS_DIR,
    write_text_atomic,
)
from torchinstruments.rundir.shell import code_span, command_span

RUN_INFO_BEGIN = "<!-- torchinstruments:run-info:begin -->"
RUN_INFO_END = "<!-- torchinstruments:run-info:end -->"
STATE_COMPLETE = "<!-- torchinstruments:state:complete -->"
STATE_IN_PROGRESS = "<!-- torchinstruments:state:in-progress -->"
STATE_INCOMPLETE = "<!-- torchinstruments:state:incomplete -->"
STATE_INTERRUPTED = "<!-- torchinstruments:state:interrupted -->"
# The rows the live run recorded, written at removal: finalize compares history.parquet with it.
ROWS_RECORDED = "<!-- torchinstruments:rows-recorded:{} -->"
_ROWS_RECORDED_RE = re.compile(r"<!-- torchinstruments:rows-recorded:(\d+) -->")

COLUMN_NOTES = {
    "sample_id": "0-based count of sampled root forwards; the x-axis of every trend",
    "forward_index": "0-based count of all root forwards (sampled or not) when the sample was taken",
    "timestamp": "UTC time at which the tensor was measured",
    "rank": "torch.distributed rank; null outside torch.distributed",
    "layer": 'qualified module name from named_modules() (root = "")',
    "module_type": "class name of the module",
    "call_index": "n-th call (from 0) of this layer inside one sampled root forward",
    "signal": '"output" or "output_gradient"',
    "tensor_path": 'where the tensor sits in the output, in Python accessor syntax ("" = bare tensor)',
    "shape": "shape of the measured tensor",
    "dtype": 'torch dtype without the "torch." prefix, e.g. float32',
    "mode": '"train" or "eval": the layer\'s module.training at that call',
    "grad_enabled": "torch.is_grad_enabled() during the forward",
    "metric": "metric name (see Metrics)",
    "value": "the metric; null only together with unavailable_reason, never silently 0",
    "unavailable_reason": "why value is null; non-null exactly when value is null",
}

METRIC_NOTES = (
    ("mean", "mean of the finite entries"),
    ("std", "population standard deviation (divide by N, not N-1) of the finite entries"),
    ("min / max", "smallest / largest finite entry"),
    (
        "p25 / p50 / p75",
        "quartiles of the finite entries with linear interpolation (numpy.percentile's default)",
    ),
    ("zero_fraction", "entries equal to 0, divided by the original element count"),
    ("nonfinite_fraction", "NaN and +-inf entries, divided by the original element count"),
)


def _q(text: str) -> str:
    """A Python string literal (double-quoted) for `text`."""
    return json.dumps(text, ensure_ascii=False)


def _run_info_json(run: RunInfo) -> str:
    """The RunInfo fields as indented JSON."""
    data: dict[str, Any] = {}
    for f in fields(RunInfo):
        value = getattr(run, f.name)
        if f.name == "output_dir":
            value = Path(value).as_posix()
        elif f.name == "layers":
            value = [{"name": li.name, "module_type": li.module_type} for li in value]
        elif isinstance(value, tuple):
            value = list(value)
        data[f.name] = value
    return json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False)


def _section_run(run: RunInfo, counts: RunCounts | None, recovered: bool) -> list[str]:
    layers = ", ".join(f"`{li.name or '<root>'}` ({li.module_type})" for li in run.layers)
    focus = ", ".join(f"`{name or '<root>'}`" for name in run.focus_layers) or "none"
    rank = "not distributed" if run.rank is None else f"rank {run.rank} of {run.world_size}"
    lines = [
        "## Run",
        "",
        f"- output_dir: {code_span(Path(run.output_dir).as_posix())}; started at {run.started_at}",
        f"- torchinstruments {run.library_version}, torch {run.torch_version}",
        f"- model class: `{run.model_class}`",
        f"- selected layers ({len(run.layers)}, traversal order): {layers or 'none'}",
        f"- focus layers (TensorBoard histograms): {focus}",
        f"- sampler: {run.sampler}",
        f"- metrics: {', '.join(run.metrics)}",
        f"- {rank}; rank_policy={run.rank_policy!r}",
        f"- capture_direct_forwards={run.capture_direct_forwards}, "
        f"buffer_rows={run.buffer_rows}, flush_seconds={run.flush_seconds}, window={run.window}",
    ]
    if counts is None:
        lines.append(
            "- counts: the run is in progress (history.parquet and the summaries in "
            "result.json appear at removal; read history.parts/ meanwhile)"
        )
    else:
        bound = (
            " (lower bounds: rebuilt from history after an interrupted run)" if recovered else ""
        )
        lines.append(
            f"- counts{bound}: {counts.root_forwards} root forwards, {counts.samples} samples, "
            f"{counts.backward_samples} samples with a backward"
        )
    return [*lines, ""]


def _section_layers(run: RunInfo, counts: RunCounts | None, recovered: bool) -> list[str]:
    """Per selected layer, in how many sampled forwards it ran; the layers that never did."""
    if counts is None:
        return []
    bound = " (lower bounds, rebuilt from history)" if recovered else ""
    lines = [
        "## Layers",
        "",
        f"Sampled forwards in which each selected layer was called{bound}, out of "
        f"{counts.samples}. A layer with 0 never ran in a sampled forward: it has no rows "
        "(a branch not taken, a module its parent never calls, a `forward` replaced after "
        "injection). In eval under no_grad, an `nn.TransformerEncoderLayer` holding selected "
        "layers runs layer by layer in sampled forwards (as it does when a hook is attached) "
        "instead of as one fused kernel that would skip them; unsampled forwards keep the fused "
        "kernel.",
        "",
        "| layer | module_type | sampled forwards |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| `{li.name or '<root>'}` | {li.module_type} | {counts.layer_samples.get(li.name, 0)} |"
        for li in run.layers
    ]
    never = [li.name or "<root>" for li in run.layers if not counts.layer_samples.get(li.name)]
    if never and counts.samples:
        lines += ["", f"Never ran in a sampled forward ({len(never)}): "]
        lines[-1] += ", ".join(f"`{name}`" for name in never)
    return [*lines, ""]


def _section_files(run: RunInfo) -> list[str]:
    return [
        "## Files",
        "",
        f"- `{PARTS_DIR}/`: Parquet chunks of <= buffer_rows rows, each written atomically "
        "(temporary name, then rename) while the run is live, when the buffer holds "
        "buffer_rows rows or its oldest row is flush_seconds / 2 old; merged and removed at the "
        "end. A crash (SIGKILL, out of memory) loses at most the rows of the last flush_seconds; "
        "SIGTERM writes them first, then ends the process as before.",
        f"- `{HISTORY_FILE}`: the whole history, one row per scalar, sorted by sample_id, "
        "signal, layer, call_index, tensor_path, metric.",
        "- `result.json`: one record per selected layer (traversal order); at injection with an "
        "empty `tensors` list, at removal with per-tensor summaries (see result.json).",
        "- `index.md`: this page. `tensorboard/`: histograms of the focus layers. `.lock`: held "
        "by the live process; `torchinstruments finalize` refuses a directory while it is held.",
        "",
        "If the process died, "
        + command_span("python", "-m", "torchinstruments", "finalize", run.output_dir)
        + " merges the completed parts and writes result.json "
        "and index.md; counts are then lower bounds (root forwards = max forward_index + 1).",
        "",
    ]


def _section_schema() -> list[str]:
    lines = ["## history schema (one row per scalar)", "", "| column | type | meaning |"]
    lines.append("| --- | --- | --- |")
    for name, dtype in HISTORY_SCHEMA.items():
        lines.append(f"| {name} | {dtype} | {COLUMN_NOTES[name]} |")
    return [*lines, ""]


def _section_meanings() -> list[str]:
    lines = [
        "## Signals, tensor paths, calls",
        "",
        '- signal `"output"`: a tensor returned by the layer\'s forward. '
        '`"output_gradient"`: the gradient of the loss with respect to that output tensor, '
        "recorded when backward reaches it (same sample_id as its forward).",
        '- tensor_path: `""` the output is a bare tensor; `[0]` first element of a tuple or '
        "list; `['logits']` dict key; `.hidden` attribute (dataclass / named tuple / model "
        "output object); `[1]['k']` nested. Non-tensor leaves are skipped.",
        "- call_index: the n-th invocation (from 0) of a shared layer inside one sampled root "
        "forward; a layer called 3 times per forward has call_index 0, 1, 2.",
        "- root forward: the outermost call of the observed model, via `model(x)` or "
        "`model.forward(x)`. A call of the model inside its own forward belongs to the "
        "enclosing root forward (not counted again; the next call_index if the model is itself "
        "a selected layer). A selected layer called outside any root forward is not observed.",
        "- capture_direct_forwards=False: calls that bypass `nn.Module.__call__` "
        "(`module.forward(x)`) are neither root forwards nor measured; the proxy tells them "
        "apart by its caller's frame (`nn.Module._call_impl` or not).",
        "",
        "## Unavailable reasons (value is null)",
        "",
    ]
    lines += [f"- `{reason.template}`: {reason.meaning}" for reason in REASONS]
    lines += [
        "",
        "## Metrics",
        "",
        "All metrics are computed over the finite entries of the tensor, in float64 for "
        "integer and bool tensors and in float32 or better for low-precision floats:",
        "",
    ]
    lines += [f"- `{name}`: {meaning}" for name, meaning in METRIC_NOTES]
    lines += [
        "- other names: custom scalar reducers given at injection.",
        "",
        "## Not collected",
        "",
        "Inputs of layers, parameters and parameter gradients, losses, optimizer updates and "
        "learning rates are not recorded: only layer outputs and the gradients flowing into "
        "them. Unsampled forwards leave no trace.",
        "",
    ]
    return lines


def _section_result(run: RunInfo) -> list[str]:
    w = run.window
    return [
        "## result.json",
        "",
        "`[{layer, module_type, sampled_forwards, tensors: [{call_index, signal, tensor_path, "
        "shape, dtype, metrics: {name: {observations, valid, first, latest, min, max, previous, "
        "recent}}}]}]`. Every selected layer is listed, in traversal order, also if it never ran "
        "(`tensors: []`); tensors are sorted by (call_index, signal, tensor_path); shape and "
        "dtype are the latest seen.",
        "",
        "- sampled_forwards: in how many sampled forwards the layer was called (0: it never ran "
        "in one; null in the catalog written at injection). After an interrupted run it is "
        "rebuilt from history: the sampled forwards with an output row of the layer.",
        "- observations: history rows of this tensor-metric; valid: those with a non-null value.",
        "- first / latest: `{value, sample_id}` of the earliest / latest observation (value may "
        "be null: see unavailable_reason in history).",
        "- min / max: `{value, sample_id}` of the smallest / largest finite value, earliest "
        "sample on ties; null when no value is valid.",
        f"- windows: over this tensor-metric's own samples (sample_ids where it was observed), "
        f"newest first: `recent` = the latest {w}, `previous` = the {w} before them. Each has "
        "`mean` (mean of its finite values, null if none), `actual` (samples in it, fewer than "
        f"{w} early on), `valid` (non-null values), `first_sample_id`, `last_sample_id`.",
        "- A window mean averages per-sample statistics (e.g. the mean of 10 per-sample stds); "
        "it is not the statistic of the pooled elements of those samples.",
        "",
    ]


def _files_preamble(root: str) -> str:
    """The first lines of every query: the run's history files, listed literally.

    history.parquet once the run is finished, else the completed parts of a live (or crashed)
    run. The files are listed with pathlib and passed to Polars with `glob=False`, so a run
    directory whose name holds `[`, `*` or `?` is read as it is named.
    """
    return f"""from pathlib import Path

import polars as pl

run = Path({_q(root)})
# the whole history once the run is finished; its completed parts while it is live
files = [run / {_q(HISTORY_FILE)}] if (run / {_q(HISTORY_FILE)}).exists() else sorted(
    (run / {_q(PARTS_DIR)}).glob("part-*.parquet")
)"""


def _queries(run: RunInfo) -> list[str]:
    root = Path(run.output_dir).as_posix()
    layer = run.layers[0].name if run.layers else ""
    head = _files_preamble(root)
    guard = """if not files:
    raise SystemExit(f"{run}: no sample written yet (a part appears every buffer_rows rows)")
history = pl.scan_parquet(files, glob=False)"""
    blocks = [
        (
            "One layer's trend (one metric, by sample):",
            f"""{head}
{guard}
trend = (
    history.filter(pl.col("layer") == {_q(layer)}, pl.col("signal") == "output",
                   pl.col("metric") == "mean")
    .select("sample_id", "call_index", "tensor_path", "value", "unavailable_reason")
    .sort("sample_id", "call_index", "tensor_path")
    .collect()
)
print(trend)""",
        ),
        (
            "One metric (std of outputs) across all layers at the latest sample:",
            f"""{head}
{guard}
latest = (
    history.filter(pl.col("signal") == "output", pl.col("metric") == "std")
    .filter(pl.col("sample_id") == pl.col("sample_id").max())
    .select("sample_id", "layer", "call_index", "tensor_path", "value", "unavailable_reason")
    .collect()
)
print(latest)""",
        ),
        (
            "All unavailable values, and why (`rows`: history rows with a null value):",
            f"""{head}
{guard}
missing = (
    history.filter(pl.col("value").is_null())
    .group_by("layer", "signal", "metric", "unavailable_reason")
    .agg(rows=pl.len(), first_sample=pl.col("sample_id").min())
    .sort("layer", "signal", "metric")
    .collect()
)
print(missing)""",
        ),
        (
            "std of one layer's output vs its output_gradient, side by side (columns: signal):",
            f"""{head}
{guard}
both = (
    history.filter(pl.col("layer") == {_q(layer)}, pl.col("metric") == "std")
    .collect()
    .pivot("signal", index=["sample_id", "call_index", "tensor_path"], values="value")
    .sort("sample_id")
)
print(both)""",
        ),
        (
            "What has been written so far (works while the run is live, after it finished, and "
            "before the first part, when it says so):",
            f"""{head}
if files:
    written = (
        pl.scan_parquet(files, glob=False)
        .group_by("layer", "signal", "metric")
        .agg(latest_sample=pl.col("sample_id").max(), rows=pl.len())
        .sort("layer", "signal", "metric")
        .collect()
    )
    print(f"{{len(files)}} file(s):", written, sep="\\n")
else:
    print(f"{{run}}: no sample written yet (a part appears every buffer_rows rows)")""",
        ),
    ]
    lines = [
        "## Ready Polars queries",
        "",
        "Each block runs as is, on a finished run (history.parquet) and on a live or crashed one "
        "(its completed parts). From a shell: "
        + command_span("torchinstruments", "show", run.output_dir)
        + " (latest values and window means), `torchinstruments compare DIR_A DIR_B`, "
        + command_span("torchinstruments", "plot", run.output_dir)
        + ".",
        "",
    ]
    for title, code in blocks:
        lines += [title, "", "```python", code, "```", ""]
    lines += ["Ranks: with rank_policy='all' every rank writes its own `rank-NNN/` directory."]
    if run.rank is not None and run.rank_policy == "all":
        parent = Path(run.output_dir).parent.as_posix()
        lines += [
            "Compare the ranks that have finished (every row carries its rank):",
            "",
            "```python",
            f"""from pathlib import Path

import polars as pl

ranks = pl.scan_parquet(sorted(Path({_q(parent)}).glob("rank-*/{HISTORY_FILE}")), glob=False)
by_rank = (
    ranks.group_by("rank", "layer", "signal", "metric")
    .agg(pl.col("value").mean())
    .sort("layer", "signal", "metric", "rank")
    .collect()
)
print(by_rank)""",
            "```",
        ]
    else:
        lines.append(
            "Compare them with `torchinstruments compare stats/rank-000 stats/rank-001`, or "
            'scan their history.parquet files together and group by `"rank"`.'
        )
    return [*lines, ""]


def _section_state(
    run: RunInfo,
    counts: RunCounts | None,
    problems: Sequence[str],
    interrupted: bool,
    rows_recorded: int | None,
) -> list[str]:
    """The marker lines and the visible state: in progress, complete, interrupted, incomplete.

    "complete" is said only when history.parquet holds every row the run recorded (and nothing
    else is missing); after a crash the number of rows the run held in memory is unknown, so a
    finalized crashed run is "interrupted", with the bound on what it may have lost.
    """
    if counts is None:
        return [STATE_IN_PROGRESS, "", "**State: in progress.**", ""]
    marker = [] if rows_recorded is None else [ROWS_RECORDED.format(rows_recorded)]
    lost_bound = (
        f"Rows measured in the last flush_seconds={run.flush_seconds} s before the process "
        "ended may be missing: a SIGKILL or a crash loses them, a SIGTERM writes them first."
    )
    if problems:
        lines = [STATE_INCOMPLETE, *marker, "", "**State: INCOMPLETE.** What is missing and why:"]
        lines += ["", *(f"- {problem}" for problem in problems)]
        if interrupted:
            lines.append(f"- the process ended without remove_observer. {lost_bound}")
        return [*lines, ""]
    if interrupted:
        return [
            STATE_INTERRUPTED,
            "",
            "**State: interrupted.** The process ended without remove_observer (killed, crashed "
            "or preempted); `finalize` merged every row it had written into history.parquet. "
            f"{lost_bound} Counts are lower bounds.",
            "",
        ]
    return [
        STATE_COMPLETE,
        *marker,
        "",
        "**State: complete.** history.parquet holds every row the run recorded"
        + ("" if rows_recorded is None else f" ({rows_recorded} rows)")
        + ".",
        "",
    ]


def _section_gaps(run: RunInfo, counts: RunCounts | None) -> list[str]:
    """What the run does not hold although layers were selected: said before anything else."""
    lines = [f"**Note:** {note}" for note in run.notes]
    if counts is not None and run.layers and counts.samples == 0:
        seen = (
            "the model was never called"
            if counts.root_forwards == 0
            else f"{counts.root_forwards} root forwards were seen and the sampler chose none"
        )
        lines.append(
            f"**No sample was recorded:** {seen}, so history.parquet has no rows and result.json "
            "no measurements."
        )
    return [line for pair in zip(lines, [""] * len(lines), strict=True) for line in pair]


def render_index(
    run: RunInfo,
    counts: RunCounts | None,
    *,
    recovered: bool = False,
    problems: Sequence[str] = (),
    interrupted: bool = False,
    rows_recorded: int | None = None,
) -> str:
    """The text of index.md.

    Args:
        run: what the run is.
        counts: how much it saw, or None while the run is in progress.
        recovered: True when `counts` were rebuilt from history after a crash (lower bounds).
        problems: why the finished run is incomplete (rows lost, merge failed, ...); empty when
            it is complete.
        interrupted: True when the process ended without removal (finalize after a crash).
        rows_recorded: rows the live run recorded, when known (embedded for `finalize`).

    Returns:
        Markdown, with the RunInfo fields as JSON between `RUN_INFO_BEGIN` and `RUN_INFO_END`.
    """
    lines = [
        "# TorchInstruments run",
        *_section_state(run, counts, problems, interrupted, rows_recorded),
        *_section_gaps(run, counts),
        "Descriptive statistics of the outputs of selected PyTorch modules, and of the "
        "gradients flowing into those outputs, for sampled root forwards (calls of the observed "
        "model). No scores or verdicts: only measurements.",
        "",
        *_section_run(run, counts, recovered),
        *_section_layers(run, counts, recovered),
        *_section_files(run),
        *_section_schema(),
        *_section_meanings(),
        *_section_result(run),
        *_queries(run),
        "## Run info (machine-readable)",
        "",
        RUN_INFO_BEGIN,
        "```json",
        _run_info_json(run),
        "```",
        RUN_INFO_END,
        "",
    ]
    return "\n".join(lines)


def write_index(
    directory: Path,
    run: RunInfo,
    counts: RunCounts | None,
    *,
    recovered: bool = False,
    problems: Sequence[str] = (),
    interrupted: bool = False,
    rows_recorded: int | None = None,
) -> None:
    """Write `directory/index.md` atomically.

    Args:
        directory: the run's output directory.
        run: what the run is.
        counts: how much it saw, or None while the run is in progress.
        recovered: True when `counts` were rebuilt from history after a crash.
        problems: why the finished run is incomplete; empty when it is complete.
        interrupted: True when the process ended without removal (finalize after a crash).
        rows_recorded: rows the live run recorded, when known.
    """
    text = render_index(
        run,
        counts,
        recovered=recovered,
        problems=problems,
        interrupted=interrupted,
        rows_recorded=rows_recorded,
    )
    write_text_atomic(directory / INDEX_FILE, text)


def parse_run_info(text: str) -> RunInfo:
    """The RunInfo embedded in the text of an index.md.

    Raises:
        ValueError: if the markers or the JSON block are missing or malformed.
    """
    pattern = re.escape(RUN_INFO_BEGIN) + r"\s*```json\s*(.*?)\s*```\s*" + re.escape(RUN_INFO_END)
    match = re.search(pattern, text, re.DOTALL)
    if match is None:
        raise ValueError("index.md has no run-info block between the torchinstruments markers")
    data = json.loads(match.group(1))
    names = {f.name for f in fields(RunInfo)}
    data.setdefault("flush_seconds", 60.0)  # index.md of a version before flush_seconds
    data.setdefault("notes", [])  # index.md of a version before notes
    if set(data) != names:
        raise ValueError(f"run-info block has fields {sorted(data)}, expected {sorted(names)}")
    data["output_dir"] = Path(data["output_dir"])
    data["layers"] = tuple(LayerInfo(d["name"], d["module_type"]) for d in data["layers"])
    data["focus_layers"] = tuple(data["focus_layers"])
    data["metrics"] = tuple(data["metrics"])
    data["notes"] = tuple(data.get("notes", ()))
    return RunInfo(**data)


def index_is_complete(directory: Path) -> bool:
    """Whether `directory/index.md` exists and was written at removal (with counts)."""
    try:
        return STATE_COMPLETE in (directory / INDEX_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False


def read_rows_recorded(directory: Path) -> int | None:
    """The rows the live run recorded, from index.md; None if it never reached removal."""
    try:
        text = (directory / INDEX_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    match = _ROWS_RECORDED_RE.search(text)
    return None if match is None else int(match.group(1))


def read_run_info(directory: Path) -> RunInfo:
    """The RunInfo embedded in `directory/index.md`.

    Args:
        directory: a run's output directory.

    Raises:
        FileNotFoundError: if index.md is missing.
        ValueError: if its run-info block is missing or malformed.
    """
    return parse_run_info((directory / INDEX_FILE).read_text(encoding="utf-8"))


__all__ = [
    "index_is_complete",
    "read_rows_recorded",
    "read_run_info",
    "render_index",
    "write_index",
]
