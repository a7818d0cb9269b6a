"""The state file: index.md is rendered from it, `finalize` and the CLI read it, old runs migrate."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

import torchinstruments
from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.cli.reader import read_facts
from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import (
    LayerInfo,
    Measurement,
    MetricValue,
    RunCounts,
    RunInfo,
    ScaleSpan,
)
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.index_page import render_index
from torchinstruments.rundir.state import (
    LostRows,
    NewerStateError,
    RunState,
    Status,
    decode_state,
    encode_state,
    read_state,
    write_state,
)
from torchinstruments.rundir.writer import HistoryWriter

from conftest import run_status, strict_json

SOURCE = Path(torchinstruments.__file__).parent


def run_info(directory: Path, **changes: object) -> RunInfo:
    fields: dict[str, object] = {
        "output_dir": directory,
        "library_version": "0.1.0",
        "torch_version": "2.15.0",
        "model_class": "Net",
        "layers": (LayerInfo("fc", "Linear"), LayerInfo("unused", "ReLU")),
        "focus_layers": ("fc",),
        "sampler": "EveryNForwardsSampler(every=1)",
        "metrics": ("mean",),
        "rank": None,
        "world_size": None,
        "rank_policy": "rank0",
        "capture_direct_forwards": True,
        "history": HistoryConfig(buffer_rows=2, window=3, flush_seconds=12.5),
        "started_at": "2026-01-01T00:00:00+00:00",
        "notes": ("a configuration note",),
    }
    fields.update(changes)
    return RunInfo(**fields)  # type: ignore[arg-type]


def test_state_round_trips_through_strict_json(tmp_path: Path) -> None:
    state = RunState(
        run_info(tmp_path),
        RunCounts(
            7,
            5,
            4,
            {"fc": 5},
            train_forwards=6,
            eval_forwards=1,
            unobserved_eval_forwards=3,
            unobserved_setup_forwards=2,
            loss_scales=(ScaleSpan(0, 65536.0), ScaleSpan(2, 32768.0), ScaleSpan(5, None)),
        ),
        rows_recorded=20,
        problems=("TensorBoard events failed",),
        live_problems=("TensorBoard events failed",),
        losses=(LostRows(6, 2, 3, "disk full"),),
        notes=("a later note",),
    )
    write_state(tmp_path, state)
    data = strict_json(tmp_path / ".state.json")
    assert data["schema_version"] == 1
    assert data["status"] == "incomplete"
    assert data["counts"] == {
        "root_forwards": 7,
        "samples": 5,
        "backward_samples": 4,
        "layer_samples": {"fc": 5},
        "notes": [],
        "train_forwards": 6,
        "eval_forwards": 1,
        "unobserved_eval_forwards": 3,
        "unobserved_setup_forwards": 2,
        "bypassed_by": None,
        "loss_scales": [
            {"first_sample_id": 0, "scale": 65536.0},
            {"first_sample_id": 2, "scale": 32768.0},
            {"first_sample_id": 5, "scale": None},
        ],
        "no_grad_samples": None,
    }
    assert data["losses"] == [
        {"rows": 6, "first_sample_id": 2, "last_sample_id": 3, "reason": "disk full"}
    ]
    assert data["run"]["output_dir"] == tmp_path.as_posix()
    # The run's HistoryConfig is written inline, as the run's own keys (the file is unchanged).
    assert "history" not in data["run"]
    assert {name: data["run"][name] for name in ("buffer_rows", "window", "flush_seconds")} == {
        "buffer_rows": 2,
        "window": 3,
        "flush_seconds": 12.5,
    }
    assert data["run"]["max_buffered_rows"] is None
    assert read_state(tmp_path) == state


@pytest.mark.parametrize(
    ("changes", "status"),
    [
        ({}, Status.IN_PROGRESS),
        ({"counts": RunCounts(1, 1, 1)}, Status.COMPLETE),
        ({"counts": RunCounts(1, 1, 1), "interrupted": True}, Status.INTERRUPTED),
        (
            {"counts": RunCounts(1, 1, 1), "interrupted": True, "problems": ("x",)},
            Status.INCOMPLETE,
        ),
        ({"counts": RunCounts(1, 1, 1), "losses": (LostRows(1, 0, 0, "y"),)}, Status.INCOMPLETE),
    ],
)
def test_status_follows_from_the_fields(
    tmp_path: Path, changes: dict[str, object], status: Status
) -> None:
    state = RunState(run_info(tmp_path), **changes)  # type: ignore[arg-type]
    assert state.status is status
    assert json.loads(encode_state(state))["status"] == status.value


def test_an_older_file_without_new_fields_reads_as_defaults_and_a_newer_schema_is_refused(
    tmp_path: Path,
) -> None:
    full = json.loads(encode_state(RunState(run_info(tmp_path), RunCounts(2, 2, 2))))
    for name in ("losses", "notes", "live_problems", "migrated_from", "status"):
        del full[name]
    full["added_by_a_later_minor_version"] = [1, 2]  # unknown keys are ignored
    state = decode_state(json.dumps(full))
    assert state.losses == ()
    assert state.notes == ()
    assert state.status is Status.COMPLETE
    with pytest.raises(NewerStateError, match="schema version 2"):
        decode_state(json.dumps({**full, "schema_version": 2}))
    with pytest.raises(ValueError, match="run"):
        decode_state(json.dumps({"schema_version": 1}))


def test_index_md_is_rendered_from_a_state_file(tmp_path: Path) -> None:
    """Everything the page says about how far the run got comes from the state file."""
    (tmp_path / ".state.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "run": json.loads(encode_state(RunState(run_info(tmp_path))))["run"],
                "counts": {
                    "root_forwards": 9,
                    "samples": 4,
                    "backward_samples": 3,
                    "layer_samples": {"fc": 4},
                },
                "counts_recovered": True,
                "problems": ["result.json could not be written (OSError: gone)"],
                "losses": [
                    {"rows": 6, "first_sample_id": 1, "last_sample_id": 2, "reason": "disk full"}
                ],
                "notes": ["a later note"],
            }
        ),
        encoding="utf-8",
    )
    page = render_index(read_state(tmp_path))
    for needle in (
        "**State: INCOMPLETE.** What is missing and why:",
        "- result.json could not be written (OSError: gone)",
        "- 6 rows of samples 1-2 were recorded but not written: disk full",
        "**Note:** a configuration note",
        "**Note:** a later note",
        "counts (rebuilt from history after an interrupted run: what reached the disk, so lower "
        "bounds; unknown where nothing did): at least 9 root forwards, at least 4 samples, at "
        "least 3 samples with output gradients",
        "| `fc` | Linear | at least 4 |",  # rebuilt: what reached the disk
        "| `unused` | ReLU | unknown |",  # a count nobody wrote, never 0
        "No row on disk (1): `unused`",  # recovered counts: no proof it never ran
        "flush_seconds=12.5",
        "window=3",
    ):
        assert needle in page, needle
    assert "<!--" not in page  # nothing machine-readable is hidden in the page any more


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.unused = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def finished_run(directory: Path, steps: int = 3, unsampled: int = 2) -> None:
    """A real run: `steps` sampled steps, then `unsampled` forwards the sampler skips."""
    torch.manual_seed(0)
    model = Net()
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(steps):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    state = strict_json(directory / ".state.json")
    state["counts"]["root_forwards"] += unsampled  # exact counts only the live run knows
    (directory / ".state.json").write_text(json.dumps(state), encoding="utf-8")


def test_finalize_a_finished_run_whose_index_md_was_deleted(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    finished_run(directory)
    before = (directory / "result.json").read_bytes()
    (directory / "index.md").unlink()
    report = finalize(directory)
    assert report.complete
    assert not report.interrupted
    assert not report.run_info_recovered
    assert run_status(directory) == "complete"
    page = (directory / "index.md").read_text(encoding="utf-8")
    # the live run's exact counts (3 sampled + 2 unsampled), not lower bounds from history
    assert "- counts: 5 root forwards, 3 samples, 3 samples with output gradients" in page
    assert "| `unused` | ReLU | 0 |" in page  # the catalog came from the state, not history
    assert (directory / "result.json").read_bytes() == before
    facts = read_facts(directory)  # the CLI reads the state file too
    assert facts.state == "complete"
    assert facts.counts == "counts: 5 root forwards, 3 samples, 3 samples with output gradients"


def old_page(run: dict[str, object], marker: str, rows_recorded: int | None) -> str:
    """index.md as versions before the state file wrote it (the markers they embedded)."""
    rows = (
        ""
        if rows_recorded is None
        else f"\n<!-- torchinstruments:rows-recorded:{rows_recorded} -->"
    )
    return (
        f"# TorchInstruments run\n<!-- torchinstruments:state:{marker} -->{rows}\n\n"
        f"**State: {marker}.**\n\n- counts: 99 root forwards\n\n"
        "## Run info (machine-readable)\n\n<!-- torchinstruments:run-info:begin -->\n```json\n"
        f"{json.dumps(run, indent=1)}\n```\n<!-- torchinstruments:run-info:end -->\n"
    )


def old_directory(directory: Path, marker: str, rows_recorded: int | None) -> dict[str, object]:
    """Parts of 4 samples of layer `fc`, and an old index.md (before flush_seconds and notes)."""
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=2))
    for s in range(4):
        writer.append(
            [
                Measurement(
                    s, s, s, None, "fc", "Linear", 0, "output", "", (2,), "float32", "train",
                    True, ("mean",), (MetricValue(float(s)),),
                )
            ]
        )  # fmt: skip
    writer.close()
    run = json.loads(encode_state(RunState(run_info(directory))))["run"]
    del run["flush_seconds"], run["notes"]
    (directory / "index.md").write_text(old_page(run, marker, rows_recorded), encoding="utf-8")
    return run


def test_an_old_format_crashed_directory_finalizes(tmp_path: Path) -> None:
    old_directory(tmp_path, "in-progress", None)
    report = finalize(tmp_path)
    assert report.complete
    assert report.interrupted
    assert not report.run_info_recovered
    assert run_status(tmp_path) == "interrupted"
    state = strict_json(tmp_path / ".state.json")
    assert state["migrated_from"] == "index.md"
    assert state["run"]["flush_seconds"] == HistoryConfig().flush_seconds
    assert [layer["name"] for layer in state["run"]["layers"]] == ["fc", "unused"]
    assert state["counts"]["samples"] == 4
    assert state["counts_recovered"] is True
    assert [r["layer"] for r in strict_json(tmp_path / "result.json")] == ["fc", "unused"]
    assert pl.read_parquet(tmp_path / "history.parquet").height == 4
    page = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "99 root forwards" not in page  # counts are never read from a page
    assert "torchinstruments:run-info" not in page


def test_an_old_format_complete_directory_stays_complete_and_is_checked(tmp_path: Path) -> None:
    old_directory(tmp_path, "complete", 4)
    assert finalize(tmp_path).complete
    assert run_status(tmp_path) == "complete"
    assert strict_json(tmp_path / ".state.json")["rows_recorded"] == 4
    other = tmp_path / "short"
    old_directory(other, "complete", 5)  # the old page recorded a row history lacks
    report = finalize(other)
    assert report.problems == (
        "history.parquet holds 4 of the 5 rows this run recorded; 1 rows are missing",
    )
    assert run_status(other) == "incomplete"


def test_finalize_keeps_what_only_the_live_run_knew(tmp_path: Path) -> None:
    """A TensorBoard failure and the loss ledger cannot be re-checked: finalize keeps them."""
    old_directory(tmp_path, "in-progress", None)
    finalize(tmp_path)
    state = read_state(tmp_path)
    failure = "TensorBoard events under tensorboard/ could not be written"
    write_state(
        tmp_path,
        RunState(
            state.run,
            state.counts,
            rows_recorded=4,
            problems=(failure,),
            live_problems=(failure,),
            losses=(LostRows(2, 4, 4, "disk full"),),
        ),
    )
    report = finalize(tmp_path)
    assert report.problems == (failure,)
    assert read_state(tmp_path).losses == (LostRows(2, 4, 4, "disk full"),)
    assert run_status(tmp_path) == "incomplete"


def test_a_newer_state_file_is_refused_not_overwritten(tmp_path: Path) -> None:
    old_directory(tmp_path, "in-progress", None)
    newer = json.dumps({"schema_version": 99, "run": {}})
    (tmp_path / ".state.json").write_text(newer, encoding="utf-8")
    with pytest.raises(NewerStateError):
        finalize(tmp_path)
    assert (tmp_path / ".state.json").read_text(encoding="utf-8") == newer


def _names_index_md(node: ast.AST) -> bool:
    """Whether the expression mentions index.md (by `INDEX_FILE` or literally)."""
    return any(
        (isinstance(n, ast.Name) and n.id == "INDEX_FILE")
        or (isinstance(n, ast.Constant) and n.value == "index.md")
        for n in ast.walk(node)
    )


def test_only_the_migration_reads_index_md() -> None:
    """index.md is never read back: one module converts the pages of older versions."""
    readers = set()
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("read_text", "read_bytes", "open"):
                target: list[ast.AST] = [func.value, *node.args]
            elif isinstance(func, ast.Name) and func.id == "open":
                target = list(node.args)
            else:
                continue
            if any(_names_index_md(t) for t in target):
                readers.add(path.relative_to(SOURCE).as_posix())
    assert readers == {"rundir/recovery.py"}


def test_a_runs_state_and_index_state_the_buffer_cap_in_force(tmp_path: Path) -> None:
    """`max_buffered_rows=None` means max(131072, buffer_rows): the run records that number."""
    model = nn.Linear(2, 2)
    run = tmp_path / "run"
    history = HistoryConfig(buffer_rows=200_000, window=4, flush_seconds=30.0)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=history)
    model(torch.randn(1, 2))
    remove_observer(model)
    data = strict_json(run / ".state.json")["run"]
    assert (data["buffer_rows"], data["window"], data["flush_seconds"]) == (200_000, 4, 30.0)
    assert data["max_buffered_rows"] == 200_000
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "buffer_rows=200000, flush_seconds=30.0, window=4, max_buffered_rows=200000" in index
    assert read_state(run).run.history == HistoryConfig(200_000, 4, 30.0, 200_000)
