"""Each killed attempt's loss bound quotes the flush interval that attempt ran with.

A run continued after a kill and killed again has two attempts whose last flush interval may
be lost, each with its own HistoryConfig. index.md's state line bounds what each may have lost
by its own flush_seconds, never the last attempt's for both.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.state import read_state

from conftest import kill_when_ready, run_cli


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


def killed_twice(run: Path) -> None:
    """Attempt 0 (flush_seconds=20) killed, then attempt 1 (flush_seconds=30) killed."""
    kill_when_ready(__file__, "stepped", run, "20", "new")
    kill_when_ready(__file__, "stepped", run, "30", "resume")


@pytest.fixture(scope="module")
def killed_twice_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`killed_twice` once for the file, with a pristine copy beside the run: both tests
    finalize the same two killed attempts, and each child is a fresh interpreter importing
    torch."""
    root = tmp_path_factory.mktemp("killed")
    killed_twice(root / "stats")
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
    done = run_cli("finalize", run)
    assert done.returncode == 0, done.stderr
    line = next(s for s in done.stdout.splitlines() if s.startswith("state: interrupted"))
    assert "attempt(s) 0-1 ended without remove_observer" in line
    assert "every row they wrote is in history.parquet" in line
    assert "rows of their last flush intervals may be missing" in line
    assert " it wrote " not in line


if __name__ == "__main__":
    child_main(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "resume")
