"""Each killed attempt's loss bound quotes the flush interval that attempt ran with.

A run continued after a kill and killed again has two attempts whose last flush interval may
be lost, each with its own HistoryConfig. index.md's state line bounds what each may have lost
by its own flush_seconds, never the last attempt's for both.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from _fork_server import child_stderr, kill_all_when_ready, serve
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.state import read_state

from conftest import cli_in_process


def child_main(directory: Path, flush_seconds: float, resume: bool) -> None:
    """An attempt with its own flush interval that takes two steps, then waits to be killed."""
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    inject_observer(
        net,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(flush_seconds=flush_seconds),
        resume=resume,
    )
    for _ in range(2):
        net(torch.randn(2, 3)).sum().backward()
    print("stepped", flush=True)
    time.sleep(120)


# Attempt 0 (flush_seconds=20) killed, then attempt 1 (flush_seconds=30) killed, both into the
# run `stats` beside their own folders (`_fork_server.kill_all_when_ready` gives each `root/<name>`).
ATTEMPTS = {
    "attempt-0": lambda directory: child_main(directory.parent / "stats", 20.0, False),
    "attempt-1": lambda directory: child_main(directory.parent / "stats", 30.0, True),
}


@pytest.fixture(scope="module")
def killed_twice_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run killed twice (`ATTEMPTS`, each a child forked from one process that imported
    torch), once for the file, with a pristine copy beside it: both tests finalize the same
    two killed attempts."""
    root = tmp_path_factory.mktemp("killed")
    codes = kill_all_when_ready(__file__, root, "stepped", list(ATTEMPTS), in_turn=True)
    for attempt, code in codes.items():
        assert code == -signal.SIGKILL, child_stderr(root, attempt)
    shutil.copytree(root / "stats", root / "pristine", symlinks=True)
    return root


@pytest.fixture
def run(killed_twice_once: Path) -> Path:
    """The run killed twice, as the second kill left it, at the path it ran in."""
    directory = killed_twice_once / "stats"
    shutil.rmtree(directory)
    shutil.copytree(killed_twice_once / "pristine", directory, symlinks=True)
    return directory


def test_each_killed_attempt_quotes_its_own_flush_seconds(run: Path) -> None:
    finalize(run)

    assert [a.ended for a in read_state(run).attempts] == ["killed", "killed"]
    index = (run / "index.md").read_text(encoding="utf-8")
    state_line = next(line for line in index.splitlines() if line.startswith("**State:"))
    assert "flush_seconds=20.0 s for attempt 0, 30.0 s for attempt 1" in state_line
    assert "flush_seconds=30.0 s when" not in state_line


def test_finalize_says_the_rows_of_several_killed_attempts_in_the_plural(run: Path) -> None:
    """finalize's summary names both killed attempts, so what it says of their rows is theirs,
    not "it"."""
    done = cli_in_process("finalize", run)
    assert done.returncode == 0, done.stderr
    line = next(s for s in done.stdout.splitlines() if s.startswith("state: interrupted"))
    assert "attempt(s) 0-1 ended without remove_observer" in line
    assert "every row they wrote is in history.parquet" in line
    assert "rows of their last flush intervals may be missing" in line
    assert " it wrote " not in line


def scenario(directory: Path, args: Sequence[str]) -> None:
    """A child of the server: the attempt `args[0]`, its own folder `directory`."""
    ATTEMPTS[args[0]](directory)


if __name__ == "__main__":
    serve(scenario)
