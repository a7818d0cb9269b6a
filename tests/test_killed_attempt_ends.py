"""Every place that states how an attempt of a continued run ended says the same true thing.

An attempt killed during remove_observer's last flush (its flush thread writing the last rows
to history.parts/) was not an attempt that "ended without remove_observer": remove_observer was
called and the process died inside it. Once a later attempt continued the run, the state
file's attempt entry, index.md's state line, counts line and Attempts table, and `show` must
all say so, and a plain kill of another attempt of the same run is still said as one. A sample
the kill cut before anything of it reached the disk keeps its ids: the next attempt never uses
them again. The children are forked from this file run once as a script (`_fork_server`): real
processes, SIGKILLed at a known point.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import polars as pl
import pytest
import torch
from _fork_server import ForkServer, serve
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from _events import event_steps
from conftest import cli_in_process, page_prose

STEPS = 3
REMOVING: list[bool] = []  # the child's: remove_observer was called
DURING = (
    "was killed or crashed during remove_observer, while writing its last rows to history.parts/"
)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def child_main(directory: Path, killed_at: str, resume: bool) -> None:
    """STEPS sampled steps into `directory`, SIGKILLed at `killed_at`: "last_flush" once
    removal's final flush wrote the last part, "before_removal" before remove_observer,
    "in_forward" inside the next sampled forward (nothing of that sample reaches the disk);
    "exit" ends the script there, never calling remove_observer (the run is finished at the
    exit)."""
    from torchinstruments.rundir.writer import HistoryWriter

    flush = HistoryWriter.flush

    def flushed_then_killed(self: HistoryWriter) -> None:  # the first rows flush too
        flush(self)
        if REMOVING:
            _kill()

    HistoryWriter.flush = flushed_then_killed
    model = _model()
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1), resume=resume)
    for step in range(STEPS):
        model(torch.full((2, 3), float(step + 1))).sum().backward()
    if killed_at in ("before_removal", "in_forward"):
        # Killed once TensorBoard's writer thread has put the last sample's events on disk:
        # they are what proves the attempt's root forwards, and under load that thread may
        # lag the step (a lagging one left sample STEPS - 1 with no row and no event, so the
        # id mark counted two samples begun with nothing on disk, not one).
        deadline = time.monotonic() + 60
        while STEPS - 1 not in event_steps(directory) and time.monotonic() < deadline:
            time.sleep(0.05)
    if killed_at == "before_removal":
        _kill()
    if killed_at == "in_forward":  # sample STEPS began (its ids taken), then the process died
        nn.ReLU.forward = lambda self, x: _kill()  # type: ignore[method-assign]
        model(torch.ones(2, 3))
    if killed_at == "exit":  # no kill: the script ends without remove_observer
        return
    REMOVING.append(True)
    remove_observer(model)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU())


def scenario(directory: Path, args: Sequence[str]) -> None:
    """A child of the server: `child_main` of the run `args[0]`, killed at `args[1]`, a new
    run or a resumed one (`args[2]`)."""
    child_main(Path(args[0]), args[1], args[2] == "resume")


def _ended(child_at: str) -> int:
    """How a child killed at `child_at` ends: SIGKILL, or its script's end ("exit")."""
    return 0 if child_at == "exit" else -signal.SIGKILL


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This file run once as a script that imported torch: it forks every attempt when asked
    (`_fork_server`), so they cost one import."""
    server = ForkServer(__file__, tmp_path_factory.mktemp("server") / "server.err")
    yield server
    server.close()


def _killed(server: ForkServer, files: Path, directory: Path, killed_at: str, resume: bool) -> None:
    """An attempt of `directory` in a child of the server (its own files in `files`), which
    must end as `killed_at` says."""
    mode = "resume" if resume else "new"
    child = server.start(files, "attempt", directory, killed_at, mode)
    try:
        code = child.wait(120)
    finally:
        child.kill()
    assert code == _ended(killed_at), child.stderr()


FIRST_ATTEMPTS = ["before_removal", "last_flush", "exit", "in_forward"]


@pytest.fixture(scope="module")
def first_attempts(tmp_path_factory: pytest.TempPathFactory, server: ForkServer) -> Path:
    """Each first attempt's child (`child_main` of a new run) into `root/<killed_at>/run`,
    all forked at once from one process that imported torch (`_fork_server`), and a pristine
    copy of the one killed before remove_observer beside them: three tests continue that same
    attempt."""
    root = tmp_path_factory.mktemp("killed")
    children = {
        at: server.start(root / at, "child", root / at / "run", at, "new") for at in FIRST_ATTEMPTS
    }
    try:
        codes = {at: child.wait(120) for at, child in children.items()}
    finally:
        for child in children.values():
            child.kill()
    for at, code in codes.items():
        assert code == _ended(at), children[at].stderr()
    shutil.copytree(root / "before_removal" / "run", root / "pristine", symlinks=True)
    return root


@pytest.fixture
def killed_run(first_attempts: Path) -> Path:
    """The run whose attempt 0 was killed before removal, as the kill left it, at the path it
    ran in (its state file and index.md name that path)."""
    directory = first_attempts / "before_removal" / "run"
    shutil.rmtree(directory)
    shutil.copytree(first_attempts / "pristine", directory, symlinks=True)
    return directory


def _removed_attempt(directory: Path, steps: int) -> None:
    model = _model()
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1), resume=True)
    for step in range(steps):
        model(torch.full((2, 3), float(step + 1))).sum().backward()
    remove_observer(model)


def _said(*args: str | Path) -> str:
    done = cli_in_process(*args)
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def _page(directory: Path) -> str:
    return page_prose(directory)


def test_an_attempt_killed_in_its_last_flush_is_said_so_after_the_run_was_continued(
    first_attempts: Path,
) -> None:
    directory = first_attempts / "last_flush" / "run"
    _removed_attempt(directory, 2)

    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert [a["ended"] for a in state["attempts"]] == ["killed during removal", "removed"]
    assert state["status"] == "interrupted"
    history = pl.read_parquet(directory / "history.parquet")
    by_attempt = history.group_by("attempt").agg(pl.col("sample_id").unique().sort())
    assert dict(by_attempt.sort("attempt").iter_rows()) == {0: [0, 1, 2], 1: [3, 4]}

    page = _page(directory)
    shown = _said("show", directory)
    for text in (page, shown):
        assert "ended without remove_observer" not in text
        assert f"attempt(s) 0 {DURING}" in text
    assert "**State: interrupted** in an earlier attempt: attempt(s) 0 was killed" in page
    assert "state: interrupted in an earlier attempt (attempt(s) 0 was killed" in shown
    assert f"counts (lower bounds: in this run, attempt(s) 0 {DURING}, and their" in page
    assert "| 0 | 0 | at least 3 | at least 3 | at least 3 |" in page
    assert "| killed during removal | 0 | 0 | at least 3 |" in page


def test_a_plain_kill_and_a_kill_in_the_last_flush_of_one_run_are_each_said_as_they_were(
    killed_run: Path, server: ForkServer, tmp_path: Path
) -> None:
    """Attempt 0 is killed before remove_observer, attempt 1 in its last flush; `finalize`
    then completes the run. Each is named with its own end, and the note the finalize adds
    names attempt 1, not the run."""
    directory = killed_run
    _killed(server, tmp_path, directory, "last_flush", resume=True)
    finalized = _said("finalize", directory)
    assert "attempt 1: remove_observer did not finish the run" in finalized

    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert [a["ended"] for a in state["attempts"]] == ["killed", "killed during removal"]
    notes = [n for n in state["notes"] if "remove_observer did not finish" in n]
    assert [n.split(":")[0] for n in notes] == ["attempt 1"]
    history = pl.read_parquet(directory / "history.parquet")
    assert history.filter(pl.col("attempt") == 1)["sample_id"].unique().len() == STEPS

    page = _page(directory)
    state_line = page.split("**State: interrupted.** ")[1].split("**Note:**")[0]
    shown = _said("show", directory).split(" model: ")[0]
    for said in (state_line.lower(), shown):
        assert "attempt(s) 0 ended without remove_observer" in said
        assert f"attempt(s) 1 {DURING}" in said
        assert "the process ended" not in said
        assert "the process was killed or crashed during" not in said
    assert "| killed during removal |" in page
    assert "| killed | 0 | 0 |" in page


def test_an_attempt_finished_at_its_exit_is_never_said_removed(first_attempts: Path) -> None:
    """Attempt 0's script ends without remove_observer (its run is finished at the process's
    exit, with exact counts); attempt 1 is removed. The Attempts table and the state file say
    attempt 0 was finished without remove_observer, as its note does, not "removed"."""
    directory = first_attempts / "exit" / "run"
    _removed_attempt(directory, 2)

    state = json.loads((directory / ".state.json").read_text("utf-8"))
    ended = [a["ended"] for a in state["attempts"]]
    assert ended == ["finished without remove_observer", "removed"]
    assert [(a["samples"], a["rows"] is not None) for a in state["attempts"]] == [
        (STEPS, True),
        (2, True),
    ]
    assert (state["status"], state["counts_recovered"]) == ("complete", False)
    history = pl.read_parquet(directory / "history.parquet")
    assert history.group_by("attempt").len().sort("attempt")["len"].to_list() == [
        a["rows"] for a in state["attempts"]
    ]
    page = _page(directory)
    assert "| finished without remove_observer | 0 | 0 | 3 | 3 | 3 |" in page
    assert "attempt 0: remove_observer was not called: the run was finished at the process's" in (
        page
    )
    # the state file's counts name each note's attempt, as its notes and index.md do
    unremoved = [n for n in state["notes"] if "remove_observer was not called" in n]
    assert [n.split(": ")[0] for n in unremoved] == ["attempt 0"]
    assert state["counts"]["notes"] == unremoved
    assert "**State: complete.**" in page
    assert "state: complete" in _said("show", directory)


def test_a_run_whose_last_attempt_was_finished_at_its_exit_never_says_it_was_removed(
    killed_run: Path, server: ForkServer, tmp_path: Path
) -> None:
    directory = killed_run
    _killed(server, tmp_path, directory, "exit", resume=True)

    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert [a["ended"] for a in state["attempts"]] == ["killed", "finished without remove_observer"]
    assert [n.split(": ")[0] for n in state["counts"]["notes"]] == ["attempt 1"]
    assert set(state["counts"]["notes"]) <= set(state["notes"])
    page = _page(directory)
    shown = _said("show", directory)
    assert "the last attempt was removed" not in page + shown
    assert (
        "**State: interrupted** in an earlier attempt: attempt(s) 0 ended without "
        "remove_observer (killed, crashed or preempted) and were finalized when the run was "
        "continued; every row they had written is in history.parquet, and the last attempt was "
        "finished without remove_observer (see its note)."
    ) in page
    assert "the last attempt was finished without remove_observer (see its note)" in shown


def test_finalize_run_again_keeps_the_counts_a_continued_runs_removal_wrote(
    killed_run: Path,
) -> None:
    """Attempt 0 is killed, attempt 1 (every second forward sampled, its last forward not) is
    removed: the run's counts are lower bounds only for attempt 0's part, and attempt 1's own
    are exact (8 root forwards in all, though history's last sampled one is forward_index 6).
    `finalize` run again must keep them, never rebuild them lower from history, so that they
    still add up to the Attempts table."""
    directory = killed_run
    model = _model()
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(2), resume=True)
    for step in range(5):
        model(torch.full((2, 3), float(step + 1))).sum().backward()
    remove_observer(model)
    removed = json.loads((directory / ".state.json").read_text("utf-8"))
    history = pl.read_parquet(directory / "history.parquet")
    assert history["forward_index"].max() == 6
    assert removed["counts"]["root_forwards"] == 8
    assert sum(a["root_forwards"] for a in removed["attempts"]) == 8

    _said("finalize", directory)
    again = json.loads((directory / ".state.json").read_text("utf-8"))
    assert again["counts"] == removed["counts"]
    assert again["attempts"] == removed["attempts"]
    assert "at least 8 root forwards" in _page(directory)


if __name__ == "__main__":
    serve(scenario)


def test_a_sample_killed_before_it_left_anything_keeps_its_ids_in_the_next_attempt(
    first_attempts: Path,
) -> None:
    """Attempt 0 is killed inside its fourth sampled forward (sample 3, forward_index 3): no
    row, no TensorBoard event and no ledger entry of it exists, yet it took its ids (the
    run's id mark), so attempt 1 starts at sample_id 4 and forward_index 4, and attempt 0's
    counts (lower bounds from its rows) reach that sample. `finalize` run alone first counts
    it too, from the same mark: the counts it states are those the continued run keeps."""
    directory = first_attempts / "in_forward" / "run"
    assert STEPS not in event_steps(directory)
    held = pl.read_parquet(directory / "history.parts")["sample_id"].unique().to_list()
    assert 0 in held  # the first sample's rows, and maybe more
    assert max(held) < STEPS
    finalized = cli_in_process("finalize", directory)
    assert finalized.returncode == 0, finalized.stderr
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert [(a["ended"], a["samples"], a["root_forwards"]) for a in state["attempts"]] == [
        ("killed", STEPS + 1, STEPS + 1)
    ]
    counts = state["counts"]
    assert (counts["samples"], counts["root_forwards"]) == (STEPS + 1, STEPS + 1)
    page = _page(directory)
    assert "at least 4 root forwards, at least 4 samples, at least " in page
    assert (
        "**Begun, nothing on disk:** the run's id mark (.lock) shows 1 sample begun (up to "
        "sample_id 3) of which no row and no TensorBoard event reached the disk"
    ) in page
    _removed_attempt(directory, 2)

    history = pl.read_parquet(directory / "history.parquet")
    first = history.filter(pl.col("attempt") == 0)
    assert first["sample_id"].max() <= STEPS - 1  # type: ignore[operator]
    later = history.filter(pl.col("attempt") == 1)
    assert later["sample_id"].unique().sort().to_list() == [STEPS + 1, STEPS + 2]
    assert later["forward_index"].unique().sort().to_list() == [STEPS + 1, STEPS + 2]
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    counted = [
        (a["ended"], a["first_sample_id"], a["samples"], a["root_forwards"])
        for a in state["attempts"]
    ]
    assert counted == [("killed", 0, STEPS + 1, STEPS + 1), ("removed", STEPS + 1, 2, 2)]
    assert state["counts"]["samples"] == STEPS + 3
    assert "| killed | 0 | 0 | at least 4 | at least 4 |" in _page(directory)
