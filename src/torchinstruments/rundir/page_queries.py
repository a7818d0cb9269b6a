"""The ready Polars queries of index.md: each block runs as printed, live, crashed or finished.

Design decision: the queries list the run's history files literally (pathlib, then Polars with
`glob=False`), so they work on a directory whose name holds glob characters, on the completed
parts of a live or crashed run, and on history.parquet once it exists; the tests execute every
block against real files. They depend on `RunInfo` only.
"""

from __future__ import annotations

from pathlib import Path

from torchinstruments.records import RunInfo
from torchinstruments.rundir.layout import HISTORY_FILE, PARTS_DIR
from torchinstruments.rundir.page_sections import quoted as _q
from torchinstruments.rundir.shell import command_span


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


def section_queries(run: RunInfo) -> list[str]:
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


__all__ = ["section_queries"]
