"""A process killed inside `remove_observer` says so: "killed during removal", never "ended
without remove_observer".

Removal flushes every row to history.parts/ (or the loss ledger) before it merges, so a kill
during the merge or result.json loses no row and the live run's counts are exact: the state file
says removal began, `show` says it was interrupted there (no process holds its lock), and
`finalize` completes the run from the counts removal wrote, "complete" with the kill noted. The
child is this file run as a script: it kills itself with SIGKILL as the named step of the
finish begins, a real kill at a known point (each point's child forked from one process that
imported torch, `_forked`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

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
    finish calls `killed_at` (a function `rundir.finish` calls)."""
    from torchinstruments.rundir import finish

    def killed(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(finish, killed_at, killed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for step in range(STEPS):
        model(torch.full((2, 3), float(step + 1))).sum().backward()
    remove_observer(model)


KILLS = [
    ("merge_history", "merging history.parts/ into history.parquet"),
    ("write_result", "writing result.json"),
]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each kill point's child, forked from one process (`_forked`), into `root/<point>/run`;
    their exit statuses."""
    root = tmp_path_factory.mktemp("killed")
    return root, run_forked(__file__, root, [killed_at for killed_at, _ in KILLS])


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


if __name__ == "__main__":
    killed_at = fork_each(Path(sys.argv[1]), sys.argv[2:])
    if killed_at is not None:
        child_main(Path(sys.argv[1]) / killed_at / "run", killed_at)
