"""Each attempt's rows are checked against what that attempt recorded, also after a kill.

A continued run whose first attempt was killed does not know how many rows the whole job
recorded (the killed attempt's count died with it), so the run-wide check of history.parquet
against the rows recorded cannot run. The later attempt, removed, knows its own rows: rows of it
that vanished from history.parts/ before removal (a cleanup job deleted a part) must make the
run INCOMPLETE and be said, never pass as "interrupted in an earlier attempt". The first
attempt is a real process, SIGKILLed after its first part reached the disk.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.layout import list_parts
from torchinstruments.rundir.state import Status, read_state

from conftest import kill_when_ready, wait_for_rows

ROWS_PER_SAMPLE = 2 * len(DEFAULT_METRICS)  # one Linear: output and gradient
CONFIG = HistoryConfig(buffer_rows=ROWS_PER_SAMPLE)
LATER_STEPS = 4


def child_main(directory: Path) -> None:
    """The first attempt: two samples on disk, then it waits to be killed."""
    net = nn.Linear(4, 2)
    inject_observer(
        net, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    for _ in range(2):
        net(torch.ones(3, 4)).sum().backward()
    wait_for_rows(directory, 2 * ROWS_PER_SAMPLE)
    print("written", flush=True)
    time.sleep(120)


def test_rows_of_a_later_attempt_that_vanished_are_said_missing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    kill_when_ready(__file__, "written", run)
    net = nn.Linear(4, 2)
    inject_observer(
        net, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=CONFIG, resume=True
    )
    for _ in range(LATER_STEPS):
        net(torch.ones(3, 4)).sum().backward()
    wait_for_rows(run, LATER_STEPS * ROWS_PER_SAMPLE)
    vanished = list_parts(run)[0]  # one of this attempt's parts (the first's are merged)
    lost = pl.read_parquet(vanished).height
    vanished.unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remove_observer(net)
    said = "\n".join(str(w.message) for w in caught)
    missing = (
        f"history.parquet holds {LATER_STEPS * ROWS_PER_SAMPLE - lost} of the "
        f"{LATER_STEPS * ROWS_PER_SAMPLE} rows attempt 1 recorded; {lost} rows are missing"
    )
    assert missing in said, said
    state = read_state(run)
    assert state.status is Status.INCOMPLETE
    assert missing in " ".join(state.problems)
    assert missing in (run / "index.md").read_text("utf-8")
    history = pl.read_parquet(run / "history.parquet")
    assert history.filter(pl.col("attempt") == 1).height == LATER_STEPS * ROWS_PER_SAMPLE - lost


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
