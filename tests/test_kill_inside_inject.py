"""A job killed inside `inject_observer` is restarted with `resume=True` and continues its run.

A requeued job is killed whenever the scheduler says, including while `inject_observer` writes
the run's first files (result.json's catalog, the state file, index.md). Whatever of them reached
the disk, `finalize` must complete the directory and a restart with `resume=True` must continue
it; a directory that both refuse would make every restart of the job fail at inject. The child
is this file run as a script: it kills itself with SIGKILL right after the named file is written,
a real kill at a known point (each point's child forked from one process that imported torch,
`_forked`).
"""

from __future__ import annotations

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
    HistoryConfig,
    inject_observer,
    remove_observer,
)

from conftest import run_cli

ROWS_PER_SAMPLE = 2 * len(DEFAULT_METRICS) * 2  # Linear, ReLU; output and gradient
CONFIG = HistoryConfig(buffer_rows=ROWS_PER_SAMPLE)
STEPS = 2


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU())


def child_main(directory: Path, written: str) -> None:
    """Inject into `directory`, killing this process right after `written` (a function of
    sinks.directory that writes one of the run's first files) returns."""
    from torchinstruments.sinks import directory as directory_sink

    original = getattr(directory_sink, written)

    def then_killed(*args: object, **kwargs: object) -> object:
        original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(directory_sink, written, then_killed)
    inject_observer(model(), output_dir=directory, sampler=EveryNForwardsSampler(1))


WRITTEN = ["write_catalog", "write_state", "write_index"]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each kill point's child, forked from one process (`_forked`), into `root/<written>/run`;
    their exit statuses."""
    root = tmp_path_factory.mktemp("killed")
    return root, run_forked(__file__, root, WRITTEN)


@pytest.mark.parametrize("written", WRITTEN)
def test_a_job_killed_inside_inject_is_finalized_and_continued_with_resume(
    killed_runs: tuple[Path, dict[str, int]], written: str
) -> None:
    root, codes = killed_runs
    directory = root / written / "run"
    assert codes[written] == -signal.SIGKILL, stderr_of(root, written)
    finalized = run_cli("finalize", directory)
    assert finalized.returncode == 0, finalized.stderr
    restarted = model()
    inject_observer(
        restarted,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=CONFIG,
        resume=True,
    )
    for step in range(STEPS):
        restarted(torch.full((2, 3), float(step + 1))).sum().backward()
    remove_observer(restarted)
    history = pl.read_parquet(directory / "history.parquet")
    # exactly the restarted attempt's rows: the killed one wrote none
    assert history.height == STEPS * ROWS_PER_SAMPLE
    assert history.group_by("attempt").agg(pl.col("sample_id").unique().sort()).rows() == [
        (1, list(range(STEPS)))
    ]
    attempts = (directory / "index.md").read_text("utf-8").split("## Attempts", 1)[1]
    killed = next(line for line in attempts.splitlines() if line.startswith("| 0 |"))
    cells = [cell.strip() for cell in killed.strip("|").split("|")]
    assert cells[2] == "killed"
    # it took no sample and saw no root forward that anything shows: a dash, never the ids the
    # attempt that continued it then took (0 and 0 both times would read as one start)
    assert cells[3:5] == ["-", "-"]
    assert cells[5:] == ["unknown", "unknown", "unknown"]  # nobody wrote its counts: never 0
    assert "`-`: the attempt has no sample" in " ".join(attempts.split())
    continued = next(line for line in attempts.splitlines() if line.startswith("| 1 |"))
    assert [cell.strip() for cell in continued.strip("|").split("|")][2:] == [
        "removed",
        "0",
        "0",
        str(STEPS),
        str(STEPS),
        str(STEPS),
    ]


if __name__ == "__main__":
    written = fork_each(Path(sys.argv[1]), sys.argv[2:])
    if written is not None:
        child_main(Path(sys.argv[1]) / written / "run", written)
