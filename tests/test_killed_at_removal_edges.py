"""A process killed at either end of `remove_observer` is said killed during removal, and
index.md never says less than the state file.

At removal's start the last rows are still the flush thread's to write: a kill there may lose
them, so `finalize` calls the run "interrupted" (counts rebuilt from history, lower bounds),
but every reader says remove_observer was called and killed, never "ended without
remove_observer". At its end index.md is written before the state file says the run is
finished, so a kill between the two never leaves a state file saying "complete" beside an
index.md saying "in progress". A run never removed, whose finish at the process's exit a
SIGTERM cuts in that last flush, is said as that finish cut: ended without remove_observer,
never killed during it. The child is this file run as a script: it kills itself with SIGKILL
(SIGTERM at the exit) at the named point, a real kill at a known point (every point's child
forked at once from one process that imported torch, `_fork_server`).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from _fork_server import child_stderr, run_all, serve
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import cli_in_process, page_prose

STEPS = 3
REMOVING: list[bool] = []  # the child's: remove_observer was called (or the exit began)
SENT_TERM: list[bool] = []  # the child's: it ends with a SIGTERM, not a SIGKILL


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGTERM if SENT_TERM else signal.SIGKILL)


def child_main(directory: Path, killed_at: str) -> None:
    """Run STEPS sampled steps into `directory` and remove the observer, SIGKILLed at
    `killed_at`: "last_part" once removal's final flush wrote the last part, "index" as the
    finish writes index.md, "final_state" as it writes the finished state file; `AT_EXIT`:
    no remove_observer, SIGTERMed once the last flush of the run's finish at the exit wrote."""
    from torchinstruments.rundir import finish
    from torchinstruments.rundir.state import RunState
    from torchinstruments.rundir.writer import HistoryWriter

    flush, write_state = HistoryWriter.flush, finish.write_state

    def flushed_then_killed(self: HistoryWriter) -> None:  # the first rows flush too
        flush(self)
        if REMOVING:
            _kill()

    def killed_at_final(directory: Path, state: RunState, *args: Any, **kwargs: Any) -> None:
        if state.removal_step is None:  # the finished state, not a removal step's
            _kill()
        write_state(directory, state, *args, **kwargs)

    SENT_TERM.extend([True] * (killed_at == AT_EXIT))
    if killed_at in ("last_part", AT_EXIT):
        HistoryWriter.flush = flushed_then_killed
    elif killed_at == "index":
        finish.write_index = lambda *args, **kwargs: _kill()
    else:
        finish.write_state = killed_at_final
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    if killed_at == AT_EXIT:  # run before the run's finish at the exit (exit handlers: LIFO)
        atexit.register(REMOVING.append, True)
    for step in range(STEPS):
        model(torch.full((2, 3), float(step + 1))).sum().backward()
    if killed_at != AT_EXIT:
        REMOVING.append(True)
        remove_observer(model)


# The last flush of the run's finish at the process's exit, without remove_observer: a SIGTERM
# there (as torchrun stops the ranks left when one dies).
AT_EXIT = "last_part_at_exit"
KILL_POINTS = ["last_part", "index", "final_state", AT_EXIT]


def scenario(directory: Path, args: Sequence[str]) -> None:
    """A child of the server: `child_main` into `directory/run`, killed at `args[0]`."""
    child_main(directory / "run", args[0])


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each kill point's child, all forked at once from one process (`_fork_server`), into
    `root/<point>/run`; their exit statuses."""
    root = tmp_path_factory.mktemp("killed")
    return root, run_all(__file__, root, KILL_POINTS)


def _killed(killed: tuple[Path, dict[str, int]], killed_at: str) -> tuple[Path, dict[str, object]]:
    """The run directory of `killed_at`'s child, killed there, and its state file."""
    root, codes = killed
    sent = signal.SIGTERM if killed_at == AT_EXIT else signal.SIGKILL
    assert codes[killed_at] == -sent, child_stderr(root, killed_at)
    directory = root / killed_at / "run"
    return directory, json.loads((directory / ".state.json").read_text("utf-8"))


def _said(*args: str | Path) -> str:
    done = cli_in_process(*args)
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def test_a_process_killed_in_removals_last_flush_is_said_killed_during_removal(
    killed: tuple[Path, dict[str, int]],
) -> None:
    directory, state = _killed(killed, "last_part")
    assert state["status"] == "in progress"
    assert state["removal_step"] == "history.parts/"
    shown = _said("show", directory)
    # no process holds its lock: said as what is known, as finalize tells it
    assert (
        "interrupted during remove_observer, while writing its last rows to history.parts/: no "
        "process holds the run's lock (killed or crashed)"
    ) in shown

    finalized = _said("finalize", directory)
    assert "ended without remove_observer" not in finalized
    assert (
        "remove_observer did not finish the run: its process was killed or crashed while "
        "writing its last rows to history.parts/" in finalized
    )
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    # rows still in memory at the kill may be lost: not "complete", and counts are lower bounds
    assert state["status"] == "interrupted"
    assert state["removal_step"] is None
    assert state["rows_recorded"] is None
    history = pl.read_parquet(directory / "history.parquet")
    assert sorted(history["sample_id"].unique().to_list()) == list(range(STEPS))
    page = (directory / "index.md").read_text("utf-8")
    assert "ended without remove_observer" not in page_prose(directory)
    assert "**State: interrupted.** The process was killed or crashed during remove_observer" in (
        page
    )
    shown = _said("show", directory)
    assert "ended without remove_observer" not in shown
    assert (
        "interrupted (finalized after the process was killed or crashed during remove_observer"
        in (shown)
    )


def test_a_sigterm_in_the_last_flush_of_a_finish_at_exit_is_said_as_that_finish_cut(
    killed: tuple[Path, dict[str, int]],
) -> None:
    directory, state = _killed(killed, AT_EXIT)
    assert (state["status"], state["removal_step"]) == ("in progress", "history.parts/")
    assert (
        "interrupted during the run's finish at the process's exit (without remove_observer), "
        "while writing its last rows to history.parts/: no process holds the run's lock"
    ) in _said("show", directory)

    finalized = _said("finalize", directory)
    note = (
        "remove_observer was not called: the run was being finished at the process's exit; that "
        "finish did not complete: its process was killed or crashed while writing its last rows "
        "to history.parts/ (or that finish gave that write up on a file system that stopped "
        "answering); rows it still held in memory may be missing (at most one flush interval's "
        "worth), and `finalize` merged every row it had written and rebuilt the counts from "
        "history (lower bounds)"
    )
    assert "state: interrupted: the process ended without remove_observer; " in finalized
    assert f"({note})" in finalized
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    # remove_observer never ran: its attempt is killed, never "killed during removal"
    assert (state["status"], state["notes"], state["attempts"][-1]["ended"]) == (
        "interrupted",
        [note],
        "killed",
    )
    prose = page_prose(directory)
    assert "**State: interrupted.** The process ended without remove_observer (killed" in prose
    shown = _said("show", directory)
    assert "interrupted (finalized after the process ended without remove_observer:" in shown
    for said in (finalized, prose, shown):
        assert "during remove_observer" not in said
        assert "the run was finished" not in said


@pytest.mark.parametrize("killed_at", ["index", "final_state"])
def test_a_kill_as_removal_writes_index_md_never_leaves_it_behind_the_state(
    killed: tuple[Path, dict[str, int]], killed_at: str
) -> None:
    directory, state = _killed(killed, killed_at)
    page = (directory / "index.md").read_text("utf-8")
    # the state file is what readers trust: it says finished only once index.md says so too
    assert state["status"] == "in progress"
    assert state["removal_step"] == "index.md"
    assert ("**State: complete.**" in page) == (killed_at == "final_state")
    doing = "writing index.md and the final .state.json"
    shown = _said("show", directory)
    assert f"interrupted during remove_observer, while {doing}: no process holds" in shown

    finalized = _said("finalize", directory)
    assert f"its process was killed or crashed while {doing}" in finalized
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert state["status"] == "complete"
    page = (directory / "index.md").read_text("utf-8")
    assert "**State: complete.**" in page
    assert f"its process was killed or crashed while {doing}" in page
    assert "state: complete (remove_observer did not finish the run" in _said("show", directory)


if __name__ == "__main__":
    serve(scenario)
