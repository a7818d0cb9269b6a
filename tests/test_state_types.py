""".state.json read by type: a wrong-typed value is a one-line error naming the field, never a
traceback; `finalize` recovers from history; a newer schema is a clear message in every command.

Each case edits one value of a real finished run's state file the way a hand or another tool
might (a number as a string, a string for a list, a bool for a count), then runs the reader
(`decode_state`), `finalize` and every command on it in this process, so an uncaught exception
fails the test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.rundir.state import StateTypeError, read_state

from conftest import cli_in_process

# (field path, bad value, the name the error must give)
BAD_VALUES = [
    (("rows_recorded",), "1080", "rows_recorded"),
    (("run", "window"), "ten", "run.window"),
    (("problems",), "text", "problems"),
    (("interrupted",), "yes", "interrupted"),
    (("counts_recovered",), 1, "counts_recovered"),
    (("counts",), [], "counts"),
    (("counts", "samples"), 2.5, "counts.samples"),
    (("counts", "layer_samples"), {"0": "3"}, "counts.layer_samples['0']"),
    (
        ("losses",),
        [{"rows": True, "first_sample_id": 0, "last_sample_id": 0, "reason": "x"}],
        "losses[0].rows",
    ),
    (("marks",), 5, "marks"),
    (("run",), "text", "run"),
    (("run", "layers"), [{"name": 1, "module_type": "Linear"}], "run.layers[0].name"),
    (("run", "flush_seconds"), None, "run.flush_seconds"),
    (("run", "buffer_rows"), 0, "run.buffer_rows"),  # the right type, refused by HistoryConfig
    (("run", "output_dir"), 7, "run.output_dir"),
    (("run", "notes"), "a note", "run.notes"),
    (("notes",), [1, 2], "notes[0]"),
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small finished run (3 samples), written once for the module."""
    directory = tmp_path_factory.mktemp("finished") / "stats"
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    return directory


def copy_with(finished: Path, target: Path, path: tuple[str, ...], value: Any) -> Path:
    """A copy of the finished run whose state has `value` at `path`."""
    target.mkdir()
    for name in ("history.parquet", "result.json", "index.md"):
        (target / name).write_bytes((finished / name).read_bytes())
    state = json.loads((finished / ".state.json").read_text(encoding="utf-8"))
    node = state
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (target / ".state.json").write_text(json.dumps(state), encoding="utf-8")
    return target


def no_traceback(result: Any) -> None:
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(("path", "value", "name"), BAD_VALUES, ids=[c[2] for c in BAD_VALUES])
def test_a_bad_value_is_a_one_line_error_and_finalize_recovers(
    finished: Path, tmp_path: Path, path: tuple[str, ...], value: Any, name: str
) -> None:
    run = copy_with(finished, tmp_path / "run", path, value)
    with pytest.raises(StateTypeError) as caught:
        read_state(run)
    message = str(caught.value)
    assert "\n" not in message
    assert f"field {name!r}" in message
    assert ".state.json" in message

    shown = cli_in_process("show", run)  # reads the history, says the state is unreadable
    no_traceback(shown)
    assert shown.returncode == 0, shown.stderr
    assert name in "".join((shown.stdout + shown.stderr).split())  # show wraps its lines
    if name == "rows_recorded":  # the drawing commands read the state like show (once is enough)
        no_traceback(cli_in_process("compare", run, finished))
        no_traceback(cli_in_process("plot", run, "-o", tmp_path / "trends.png"))
        no_traceback(cli_in_process("heatmap", run))

    rows = pl.read_parquet(finished / "history.parquet")
    done = cli_in_process("finalize", run)
    no_traceback(done)
    # Recovered from history: the rows stay, the state is valid again and says what happened.
    assert pl.read_parquet(run / "history.parquet").equals(rows)
    recovered = read_state(run)
    assert recovered.run_info_recovered
    assert recovered.counts is not None
    assert recovered.counts.samples == 3
    assert any(name in note for note in recovered.notes)
    assert name in (run / "index.md").read_text(encoding="utf-8")
    no_traceback(cli_in_process("finalize", run))  # and again: idempotent


def test_a_newer_schema_is_one_clear_message_in_every_command(
    finished: Path, tmp_path: Path
) -> None:
    run = copy_with(finished, tmp_path / "run", ("schema_version",), 99)
    before = (run / ".state.json").read_bytes()
    commands = {
        "finalize": ("finalize", run),
        "show": ("show", run),
        "compare": ("compare", run, finished),
        "plot": ("plot", run, "-o", tmp_path / "trends.png"),
        "heatmap": ("heatmap", run),
    }
    for command, args in commands.items():
        result = cli_in_process(*args)
        no_traceback(result)
        said = " ".join((result.stdout + result.stderr).split())  # show wraps its lines
        assert "schema version 99" in said, (command, said)
        assert "newer than this torchinstruments reads" in said, (command, said)
    assert (run / ".state.json").read_bytes() == before  # never overwritten


def test_a_leftover_tensorboard_folder_is_refused_never_mixed(tmp_path: Path) -> None:
    run = tmp_path / "stats"
    (run / "tensorboard").mkdir(parents=True)
    leftover = run / "tensorboard" / "events.out.tfevents.1.host.1.0"
    leftover.write_bytes(b"an earlier run's histograms")
    model = nn.Linear(2, 2)
    with pytest.raises(FileExistsError, match=r"tensorboard"):
        inject_observer(model, output_dir=run)
    assert sorted(p.name for p in run.rglob("*")) == [
        "events.out.tfevents.1.host.1.0",
        "tensorboard",
    ]
    assert leftover.read_bytes() == b"an earlier run's histograms"
