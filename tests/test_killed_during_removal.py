"""A process killed inside `remove_observer` says so: "killed during removal", never "ended
without remove_observer".

Removal flushes every row to history.parts/ (or the loss ledger) before it merges, so a kill
during the merge or result.json loses no row and the live run's counts are exact: the state file
says removal began, `show` says it was interrupted there (no process holds its lock), and
`finalize` completes the run from the counts removal wrote, "complete" with the kill noted. The
child is this file run as a script: it kills itself with SIGKILL as the named step of the
finish begins, a real kill at a known point (each point's child forked from one process that
imported torch, `_forked`). A rank that never called remove_observer, whose finish at the
process's exit a SIGTERM cuts, is said as that finish cut wherever it is read, and `finalize`
leaves one note saying so, never "finished" beside "cut".
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from _forked import fork_each, run_forked, stderr_of
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    inject_observer,
    remove_observer,
)

from conftest import page_prose, run_cli

ROWS_PER_SAMPLE = 2 * len(DEFAULT_METRICS) * 2  # Linear, ReLU; output and gradient
STEPS = 3


def child_main(directory: Path, killed_at: str) -> None:
    """Run STEPS sampled steps into `directory` and remove the observer, SIGKILLed as the
    finish calls `killed_at` (a function `rundir.finish` calls). A point named `AT_EXIT`:
    rank 1 of 2 of a torchrun job (rank_policy="all") that never calls remove_observer; the
    run's finish at the process's exit is cut by a SIGTERM, as torchrun stops the ranks left
    when one dies."""
    from torchinstruments.rundir import finish

    at_exit = killed_at == AT_EXIT
    sent = signal.SIGTERM if at_exit else signal.SIGKILL

    def killed(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), sent)

    setattr(finish, "merge_history" if at_exit else killed_at, killed)
    os.environ.update({"RANK": "1", "WORLD_SIZE": "2"} if at_exit else {})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        rank_policy="all" if at_exit else "rank0",
    )
    for step in range(STEPS):
        model(torch.full((2, 3), float(step + 1))).sum().backward()
    if not at_exit:
        remove_observer(model)


KILLS = [
    ("merge_history", "merging history.parts/ into history.parquet"),
    ("write_result", "writing result.json"),
]
AT_EXIT = "merge_history_at_exit"  # the finish at the exit without remove_observer, cut


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each kill point's child, forked from one process (`_forked`), into `root/<point>/run`;
    their exit statuses."""
    root = tmp_path_factory.mktemp("killed")
    return root, run_forked(__file__, root, [*(killed_at for killed_at, _ in KILLS), AT_EXIT])


@pytest.mark.parametrize(("killed_at", "doing"), KILLS)
def test_a_process_killed_during_removal_is_said_killed_during_removal(
    killed: tuple[Path, dict[str, int]], killed_at: str, doing: str
) -> None:
    root, codes = killed
    directory = root / killed_at / "run"
    assert codes[killed_at] == -signal.SIGKILL, stderr_of(root, killed_at)
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert state["status"] == "in progress"
    assert state["removal_step"] == (
        "history.parquet" if killed_at == "merge_history" else "result.json"
    )
    shown = run_cli("show", directory)
    assert shown.returncode == 0, shown.stderr
    said = " ".join(shown.stdout.split())
    assert f"interrupted during remove_observer, while {doing}: no process holds" in said
    assert "(killed or crashed)" in said

    finalized = run_cli("finalize", directory)
    assert finalized.returncode == 0, finalized.stderr
    said = " ".join(finalized.stdout.split())
    assert (
        f"remove_observer did not finish the run: its process was killed or crashed while {doing}"
        in said
    )
    # the live run's exact counts, not lower bounds rebuilt from history
    assert f"{STEPS} root forwards, {STEPS} samples, {STEPS} with output gradients" in (
        finalized.stdout
    )
    history = pl.read_parquet(directory / "history.parquet")
    assert history.height == STEPS * ROWS_PER_SAMPLE
    assert sorted(history["sample_id"].unique().to_list()) == list(range(STEPS))
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert state["status"] == "complete"
    assert state["removal_step"] is None
    assert state["interrupted"] is False
    assert state["rows_recorded"] == STEPS * ROWS_PER_SAMPLE
    page = (directory / "index.md").read_text("utf-8")
    assert "ended without remove_observer" not in page_prose(directory)
    assert "**State: complete.**" in page
    assert f"its process was killed or crashed while {doing}" in page
    shown = " ".join(run_cli("show", directory).stdout.split())
    assert (
        "state: complete (remove_observer did not finish the run: its process was killed" in shown
    )


def test_a_finish_at_exit_without_remove_observer_cut_by_sigterm_is_said_so_everywhere(
    killed: tuple[Path, dict[str, int]],
) -> None:
    from test_rank_parent_readers import observe_rank

    root, codes = killed
    parent = root / AT_EXIT / "run"
    directory = parent / "rank-001"
    assert codes[AT_EXIT] == -signal.SIGTERM, stderr_of(root, AT_EXIT)
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert (state["status"], state["removal_step"]) == ("in progress", "history.parquet")
    finishing = "the run's finish at the process's exit (without remove_observer)"
    doing = "merging history.parts/ into history.parquet"
    # the rank's own page, written as the finish began (its last flush), and its status query
    assert (
        f"**State: in progress.** Being finished: as this page was written, {finishing} was "
        "writing its last rows to history.parts/"
    ) in page_prose(directory)
    assert _status_query(directory) == (
        f"status: interrupted during {finishing}: no process holds the run's lock (killed or "
        "crashed); finalize completes it"
    )
    said = " ".join(run_cli("show", directory).stdout.split())
    assert f"state: interrupted during {finishing}, while {doing}: no process holds" in said
    # the parent's page, rewritten as rank 0 finishes, and its rank query
    observe_rank(parent, 0)
    page = (parent / "index.md").read_text("utf-8").splitlines()
    assert (
        f"| 1 | `rank-001/` | not finished: its process ended during {finishing}, while {doing} "
        "(killed or crashed) | - | - |"
    ) in page
    blocks = re.findall(r"^```python\n(.*?)^```", "\n".join(page) + "\n", re.M | re.S)
    scope: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(blocks[0], scope)
    assert scope["rank_state"](directory, scope["state_of"](directory)) == (
        f"not finished: its process ended during {finishing} (killed or crashed)"
    )
    everywhere = " ".join([said, *page, run_cli("show", parent).stdout])
    assert "during remove_observer" not in everywhere

    finalized = run_cli("finalize", directory)
    assert finalized.returncode == 0, finalized.stderr
    # one note, in place of "the run was finished at the process's exit": never beside it
    note = (
        "remove_observer was not called: the run was being finished at the process's exit; that "
        f"finish did not complete: its process was killed or crashed while {doing} (or that "
        "finish gave that write up on a file system that stopped answering); every row it "
        "recorded had reached history.parts/ or the loss ledger before, and `finalize` "
        "completed the run from the counts that finish had written"
    )
    assert f"state: complete ({note})" in " ".join(finalized.stdout.split())
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert (state["status"], state["notes"], state["counts"]["notes"]) == (
        "complete",
        [note],
        [note],
    )
    assert f"{STEPS} root forwards, {STEPS} samples, {STEPS} with output gradients" in (
        finalized.stdout
    )
    prose = page_prose(directory)
    assert "**State: complete.**" in prose
    assert f"**Note:** {note}" in prose
    assert "remove_observer did not finish" not in prose
    assert "the run was finished" not in prose
    shown = " ".join(run_cli("show", directory).stdout.split())
    assert "state: complete (remove_observer was not called: the run was being finished" in shown


def _status_query(directory: Path) -> str:
    """What index.md's status query prints (its setup block, then the status block)."""
    page = (directory / "index.md").read_text("utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", page, re.M | re.S)
    scope: dict[str, Any] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(blocks[0], scope)
        exec(next(b for b in blocks if 'print("status:"' in b), scope)
    return printed.getvalue().splitlines()[0]


if __name__ == "__main__":
    killed_at = fork_each(Path(sys.argv[1]), sys.argv[2:])
    if killed_at is not None:
        child_main(Path(sys.argv[1]) / killed_at / "run", killed_at)
