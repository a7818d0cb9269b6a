"""A killed attempt's row in the Attempts table counts what the run's counts count for it.

The child takes a sample every second forward (forward_index 0, 2, 4, 6, 8) over ten steps and
is killed: only the first sample's rows reach history (written right after it), while the
TensorBoard events of all five are on disk. `finalize` raises the run's counts to what the
events prove (at least 9 root forwards, 5 samples); the attempt's row must say the same, not
the 1 and 1 its rows alone give, so that the Attempts table adds up to the run's counts.
The killed children are forked at once from one process that imported torch (`_fork_server`).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import polars as pl
import pytest
import torch
from _fork_server import child_stderr, kill_all_when_ready, serve
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.cli.reader import read_facts
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.state import read_state

from _events import event_steps
from conftest import cli_in_process

STEPS = 10  # samples at forward_index 0, 2, 4, 6, 8
LATER_STEPS = 4


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def child_main(directory: Path, steps: int, resume: bool) -> None:
    """An attempt that takes `steps` training steps, then waits to be killed."""
    net = model()
    config = HistoryConfig(buffer_rows=100_000, flush_seconds=600.0)  # rows stay in memory
    inject_observer(
        net,
        output_dir=directory,
        sampler=EveryNForwardsSampler(2),
        history_config=config,
        resume=resume,
    )
    for _ in range(steps):
        net(torch.randn(2, 3)).sum().backward()
    # Killed once TensorBoard's writer thread has put the last sample's events on disk: what
    # the events prove is the point, and under load that thread may lag the step (`last` is the
    # last sampled forward_index of a first attempt; a resumed one's are met already).
    last = steps - 1 - (steps - 1) % 2
    deadline = time.monotonic() + 60
    while last not in event_steps(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("stepped", flush=True)
    time.sleep(120)


CHILDREN = {
    "new": lambda directory: child_main(directory / "stats", STEPS, False),
    "resume": lambda directory: child_main(directory / "stats", 2, True),
}


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both attempts killed once they said "stepped", into `root/<mode>/stats` ("resume" after
    attempt 0, removed, here): one process imports torch and forks them at once
    (`_fork_server`), each a real process SIGKILLed there."""
    root = tmp_path_factory.mktemp("killed")
    net = model()  # attempt 0 of "resume": forward_index 0-2, samples at 0 and 2, removed
    inject_observer(
        net,
        output_dir=root / "resume" / "stats",
        sampler=EveryNForwardsSampler(2),
        reducers={"bad": _bad},  # fails on every tensor: a note in attempt 0's counts
    )
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError"):
        _steps(net, 3)
    remove_observer(net)
    for mode, code in kill_all_when_ready(__file__, root, "stepped", list(CHILDREN)).items():
        assert code == -signal.SIGKILL, child_stderr(root, mode)
    shutil.copytree(root / "new", root / "idle")  # continued by an attempt without a sample
    shutil.copytree(root / "new", root / "killed")  # as killed: the other tests resume "new"
    return root


def test_a_killed_attempts_row_counts_the_samples_its_events_prove(killed_runs: Path) -> None:
    run = killed_runs / "new" / "stats"
    net = model()
    inject_observer(net, output_dir=run, sampler=EveryNForwardsSampler(2), resume=True)
    for _ in range(LATER_STEPS):
        net(torch.randn(2, 3)).sum().backward()
    remove_observer(net)

    state = read_state(run)
    killed, removed = state.attempts
    assert killed.ended == "killed"
    assert removed.ended == "removed"
    # What the first attempt's events prove: forward_index 8 was sampled, 5 samples in all.
    assert (killed.root_forwards, killed.samples) == (STEPS - 1, STEPS // 2)
    assert (removed.root_forwards, removed.samples) == (LATER_STEPS, LATER_STEPS // 2)
    assert state.counts is not None
    assert state.counts.root_forwards == killed.root_forwards + removed.root_forwards
    assert state.counts.samples == killed.samples + removed.samples
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "| killed | 0 | 0 | at least 9 | at least 5 |" in index


def test_an_attempt_without_a_sample_after_a_kill_says_how_many_samples_history_holds(
    killed_runs: Path,
) -> None:
    """The killed attempt took sample_id 0 to 4 (its events prove them), but only sample 0's
    rows reached history. An attempt that continues it and samples nothing says so in its
    warning: rows of 1 of at least 5 samples, never "holds the earlier attempts' 5 samples"."""
    run = killed_runs / "idle" / "stats"
    net = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_observer(net, output_dir=run, resume=True)
        remove_observer(net)
    said = [str(w.message) for w in caught if "recorded no sample" in str(w.message)]
    assert said == [
        f"torchinstruments: this attempt recorded no sample (0 root forwards seen, none "
        f"sampled): {run} holds none of its rows, and rows of 1 of the at least 5 samples the "
        "earlier attempts took (sample_id 0 to 4 and perhaps more; a killed attempt's last "
        "rows died with it); its index.md's Attempts table says so"
    ]
    assert pl.read_parquet(run / "history.parquet")["sample_id"].unique().to_list() == [0]
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "| killed | 0 | 0 | at least 9 | at least 5 |" in index


def test_a_killed_attempt_counts_its_root_forwards_from_its_own_first_one(
    killed_runs: Path,
) -> None:
    """Attempt 0 (forward_index 0-2, samples at 0 and 2) is removed; attempt 1 begins at
    forward_index 3, which is not sampled, samples forward_index 4 and is killed. Its rows begin
    at its first sample, but its root forwards at its first forward: 2 of them, not 1.
    Attempt 0's custom reducer fails, which its counts' notes say: they survive the rebuild of
    the counts after attempt 1's kill, labelled with their attempt as the state's notes are,
    as does attempt 1's own, that it measures no `bad`."""
    run = killed_runs / "resume" / "stats"
    finalize(run)

    state = read_state(run)
    removed, killed = state.attempts
    assert killed.first_forward_index == 3
    assert (killed.root_forwards, killed.samples) == (2, 1)
    assert state.counts is not None
    assert state.counts.root_forwards == 5 == removed.root_forwards + killed.root_forwards
    assert state.counts.samples == 3 == removed.samples + killed.samples
    note, dropped = state.notes
    assert state.counts.notes == state.notes
    assert note.startswith("attempt 0: ")
    assert "ZeroDivisionError" in note
    # Attempt 1 measures no `bad`: said at its inject, so its kill keeps it too.
    assert dropped.startswith("attempt 1: this attempt measures other metrics than attempt 0")
    assert "(only there: bad; only here: none)" in dropped
    # `show` says the notes index.md holds, and their beginning; its JSON holds them in full.
    shown = cli_in_process("show", run, "--width", "2000").stdout.splitlines()
    assert "notes: 2, in full at the top of index.md:" in shown
    assert f"- {state.notes[0][:147].rstrip()}..." in shown
    facts = json.loads(cli_in_process("show", run, "--format", "json").stdout)["run"]
    assert facts["notes"] == list(state.notes)


def test_a_run_whose_last_attempt_died_before_any_row_keeps_the_counts_its_removed_one_wrote(
    tmp_path: Path,
) -> None:
    """Attempt 0 is removed after 2 forwards (a sample at forward_index 0 only: its last forward
    is not sampled); attempt 1 dies before writing anything. The run's counts,
    rebuilt from history at `finalize`, are lower bounds, never lower than attempt 0's exact
    ones: at least 2 root forwards, not the 1 that history's last forward_index gives."""
    run = tmp_path / "stats"
    net = model()
    inject_observer(net, output_dir=run, sampler=EveryNForwardsSampler(2))
    _steps(net, 2)  # forward_index 0 (sampled) and 1
    remove_observer(net)
    net = model()
    inject_observer(net, output_dir=run, sampler=EveryNForwardsSampler(2), resume=True)
    live = (run / ".state.json").read_bytes()  # as a kill leaves it: attempt 1 in progress
    with pytest.warns(RuntimeWarning, match="recorded no sample"):
        remove_observer(net)
    (run / ".state.json").write_bytes(live)
    # before finalize: attempt 1 is open in the state, and no process holds the run's lock
    shown = cli_in_process("show", run, "--width", "2000").stdout.splitlines()
    assert (
        "attempts: 2, continued with resume=True (removed: attempt 0; ended without "
        "remove_observer, not finalized: attempt 1); each one's counts in index.md's Attempts "
        "table"
    ) in shown
    facts = json.loads(cli_in_process("show", run, "--format", "json").stdout)["run"]
    assert facts["attempt_ends"] == ["removed", "ended without remove_observer, not finalized"]

    done = cli_in_process("finalize", run)
    state = read_state(run)
    removed, killed = state.attempts
    assert (removed.root_forwards, removed.samples, killed.ended) == (2, 1, "killed")
    assert state.counts is not None
    assert (state.counts.root_forwards, state.counts.samples) == (2, 1)
    assert "at least 2 root forwards, at least 1 sample," in done.stdout


def _steps(net: nn.Module, steps: int) -> None:
    for _ in range(steps):
        net(torch.randn(2, 3)).sum().backward()


def _bad(tensor: torch.Tensor) -> float:
    """A custom reducer that fails on every tensor."""
    return 1 / 0


@pytest.mark.parametrize("state_file", ["deleted", "unreadable"])
def test_a_killed_run_without_its_state_file_is_finalized_from_its_events_and_rows(
    killed_runs: Path, state_file: str
) -> None:
    """The state file deleted or not JSON: `finalize` rebuilds a state without attempts, and
    raising them to the samples the events prove raised a bare ValueError (zip of no attempt
    with one end). It finishes, with the counts the events and rows prove."""
    run = killed_runs / f"stateless-{state_file}"
    shutil.copytree(killed_runs / "killed" / "stats", run)
    if state_file == "deleted":
        (run / ".state.json").unlink()
        # `show`'s state line: index.md is there (rendered, never read back), not "missing"
        assert read_facts(run).state == (
            ".state.json missing or unreadable, and no index.md of an older version to read "
            "the settings from (settings and layer order unknown)"
        )
    else:
        (run / ".state.json").write_text("{not json", encoding="utf-8")
    finalize(run)
    state = read_state(run)
    assert state.attempts == ()
    assert state.counts is not None
    assert (state.counts.root_forwards, state.counts.samples) == (STEPS - 1, STEPS // 2)
    assert state.run.sampler == (
        "unknown (.state.json missing or unreadable, and no index.md of an older version to "
        "read the settings from; layers read from result.json's catalog)"
    )


def scenario(directory: Path, args: Sequence[str]) -> None:
    """A child of the server: the child `args[0]` in `directory`."""
    CHILDREN[args[0]](directory)


if __name__ == "__main__":
    serve(scenario)
