"""A run whose model never reaches remove_observer still ends complete: nothing written is lost,
and index.md says how it ended (collected, or the process's exit and the exception that caused it)."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import polars as pl
import pytest
import torch
from _fork_server import child_stderr, run_all, serve
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import cli_in_process, read_result, run_status


def test_collected_model_finalizes_its_run(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
    del model
    gc.collect()
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history["sample_id"].unique().sort().to_list() == [0, 1]
    assert not (run_dir / "history.parts").exists() or not any(
        (run_dir / "history.parts").iterdir()
    )
    assert [len(layer["tensors"]) for layer in read_result(run_dir)] == [2, 2]


def end_as(ending: str, directory: Path) -> None:
    """A script's run that never reaches remove_observer: five steps, unless at step 2 it
    raises, is interrupted (Ctrl-C), or calls sys.exit; "caught" raises and catches, then goes
    on to the script's end."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for step in range(5):
        model(torch.randn(2, 3)).sum().backward()
        if step == 2:
            if ending == "raise":  # after a forward whose backward never ran (a DDP rank)
                pending = model(torch.randn(2, 3))  # noqa: F841 (alive in the traceback)
                raise RuntimeError("boom at step 2")
            if ending == "ctrl-c":
                raise KeyboardInterrupt
            if ending == "caught":
                try:
                    raise RuntimeError("caught, then the script went on")
                except RuntimeError:
                    pass
            if ending == "sys.exit":
                sys.exit(3)


ENDINGS = [
    ("raise", "the process ended with an uncaught RuntimeError: boom at step 2, and the run "
     "was finished then"),
    ("ctrl-c", "the process ended with an uncaught KeyboardInterrupt (Ctrl-C), and the run "
     "was finished then"),
    ("sys.exit", "the run was finished at the process's exit"),
    ("caught", "the run was finished at the process's exit"),
]  # fmt: skip


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Every ending's script run once, each into `root/<ending>/stats`; their exit statuses.
    This file is the script: one interpreter imports torch, then forks a child per ending, all
    at once (`_fork_server.run_all`); the child runs `end_as` and ends as that script would,
    through the interpreter's exit."""
    root = tmp_path_factory.mktemp("endings")
    return root, run_all(__file__, root, [ending for ending, _ in ENDINGS])


@pytest.mark.parametrize(("ending", "said"), ENDINGS)
def test_a_script_that_stopped_without_removal_says_how_it_ended(
    ended: tuple[Path, dict[str, int]], ending: str, said: str
) -> None:
    root, codes = ended
    run_dir = root / ending / "stats"
    assert (codes[ending] == 0) == (ending == "caught"), child_stderr(root, ending)
    assert run_status(run_dir) == "complete"  # every row recorded is in history.parquet
    stopped = {"caught": 5, "raise": 4}.get(ending, 3)
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history["sample_id"].unique().sort().to_list() == list(range(stopped))
    assert set(history["signal"]) == {"output", "output_gradient"}
    # before: no note at all, and the page read like a loop that ran to its end
    note = f"remove_observer was not called: {said}; it holds the samples taken until then."
    state = json.loads((run_dir / ".state.json").read_text(encoding="utf-8"))
    # the forward the exception left without a backward: said as finished, not removed (it
    # said "when remove_observer was called" and advised removing after the last backward)
    pending = (
        "sample 3: no gradient had reached its outputs when the run was finished without "
        "remove_observer, and they could still receive one (their autograd graph was alive): "
        "it has output rows and no output_gradient rows, with nothing else to mark it (a "
        "forward whose outputs are kept but never backpropagated reads the same)"
    )
    assert state["notes"] == ([note, pending] if ending == "raise" else [note])
    assert note in " ".join((run_dir / "index.md").read_text(encoding="utf-8").split())


def test_a_collected_model_says_its_run_was_finished_then(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 3)).sum().backward()
    del model
    gc.collect()
    state = json.loads((run_dir / ".state.json").read_text(encoding="utf-8"))
    assert state["notes"] == [
        "remove_observer was not called: the run was finished when the observed model was "
        "garbage collected; it holds the samples taken until then."
    ]


def test_a_finish_at_collection_that_a_kill_cut_is_named_as_that_finish(run_dir: Path) -> None:
    from torchinstruments.rundir.state import read_state, write_state

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    for attempt in range(2):  # a job restarted into its run: the second attempt is collected
        inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), resume=True)
        model(torch.randn(2, 3)).sum().backward()
        if attempt == 0:
            remove_observer(model)
    del model
    gc.collect()
    # the state file as that finish leaves it when killed writing result.json (`finish._removal_at`)
    write_state(run_dir, dataclasses.replace(read_state(run_dir), removal_step="result.json"))
    finishing = "the run's finish when the observed model was garbage collected"
    shown = " ".join(cli_in_process("show", run_dir).stdout.split())
    assert f"interrupted during {finishing} (without remove_observer), while writing" in shown
    finalized = cli_in_process("finalize", run_dir)
    assert finalized.returncode == 0, finalized.stderr
    # a continued run's attempts line: that attempt is not finished before finalize finishes it
    assert "(removed: attempt 0; ended without remove_observer, not finalized: attempt 1)" in (
        shown
    )
    state = json.loads((run_dir / ".state.json").read_text(encoding="utf-8"))
    assert (state["status"], len(state["notes"])) == ("complete", 1)
    assert state["notes"][0].startswith(
        "attempt 1: remove_observer was not called: the run was being finished when the observed model was "
        "garbage collected; that finish did not complete: its process was killed or crashed "
        "while writing result.json"
    )


def test_a_second_remove_observer_changes_nothing(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 3)).sum().backward()
    assert remove_observer(model) == run_dir
    page = (run_dir / "index.md").read_bytes()
    with pytest.warns(RuntimeWarning, match="has no observer .* nothing was done"):
        assert remove_observer(model) is None
    assert (run_dir / "index.md").read_bytes() == page
    assert json.loads((run_dir / ".state.json").read_text(encoding="utf-8"))["notes"] == []


def scenario(directory: Path, args: Sequence[str]) -> None:
    """A child of the server: `end_as` the ending `args[0]`, into `directory/stats`."""
    end_as(args[0], directory / "stats")


if __name__ == "__main__":
    serve(scenario)
