"""Ctrl-C (SIGINT) during training never ends the library's flush thread nor loses a row.

Polars raises a KeyboardInterrupt in every thread that is inside a Polars call when SIGINT
arrives, the flush thread included. Real SIGINTs are sent, many, to a child whose flush thread
writes a part every few milliseconds and whose training loop catches KeyboardInterrupt and goes
on (a notebook cell run again): the run must end complete, every row the run recorded in
history.parquet exactly once, with no thread traceback, no detached sink, no failed write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer

SECONDS = 3.5


def child_main(run: Path) -> None:
    """Train for SECONDS with every forward sampled and tiny parts, catching Ctrl-C."""
    torch.set_num_threads(1)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)), nn.Linear(16, 1))
    inject_observer(
        model,
        output_dir=run,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=100, flush_seconds=0.2),
    )
    end = time.monotonic() + SECONDS  # the parent stops sending a second before

    def train() -> None:
        while time.monotonic() < end:
            try:  # noqa: SIM105 (suppress's __exit__ is Python: more places for one to land)
                model(torch.randn(8, 16)).sum().backward()
            except KeyboardInterrupt:
                pass

    print("ready", flush=True)
    # A KeyboardInterrupt lands on any bytecode, the loop's own `while` and `except` included:
    # one that escapes `train`'s bookkeeping is caught here (an escape from this loop's few
    # bytecodes would need a second SIGINT within them), so the child itself never dies of one.
    while time.monotonic() < end:
        try:  # noqa: SIM105 (as above)
            train()
        except KeyboardInterrupt:
            pass
    remove_observer(model)
    print("removed", flush=True)


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))


def test_sigints_during_training_leave_the_flush_thread_and_every_row(tmp_path: Path) -> None:
    run = tmp_path / "stats"
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    child = subprocess.Popen(
        [sys.executable, __file__, str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        end = time.monotonic() + SECONDS - 1.0
        sent = 0
        while time.monotonic() < end and child.poll() is None:
            time.sleep(0.01)
            child.send_signal(signal.SIGINT)
            sent += 1
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert sent > 50
    assert child.returncode == 0, err[-3000:]
    assert "removed" in out, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # no thread died, nothing escaped
    assert "detached" not in err, err[-3000:]  # the run directory kept its sink
    assert "could not write history part" not in err, err[-3000:]  # no write counted failed
    state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
    assert state["status"] == "complete", state["problems"]
    history = pl.read_parquet(run / "history.parquet")
    assert history.height == state["rows_recorded"]  # every row recorded is on disk
    key = ["sample_id", "signal", "layer", "call_index", "tensor_path", "metric"]
    assert history.select(key).is_duplicated().sum() == 0  # and only once
