"""index.md: content rendered from a state, and every Polars query in it runs on real files."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer, set_step
from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import LayerInfo, Measurement, MetricValue, RunCounts, RunInfo
from torchinstruments.rundir.attempts import KILLED, REMOVED, AttemptCounts
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.index_page import render_index
from torchinstruments.rundir.layout import list_parts
from torchinstruments.rundir.ledger import LostRows
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.state import RunState, write_state
from torchinstruments.rundir.writer import HistoryWriter

from conftest import cli_in_process, rows_in_parts, wait_for_rows


def run_info(directory: Path, rank: int | None = None) -> RunInfo:
    return RunInfo(
        output_dir=directory,
        library_version="0.1.0",
        torch_version="2.15.0",
        model_class="tests.Net",
        layers=(LayerInfo("encoder.0", "Linear"), LayerInfo("head", "Linear")),
        focus_layers=("encoder.0",),
        sampler="EveryNForwardsSampler(every=4)",
        metrics=("mean", "std"),
        rank=rank,
        world_size=None if rank is None else 2,
        rank_policy="all" if rank is not None else "rank0",
        capture_direct_forwards=True,
        history=HistoryConfig(buffer_rows=8192, window=10, flush_seconds=60.0),
        started_at="2026-01-01T00:00:00+00:00",
    )


def write_history(directory: Path, rank: int | None, keep_parts: bool = False) -> None:
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=5))
    for s in range(6):
        for signal in ("output", "output_gradient"):
            writer.append(
                [
                    Measurement(
                        s,
                        s,
                        s,
                        rank,
                        layer,
                        "Linear",
                        0,
                        signal,
                        "",
                        (2, 2),
                        "float32",
                        "train",
                        True,
                        ("mean", "std"),
                        (MetricValue(s * 1.0), MetricValue(None, "empty tensor")),
                    )
                    for layer in ("encoder.0", "head")
                ]
            )
    writer.flush()
    if keep_parts:
        shutil.copytree(directory / "history.parts", directory / "parts.copy")
    writer.close()
    merge_history(directory)
    if keep_parts:
        (directory / "parts.copy").rename(directory / "history.parts")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_page_documents_the_run(tmp_path: Path) -> None:
    text = render_index(RunState(run_info(tmp_path), RunCounts(100, 25, 24)))
    for needle in (
        "torchinstruments 0.1.0",
        "torch 2.15.0",
        "tests.Net",
        "`encoder.0` (Linear)",
        "EveryNForwardsSampler(every=4)",
        "rank_policy='rank0'",
        "100 root forwards",
        "25 samples",
        "empty tensor",
        "no finite entries",
        "unsupported dtype",
        "unsupported layout",
        "non-finite result",
        "reducer error: <Type>: <message>",
        "reducer returned no value",
        "measurement error",
        "population standard deviation",
        "linear interpolation",
        "original element count",
        "parameter gradients",
        "not the statistic of the pooled elements",
        "`[1]['k']`",
        ".hidden",
        "torchinstruments compare stats/rank-000 stats/rank-001",
    ):
        assert needle in text, needle
    for column in ("sample_id", "unavailable_reason", "shape", "grad_enabled"):
        assert f"| {column} |" in text
    assert "in progress" in render_index(RunState(run_info(tmp_path)))


def test_metrics_section_says_which_metrics_count_every_entry(tmp_path: Path) -> None:
    text = render_index(RunState(run_info(tmp_path), RunCounts(1, 1, 1)))
    metrics = text.split("## Metrics", 1)[1].split("##", 1)[0]
    assert "All metrics are computed over the finite entries" not in metrics
    assert (
        "except zero_fraction and nonfinite_fraction, which count over all of its entries"
        in " ".join(metrics.split())
    )


def test_mode_item_says_test_and_predict_after_the_fit_are_not_counted(tmp_path: Path) -> None:
    """A callback removes the observer when the fit ends, so no note can count the forwards of
    `trainer.validate()` / `test()` / `predict()` (or the Hugging Face Trainer's `evaluate()` /
    `predict()`) after it; only the fit's evaluation forwards are counted, and its setup
    forwards apart."""
    text = " ".join(render_index(RunState(run_info(tmp_path), RunCounts(1, 1, 1))).split())
    mode = text.split("- mode: ", 1)[1].split(" - step: ", 1)[0]
    assert (
        "Lightning's validate, test and predict and the Hugging Face Trainer's evaluate and "
        "predict run after the fit, once the observer is removed: neither observed nor counted"
    ) in mode
    assert "the forwards of the fit's setup (Lightning's model summary of example_input_array)" in (
        mode
    )
    assert "validation, test and predict forwards take no sample" not in mode


def test_files_section_names_every_count_the_state_file_holds(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(1))
    model(torch.randn(1, 2))
    remove_observer(model)
    counts = json.loads((tmp_path / "stats" / ".state.json").read_text(encoding="utf-8"))["counts"]
    index = (tmp_path / "stats" / "index.md").read_text(encoding="utf-8")
    state_item = index.split("- `.state.json`: ", 1)[1].split("\n", 1)[0]
    assert [key for key in counts if f"`{key}`" not in state_item and key not in state_item] == []
    assert "the first query below prints its status and counts" in state_item


class WithEmpty(nn.Module):
    """Linear -> Tanh, plus a layer whose output is empty (so some values are null)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Tanh()
        self.empty = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.empty(x[:0])
        return self.act(self.fc(x))


def run_queries(directory: Path) -> dict[str, object]:
    """Execute the setup block of `directory/index.md`, then every other block after it, as
    printed, each in a copy of the setup's namespace (one Python session per block)."""
    found: dict[str, object] = {}
    setup, *blocks = python_blocks((directory / "index.md").read_text(encoding="utf-8"))
    assert "def history_of(" in setup
    assert len(blocks) == 9
    assert all("def history_of(" not in code for code in blocks)  # one preamble, not one per query
    namespace: dict[str, object] = {}
    exec(compile(setup, "index.md:setup", "exec"), namespace)
    for number, code in enumerate(blocks):
        session = dict(namespace)
        exec(compile(code, f"index.md:block-{number}", "exec"), session)
        found.update(session)
    return found


def test_every_query_runs_on_a_live_and_then_a_finished_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "runs" / "exp[lr=0.1]"  # glob characters: read literally
    monkeypatch.chdir(tmp_path)  # the queries hold the absolute path; the cwd does not matter
    torch.manual_seed(0)
    model = WithEmpty()
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=9),
    )
    per_sample = 0
    try:
        for step in range(4):
            set_step(model, 10 * step)
            model(torch.randn(3, 4)).sum().backward()
            if step == 0:  # its rows went to disk at once
                per_sample = rows_in_parts(directory)
        wait_for_rows(directory, per_sample + 3 * per_sample // 9 * 9)  # the flush thread's chunks
        parts = list_parts(directory)
        assert parts
        assert not (directory / "history.parquet").exists()
        live = run_queries(directory)  # the in-progress index.md, on the parts
        checks(live, pl.concat([pl.read_parquet(p, glob=False) for p in parts]))
    finally:
        remove_observer(model)

    finished = run_queries(directory)  # the complete index.md, on history.parquet
    checks(finished, pl.read_parquet(directory / "history.parquet", glob=False))


def checks(namespace: dict[str, object], history: pl.DataFrame) -> None:
    """The query results agree with `history` (the rows the queries were run on)."""
    trend, latest, missing, both, written, first = (
        namespace[name] for name in ("trend", "latest", "missing", "both", "written", "first")
    )
    for frame in (trend, latest, missing, both, written):
        assert isinstance(frame, pl.DataFrame)
        assert frame.height > 0
    assert isinstance(written, pl.DataFrame)
    assert written["rows"].item() == history.height
    assert written["latest_sample"].item() == history["sample_id"].max()
    assert isinstance(missing, pl.DataFrame)
    assert set(missing["layer"]) == {"empty"}
    assert missing["rows"].sum() == history["value"].null_count()
    assert isinstance(latest, pl.DataFrame)
    assert set(latest["sample_id"]) == {history["sample_id"].max()}
    assert isinstance(first, pl.DataFrame)
    assert first.height == 0  # as printed, the comparison compares the run with itself
    # `empty` has outputs and never a gradient: the "series that stop" query names it
    no_gradient = namespace["no_gradient"]
    assert isinstance(no_gradient, pl.DataFrame)
    assert no_gradient["layer"].to_list() == ["empty"]
    # The step query: the layer's output std per step (set_step's values), the log's columns.
    by_step = namespace["by_step"]
    assert isinstance(by_step, pl.DataFrame)
    want = history.filter(
        pl.col("layer") == "fc", pl.col("signal") == "output", pl.col("metric") == "std"
    ).sort("sample_id")
    assert (
        by_step["step"].to_list() == want["step"].to_list() == [10 * s for s in want["sample_id"]]
    )
    assert by_step["value"].to_list() == want["value"].to_list()
    assert by_step["loss"].null_count() == by_step.height  # as printed: an empty log


def test_queries_before_the_first_part_say_so(tmp_path: Path) -> None:
    model = WithEmpty()
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(1))
    try:
        setup, status, *_ = python_blocks((tmp_path / "stats" / "index.md").read_text("utf-8"))
        namespace: dict[str, object] = {}
        with pytest.raises(SystemExit, match="no part written yet"):
            exec(compile(setup, "index.md", "exec"), namespace)
        exec(compile(status, "index.md", "exec"), namespace)  # the state is there already
        assert namespace["state"]["status"] == "in progress"  # type: ignore[index]
    finally:
        remove_observer(model)


def status_lines(directory: Path) -> list[str]:
    """What index.md's setup block and then its status block print for `directory`."""
    setup, status, *_ = python_blocks((directory / "index.md").read_text("utf-8"))
    namespace: dict[str, object] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(setup, "index.md:setup", "exec"), namespace)
        exec(compile(status, "index.md:status", "exec"), namespace)
    return printed.getvalue().splitlines()


def test_status_query_names_no_layer_never_run_while_the_run_is_live(tmp_path: Path) -> None:
    """Counts are null until the run ends, which says nothing of which layers ran: a live run's
    status query must not list every layer as one that never ran."""
    model = WithEmpty()
    model.unused = nn.Linear(4, 4)  # selected, never called
    directory = tmp_path / "stats"
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    try:
        model(torch.randn(3, 4)).sum().backward()  # the first sample's rows reach the disk at once
        live = status_lines(directory)
    finally:
        remove_observer(model)
    assert live[0] == "status: in progress"
    assert not any("never ran in a sampled forward:" in line for line in live), live
    finished = status_lines(directory)
    assert finished[-1] == "layers that never ran in a sampled forward: 1 ['unused']"


def test_a_run_whose_process_ended_unfinished_is_not_in_progress_in_its_page_or_show(
    tmp_path: Path,
) -> None:
    """A killed run's state file keeps "in progress", and so does the page its live process
    wrote; its run lock tells that no process writes it any more. The page's status query
    tells it by that lock, as `show`, `compare` and a parent's page do, and the page's State
    line says it was true as written and how a reader tells it now."""
    model = WithEmpty()
    directory = tmp_path / "stats"
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    try:
        model(torch.randn(3, 4)).sum().backward()
        left = {name: (directory / name).read_text("utf-8") for name in (".state.json", "index.md")}
        live = status_lines(directory)
    finally:
        remove_observer(model)
    for name, text in left.items():  # the state file and the page as a kill leaves them
        (directory / name).write_text(text, encoding="utf-8")
    ended = status_lines(directory)
    assert live[:2] == [
        "status: in progress",
        "counts and the layers that never ran: known once the run ends",
    ]
    assert ended[:2] == [
        "status: interrupted: not finished, and no process holds the run's lock (its process "
        "ended without remove_observer: killed, crashed or os._exit); finalize completes it",
        "counts and the layers that never ran: known once finalize completes the run",
    ]
    page = left["index.md"]
    assert (
        "**State: in progress.** As this page was written, its process held the run's lock" in page
    )
    shown = cli_in_process("show", directory)
    assert "state: interrupted: not finished, and no process holds the run's lock" in " ".join(
        shown.stdout.split()
    )


def test_status_query_says_when_it_lists_only_the_first_layers_that_never_ran(
    tmp_path: Path,
) -> None:
    """A big model's list of layers that never ran is cut, and the line says so."""
    model = WithEmpty()
    model.unused = nn.ModuleList(nn.Linear(1, 1) for _ in range(51))  # selected, never called
    directory = tmp_path / "stats"
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    head, listed = status_lines(directory)[-1].split(" [")
    assert (
        head == "layers that never ran in a sampled forward: 51 (the first 50: `never` holds all)"
    )
    assert listed.count("'unused.") == 50


def test_result_section_describes_min_and_max_of_a_metric_without_a_valid_value(
    tmp_path: Path,
) -> None:
    def failing(tensor: torch.Tensor) -> float:
        raise RuntimeError("no value")

    model = nn.Sequential(nn.Linear(4, 4))
    inject_observer(
        model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(1), reducers=[failing]
    )
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    (layer,) = json.loads((tmp_path / "stats" / "result.json").read_text(encoding="utf-8"))
    for tensor in layer["tensors"]:
        entry = tensor["metrics"]["failing"]
        assert entry["valid"] == 0
        assert entry["min"] == entry["max"] == {"value": None, "sample_id": None}
    text = (tmp_path / "stats" / "index.md").read_text(encoding="utf-8")
    assert 'both fields are null (`{"value": null, "sample_id": null}`)' in text


def test_after_a_crash_a_layer_without_rows_is_not_said_to_have_never_run(tmp_path: Path) -> None:
    """Counts rebuilt from history only know what reached the disk: a layer without rows may
    have run in the samples the crash lost, so index.md and its status query say "no row on
    disk", not "never ran"."""
    model = WithEmpty()
    model.unused = nn.Linear(4, 4)  # selected, never called
    directory = tmp_path / "stats"
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).sum().backward()
    live_state = (directory / ".state.json").read_text(encoding="utf-8")
    with pytest.warns(RuntimeWarning, match="never ran"):
        remove_observer(model)
    (directory / ".state.json").write_text(live_state, encoding="utf-8")  # as a kill leaves it
    assert finalize(directory).state.counts_recovered
    index = (directory / "index.md").read_text(encoding="utf-8")
    assert "Never ran in a sampled forward" not in index
    assert "No row on disk (1): `unused`" in index
    # each count as what reached the disk, and the one nobody wrote unknown, never 0
    assert "called and returned (lower bounds, rebuilt from history), out of at least 1 (" in index
    rows = [line for line in index.splitlines() if line.startswith("| `")]
    assert [row.split(" | ")[-1] for row in rows] == ["at least 1 |"] * 3 + ["unknown |"]
    result = json.loads((directory / "result.json").read_text(encoding="utf-8"))
    assert [layer["sampled_forwards"] for layer in result] == [1, 1, 1, None]
    lines = status_lines(directory)
    assert lines[-1] == "layers with no row on disk: 1 ['unused']"
    assert lines[-2] == (  # the 0s of rebuilt counts are not said to be counts of none
        "counts rebuilt from history after the process died: lower bounds, and a 0 is "
        "unknown unless this page's counts line says it is known"
    )


def test_rank_comparison_query_runs(tmp_path: Path) -> None:
    stats = tmp_path / "stats[1]"  # glob characters in the parent: read literally
    for rank in (0, 1):
        write_history(stats / f"rank-{rank:03d}", rank=rank)
    state = RunState(run_info(stats / "rank-001", rank=1), RunCounts(6, 6, 6))
    write_state(stats / "rank-001", state)  # the setup block finds its run by the state file
    text = render_index(state)
    setup, *blocks = python_blocks(text)
    blocks = [b for b in blocks if "rank-*" in b]
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(setup, "<index.md>", "exec"), namespace)
    exec(compile(blocks[0], "<index.md>", "exec"), namespace)
    ranks = namespace["ranks"].select(pl.col("rank").unique().sort()).collect()
    assert ranks["rank"].to_list() == [0, 1]


def test_an_incomplete_continued_run_names_the_attempt_that_ended_without_removal(
    tmp_path: Path,
) -> None:
    """The last attempt was removed; only attempt 0 ended without remove_observer."""
    attempts = (
        AttemptCounts(0, "2026-01-01T00:00:00+00:00", samples=3, ended=KILLED),
        AttemptCounts(1, "2026-01-02T00:00:00+00:00", first_sample_id=3, samples=2, ended=REMOVED),
    )
    lost = LostRows(18, 4, 4, "the disk was full (OSError: No space left on device)")
    state = RunState(
        run_info(tmp_path), RunCounts(5, 5, 5), interrupted=True, losses=(lost,), attempts=attempts
    )
    text = render_index(state)
    assert "**State: INCOMPLETE.**" in text
    assert "- attempt(s) 0 ended without remove_observer." in text
    assert "the process ended without remove_observer" not in text


# Layer names that break or blur a Markdown table row as they are: a pipe, a line break, and
# a name that reads as the Python literal of the one with the line break.
ODD_NAMES = ("a|b", "e\nf", "'e\\nf'", "c")


class Piped(nn.Module):
    """A Linear named after each of `ODD_NAMES`, called in that order."""

    def __init__(self) -> None:
        super().__init__()
        for name in ODD_NAMES:
            self.add_module(name, nn.Linear(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


def table_rows(lines: list[str], header: str, count: int) -> list[list[str]]:
    """The cells of the `count` rows under `header`, each `\\|` read back as `|`."""
    start = lines.index(header)
    rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in lines[start + 2 : start + 2 + count]]
    return [[cell.strip().replace("\\|", "|") for cell in row] for row in rows]


def test_odd_layer_names_keep_each_table_row_one_line_and_read_back_apart(
    tmp_path: Path,
) -> None:
    """GitHub's Markdown splits a table row at every `|` not escaped, inside a code span too,
    and a line break ended the row (index.md's Layers table, and `show --format markdown`):
    a `|` is escaped, and a name with a line break (or that begins with a quote) is written
    as its Python literal, so each name reads back as itself."""
    model = Piped()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    model(torch.randn(1, 2))
    remove_observer(model)
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    header = "| layer | module_type | sampled forwards |"
    rows = table_rows(index.splitlines(), header, len(ODD_NAMES) + 1)
    assert rows[:-1] == [
        ["`a|b`", "Linear", "1"],
        ["`'e\\nf'`", "Linear", "1"],
        ["`\"'e\\\\nf'\"`", "Linear", "1"],  # it begins with a quote: a literal too
        ["`c`", "Linear", "1"],
    ]
    assert rows[-1] == []  # the table ends there
    assert "written on this page as its Python string literal" in index
    shown = cli_in_process("show", tmp_path / "run", "--metrics", "mean", "--format", "markdown")
    lines = shown.stdout.splitlines()
    cells = [row[0] for row in table_rows(lines, lines[0], len(lines) - 2)]
    layers = [re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", cell) for cell in cells]  # escapes read
    assert [ast.literal_eval(n) if n[0] in "'\"" else n for n in layers] == list(ODD_NAMES)


def test_the_attempts_table_splits_forwards_only_where_a_run_has_evaluation_forwards(
    tmp_path: Path,
) -> None:
    """An attempt killed before removal never wrote its schedule counters: unknown, never 0;
    a run without evaluation forwards keeps the table without those columns."""
    killed = AttemptCounts(0, "2026-01-01T00:00:00+00:00", samples=3, ended=KILLED)
    removed = AttemptCounts(
        1,
        "2026-01-02T00:00:00+00:00",
        first_sample_id=3,
        samples=2,
        ended=REMOVED,
        train_forwards=7,
        eval_forwards=0,
    )
    evaluated = dataclasses.replace(removed, eval_forwards=4)
    rows = {}
    for last in (removed, evaluated):
        text = render_index(
            RunState(run_info(tmp_path), RunCounts(5, 5, 5), attempts=(killed, last))
        )
        section = text.split("## Attempts", 1)[1].split("\n## ", 1)[0]
        rows[last.eval_forwards] = [line for line in section.splitlines() if line.startswith("|")]
    assert all(len(row.split("|")) == 10 for row in rows[0])
    header, _, first, second = rows[4]
    assert header.endswith("| training forwards | evaluation forwards |")
    assert first.endswith("| unknown | unknown |")
    assert second.endswith("| 7 | 4 |")


def test_the_attempts_section_says_a_time_interval_sampler_samples_each_attempts_first_forward(
    tmp_path: Path,
) -> None:
    """Said wherever an attempt ran one, its evaluation sampler under `record_eval` too (its
    line then begins with the training sampler's); never where none did. A killed attempt whose
    events prove samples has a first forward_index even where its rows gave no root forward."""
    every = "EveryNForwardsSampler(n=2): forward_index 0, 2, 4, ..."
    timed = "TimeIntervalSampler(seconds=60): the first root forward, then ..."
    both = f"{every}, asked with the count of training forwards; evaluation forwards: {timed}"
    said = {}
    for sampler in (every, timed, both):
        attempts = (
            AttemptCounts(0, "2026-01-01T00:00:00+00:00", samples=3, ended=KILLED, sampler=every),
            AttemptCounts(1, "2026-01-02T00:00:00+00:00", first_sample_id=3, sampler=sampler),
        )
        state = RunState(run_info(tmp_path), RunCounts(5, 5, 5), attempts=attempts)
        section = render_index(state).split("## Attempts", 1)[1].split("\n## ", 1)[0]
        said[sampler] = "starts anew in each attempt" in section
        rows = [line for line in section.splitlines() if line.startswith("| 0 |")]
        assert rows[0].split("|")[4:6] == [" 0 ", " 0 "]  # its samples prove a first forward
    assert said == {every: False, timed: True, both: True}


def test_metrics_section_says_what_the_rows_of_tensors_that_are_not_plain_describe(
    tmp_path: Path,
) -> None:
    text = " ".join(render_index(RunState(run_info(tmp_path), RunCounts(1, 1, 1))).split())
    metrics = text.split("## Metrics", 1)[1].split("##", 1)[0]
    for needle in (
        "a sparse (or other non-strided) tensor as the dense tensor",
        "a nested tensor over its components' entries, padding excluded (shape null)",
        "a tensor subclass over its entries as the subclass itself reads them",
        "beyond 2**53 rounded to the nearest",
        "a quantized tensor (a static quantized layer's `quint8` output) as its dequantized "
        "values, its `dtype` the quantized one",
        "Complex and packed dtypes and tensors on the meta device have null rows",
    ):
        assert needle in metrics, needle
    assert "null for a nested tensor" in text.split("| shape |", 1)[1].split("| dtype |", 1)[0]
