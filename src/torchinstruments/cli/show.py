"""`torchinstruments show DIR`: a run's facts and, per tensor and metric, latest value and window mean.

Design decision: the text view has one table per metric, with a row per layer (and call and
tensor path) and the output and output_gradient columns side by side, so it stays within 80
columns whatever the number of metrics; `--metrics` and `--layers` make it shorter. Beyond
OVERVIEW_TENSORS tensors it is grouped by module type (`overview.py`; `--all`: every row). The
machine formats (`--format csv|json|markdown`) hold one row per series (layer, call, signal, tensor
path, metric) with full precision and the window bounds, for scripts. The header's texts that
come from the user (the run's directory, the model's class name, each null's reason; each note:
`notes_lines`) are
written by index.md's rule (`literal_if_unclear`), the rest of each line as it is: an escape or
a carriage return in a class name must not rewrite the terminal.
"""

from __future__ import annotations

import textwrap

import polars as pl

from torchinstruments.cli.overview import OVERVIEW_TENSORS, overview_tables, tensor_count
from torchinstruments.cli.reader import (
    RunFacts,
    metric_order,
)
from torchinstruments.cli.selection import facts_dict
from torchinstruments.cli.text import (
    notes_lines,
    number,
    plural,
    render_frame,
    several_calls,
    table,
    tensor_label,
)
from torchinstruments.records import OUTPUT, OUTPUT_GRADIENT, SIGNALS
from torchinstruments.rundir.attempt_ends import attempts_said
from torchinstruments.rundir.attempts import sampler_line
from torchinstruments.rundir.layout import INDEX_FILE
from torchinstruments.rundir.shell import literal_if_unclear


def facts_lines(facts: RunFacts, frame: pl.DataFrame, window: int) -> list[str]:
    """The run facts, one short line each."""
    run = facts.run
    files = facts.files
    source = []
    if files.history is not None:
        source.append(files.history.name)
    if files.parts:
        source.append(f"{plural(len(files.parts), 'part')} in history.parts/")
    lines = [f"run: {literal_if_unclear(str(facts.directory))}", f"state: {facts.state}"]
    if run is not None:
        lines += [
            f"model: {literal_if_unclear(run.model_class)}; torchinstruments {run.library_version}, "
            f"torch {run.torch_version}; started {run.started_at}",
            sampler_line(run.sampler, facts.run_state.attempts if facts.run_state else ()),
            *attempts_lines(facts),
            f"selected layers: {len(run.layers)}; "
            + (f"rank {run.rank} of {run.world_size}" if run.rank is not None else "no ranks"),
        ]
    else:
        lines.append("run info: missing or unreadable (layer order and settings unknown)")
    if facts.counts:
        lines.append(facts.counts)
    lines += facts.marked_lines()
    lines += notes_lines(facts.notes)
    # index.md's "Disk space" line: a second copy of rows an earlier merge left (no row missing)
    left = facts.run_state.left_behind if facts.run_state else ()
    lines += [f"disk space: {literal_if_unclear(line)}" for line in left]  # the state's text
    latest = frame["latest_sample_id"].max() if frame.height else None
    if files.unreadable:  # beside history.parquet, left in place by finalize
        names = ", ".join(literal_if_unclear(p.name) for p in files.unreadable)
        source[-1] += (
            f" (left out: {plural(len(files.unreadable), 'unreadable part')} in history.parts/, "
            f"its rows missing: {names})"
        )
    lines.append(f"read: {' + '.join(source)}; latest sample_id {latest}; window {window}")
    return lines


def attempts_lines(facts: RunFacts) -> list[str]:
    """A continued run's attempts (`resume=True`): how many, and which ended how, as index.md's
    Attempts table counts them; without it the counts line, the whole job's, read as one
    process's. Nothing for a run of one attempt."""
    said = attempts_said(facts.run_state, facts.directory) if facts.run_state else ""
    return [f"attempts: {said}; each one's counts in {INDEX_FILE}'s Attempts table"] if said else []


def _valid_count(valid: int | None, samples: int | None) -> str:
    """`8` (every sample of the window has a finite value: the mean is over all of them),
    `4/8` (4 of 8 have one), `-` (no window)."""
    if samples is None:
        return "-"
    return str(samples) if valid == samples else f"{valid or 0}/{samples}"


def metric_tables(frame: pl.DataFrame, facts: RunFacts, width: int) -> list[str]:
    """One table per metric: rows = tensors, columns = latest / window mean per signal."""
    if frame.is_empty():
        return ["(no rows match the selection)"]
    # A series is stale when older than the latest sample of its own mode (eval samples are
    # rarer than train ones: an eval series is not stale for ending before the last train one).
    latest_of = dict(frame.group_by("mode").agg(pl.col("latest_sample_id").max()).iter_rows())
    latest_all = frame["latest_sample_id"].max()
    calls = several_calls(frame)
    signals = [s for s in SIGNALS if s in set(frame["signal"].to_list())]
    short = {OUTPUT: "out", OUTPUT_GRADIENT: "grad"}
    headers = ["layer", "type"]
    for s in signals:
        headers += [f"{short[s]} latest", f"{short[s]} mean", "n"]
    numeric = [False, False] + [True] * (3 * len(signals))
    out: list[str] = []
    stale = marked = False
    for metric in metric_order(frame["metric"].unique().to_list(), facts.run):
        part = frame.filter(pl.col("metric") == metric)
        rows: dict[tuple[str, int, str, str], list[str]] = {}
        for r in part.iter_rows(named=True):
            key = (r["layer"], r["call_index"], r["tensor_path"], r["mode"])
            cells = rows.setdefault(
                key,
                [
                    tensor_label(*key, calls=r["layer"] in calls),
                    literal_if_unclear(r["module_type"]),
                    *(["-"] * (3 * len(signals))),
                ],
            )
            i = 2 + 3 * signals.index(r["signal"])
            latest = number(r["latest_value"], missing="null")
            if r["latest_sample_id"] != latest_of[r["mode"]]:
                latest += "*"
                stale = True
            if r["latest_marked"]:
                latest += "!"
                marked = True
            cells[i] = latest
            cells[i + 1] = number(r["window_mean"], missing="null")
            cells[i + 2] = _valid_count(r["window_finite"], r["window_samples"])
        out += [
            "",
            f"{metric}:",
            *table(headers, list(rows.values()), numeric=numeric, width=width, wrap_first=True),
        ]
    notes = [
        "latest: the value at each tensor's latest sample"
        + (
            f" (* = older than sample_id {latest_all}, or than its mode's latest sample)"
            if stale
            else ""
        )
        + "; mean: the mean over its recent window of samples (a mean of per-sample values, "
        "not of pooled elements); n: the samples that mean is over (those with a finite value), "
        "'4/8' when only 4 of the window's 8 have one; '-': not measured."
    ]
    if set(latest_of) != {"train"}:
        notes.append(
            "[eval]: the tensor's samples taken in eval mode (module.training False, a root "
            "forward called under no_grad or inference_mode, or a trainer's evaluation), a "
            "series of their own: never averaged or compared with its train samples."
        )
    if marked:
        notes.append(
            "!: that latest value is from a marked sample (its root forward raised, or only part "
            "of its rows were written): a partial sample, not an ordinary one; see marked samples."
        )
    nulls = frame.filter(pl.col("latest_value").is_null())
    if nulls.height:
        # A reason quotes an error's message (a user's reducer's): written by index.md's rule.
        reasons = sorted({literal_if_unclear(r) for r in nulls["latest_reason"].drop_nulls()})
        notes.append(
            f"null: {plural(nulls.height, 'latest value')} unavailable: {'; '.join(reasons)}"
        )
    out.append("")
    for note in notes:
        out += textwrap.wrap(note, width)
    return out


def render(
    facts: RunFacts,
    frame: pl.DataFrame,
    *,
    fmt: str,
    width: int,
    window: int,
    every_tensor: bool = False,
) -> str:
    """The whole `show` output in one of the formats.

    The text view of more than OVERVIEW_TENSORS tensors is grouped by module type
    (`overview.py`) unless `every_tensor`; the machine formats always hold every series.
    """
    if fmt == "text":
        head = [
            wrapped
            for line in facts_lines(facts, frame, window)
            for wrapped in textwrap.wrap(line, width, subsequent_indent="  ")
        ]
        if not every_tensor and tensor_count(frame) > OVERVIEW_TENSORS:
            return "\n".join(head + overview_tables(frame, facts, width))
        return "\n".join(head + metric_tables(frame, facts, width))
    return render_frame(frame, fmt, facts_dict(facts, window))


__all__ = ["notes_lines", "render"]
