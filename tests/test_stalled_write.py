"""A part write that never returns (a file system that stopped answering) never stops training.

The stall is real: the next part's temporary name is a FIFO that no one reads, so the flush
thread's write blocks in `open` for as long as the FIFO has no reader, as a write to a stalled
network file system blocks. Once the buffer is full, a sampled step waits for the write in
progress at most half a flush interval; after that the write counts as failing, rows beyond
the cap are dropped and counted, and when the write returns (failed: the test opens the FIFO,
whose fsync fails), the rows still buffered land at removal. Run in a child process, under a timeout: a step that
waits for the write without end fails the test instead of hanging it.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from torchinstruments.rundir.state import read_state

from conftest import child_report

STEPS = 40  # sampled steps while the write stalls
ROWS_PER_SAMPLE = 18  # one Linear, default metrics, output and gradient

CHILD = r"""
import json, os, sys, threading, warnings
import torch
from torch import nn
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.rundir.layout import list_parts, part_path, part_temporary_path

from pathlib import Path

run, steps = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = nn.Linear(4, 2)
x = torch.randn(3, 4)
config = HistoryConfig(buffer_rows=36, max_buffered_rows=72, flush_seconds=0.5)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
    model(x).sum().backward()  # the first forward's and backward's rows: written at once
    stalled = part_temporary_path(part_path(run, len(list_parts(run))), 0)
    os.mkfifo(stalled)  # the next part's write blocks opening it
    for _ in range(steps):
        model(x).sum().backward()
    # The write returns: opened for reading and writing here, the FIFO lets its open through
    # (what it writes is drained), and its fsync, which a FIFO refuses, fails it.
    holder = os.open(stalled, os.O_RDWR)
    threading.Thread(target=lambda: [os.read(holder, 65536) for _ in iter(int, 1)], daemon=True).start()
    remove_observer(model)
print(json.dumps([str(w.message) for w in caught]))
"""


def test_a_part_write_that_never_returns_costs_rows_not_the_training_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    said = "\n".join(child_report(CHILD, run, STEPS))
    assert "a part write had not returned after 0.25 s" in said, said
    state = read_state(run)
    history = pl.read_parquet(run / "history.parquet")
    lost = sum(loss.rows for loss in state.losses)
    markers = history.filter(pl.col("metric") == "interrupted").height
    # every row of every sample is either in history or counted lost, with the stall as reason
    assert lost > 0
    assert history.height - markers + lost == (STEPS + 1) * ROWS_PER_SAMPLE
    assert all("a part write had not returned" in loss.reason for loss in state.losses)
    index = (run / "index.md").read_text()
    assert "a part write had not returned after 0.25 s" in index
