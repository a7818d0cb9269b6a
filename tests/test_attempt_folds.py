"""A job restarted thousands of times keeps a state file of bounded size: the finished attempts
between the first and the last ones are folded, each run of alike ones into one entry with
their counts summed, and every reader still counts each attempt."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.rundir.attempt_folds import KEPT_FIRST, KEPT_LAST
from torchinstruments.rundir.attempts import KILLED, REMOVED
from torchinstruments.rundir.state import read_state, write_state

from conftest import cli_in_process

EARLIER = 200  # attempts before the real restart: attempt 0 and 199 without a sample


def _attempt(directory: Path) -> None:
    """One process of the job: one sampled step, removed."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1), resume=True)
    model(torch.ones(2, 3)).sum().backward()
    remove_observer(model)


def _restarted_often(directory: Path, ended: str = REMOVED) -> None:
    """Attempt 0 took one sample; attempts 1 to EARLIER - 1 each started and ended before
    their first root forward (a job preempted at once, again and again), as their removals
    (`ended` "removed"), or the finish of their kill ("killed", counted from rows: none),
    would have written them into the state."""
    _attempt(directory)
    state = read_state(directory)
    [first] = state.attempts
    killed = ended == KILLED
    empty = [
        dataclasses.replace(
            first,
            attempt=n,
            first_sample_id=1,
            first_forward_index=1,
            root_forwards=0,
            samples=0,
            backward_samples=0,
            train_forwards=None if killed else 0,
            eval_forwards=None if killed else 0,
            rows=None if killed else 0,
            no_grad_samples=None,
            ended=ended,
            continued_by="resume=True",
        )
        for n in range(1, EARLIER)
    ]
    if killed:
        state = dataclasses.replace(state, interrupted=True, counts_recovered=True)
    write_state(directory, dataclasses.replace(state, attempts=(first, *empty)))


def test_a_job_restarted_often_folds_its_finished_attempts_and_counts_each(
    tmp_path: Path,
) -> None:
    """The restart after 200 attempts keeps the first KEPT_FIRST and the last KEPT_LAST entries
    one by one and folds the 144 between into one entry whose counts are theirs summed; index.md
    and `show` still say 201 attempts, each removed, the run is complete (the folded entry's
    rows are checked against history's rows of its attempts), and a further restart keeps the
    same number of entries: the state does not grow with the job's restarts."""
    directory = tmp_path / "job"
    _restarted_often(directory)
    _attempt(directory)

    state = json.loads((directory / ".state.json").read_text("utf-8"))
    entries = state["attempts"]
    assert len(entries) == KEPT_FIRST + 1 + KEPT_LAST
    assert [(e["attempt"], e.get("last_attempt")) for e in entries[: KEPT_FIRST + 2]] == [
        *((n, None) for n in range(KEPT_FIRST)),
        (KEPT_FIRST, EARLIER - KEPT_LAST),
        (EARLIER - KEPT_LAST + 1, None),
    ]
    folded = entries[KEPT_FIRST]
    assert (folded["ended"], folded["samples"], folded["rows"], folded["train_forwards"]) == (
        REMOVED,
        0,
        0,
        0,
    )
    assert entries[-1]["attempt"] == EARLIER
    assert entries[-1]["first_sample_id"] == 1
    assert state["status"] == "complete", state["problems"]
    history = pl.read_parquet(directory / "history.parquet")
    assert history.group_by("attempt").agg(pl.col("sample_id").unique()).sort("attempt").rows() == [
        (0, [0]),
        (EARLIER, [1]),
    ]

    page = (directory / "index.md").read_text("utf-8")
    assert f"This run was written in {EARLIER + 1} attempts" in page
    assert f"| ... | {EARLIER + 1 - 12} more attempts, counted in `.state.json`" in page
    shown = cli_in_process("show", directory)
    assert shown.returncode == 0, shown.stderr
    said = " ".join(shown.stdout.split())
    assert (
        f"attempts: {EARLIER + 1}, continued with resume=True (removed: attempts 0-{EARLIER})"
        in said
    )

    _attempt(directory)
    again = json.loads((directory / ".state.json").read_text("utf-8"))["attempts"]
    assert len(again) == len(entries)
    assert again[KEPT_FIRST]["last_attempt"] == EARLIER - KEPT_LAST + 1
    assert sum(e["samples"] for e in again) == 3  # the entries still add up to the run's samples


def test_a_job_preempted_often_folds_its_killed_attempts_and_names_each(tmp_path: Path) -> None:
    """A preempted job's attempts end killed (SIGTERM writes their rows, then ends the process):
    those between the first and last ones fold too, into one killed entry, while the state
    line and `show` still name each killed attempt, as ranges, and no id they may have skipped
    reads as rows missing."""
    directory = tmp_path / "job"
    _restarted_often(directory, KILLED)
    _attempt(directory)

    state = json.loads((directory / ".state.json").read_text("utf-8"))
    entries = state["attempts"]
    assert len(entries) == KEPT_FIRST + 1 + KEPT_LAST
    folded = entries[KEPT_FIRST]
    assert (folded["attempt"], folded["last_attempt"], folded["ended"]) == (
        KEPT_FIRST,
        EARLIER - KEPT_LAST,
        KILLED,
    )
    assert (state["status"], state["problems"]) == ("interrupted", [])
    page = " ".join((directory / "index.md").read_text("utf-8").split())
    assert f"attempt(s) 1-{EARLIER - 1} ended without remove_observer" in page
    shown = cli_in_process("show", directory)
    said = " ".join(shown.stdout.split())
    assert f"(removed: attempts 0, {EARLIER}; killed: attempts 1-{EARLIER - 1})" in said
    facts = json.loads(cli_in_process("show", directory, "--format", "json").stdout)["run"]
    ends = ["removed", *["killed"] * (EARLIER - 1), "removed"]  # one per attempt, folded or not
    assert (facts["attempt_ends"], len(facts["attempt_samplers"])) == (ends, EARLIER + 1)
