"""A TensorBoard event file that stops answering never hangs the step and never grows memory.

The stall is real: TensorBoard's writer thread opens the event file anew for every record, and
the test puts a FIFO that no one reads in the file's place, so that thread blocks for good in
`open`, as a write to a stalled network file system blocks. TensorBoard's flush waits for that
thread while holding the lock every new event takes; the run waits at most a flush interval,
then gives the event file up (one warning, a line in index.md), queues no more events, and the
history goes on, complete. Run in a child process under a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl

ROWS_PER_SAMPLE = 2 * 18  # two Linear layers, default metrics, output and gradient
MORE = 200  # steps after the event file was given up

CHILD = r"""
import gc, glob, json, os, sys, warnings
from pathlib import Path
import torch
from torch import nn
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments._tensorboard_internals import _Handoff

gc.freeze()  # torch's import-time objects: the exit's collections need not walk them (seconds)
run, more = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
x = torch.randn(3, 4)
config = HistoryConfig(flush_seconds=0.5)
steps = 0
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
    model(x).sum().backward()
    steps += 1
    (events,) = glob.glob(str(run / "tensorboard" / "events.out.tfevents.*"))
    os.mkfifo(events + ".fifo")
    # One atomic rename: between an unlink and a mkfifo the writer thread could create the file anew
    os.replace(events + ".fifo", events)  # the writer thread's next open of it blocks for good
    given_up = lambda: any("could not be flushed" in str(w.message) for w in caught)
    while not given_up() and steps < 100_000:
        model(x).sum().backward()
        steps += 1
    (handoff,) = [o for o in gc.get_objects() if type(o) is _Handoff]
    queued = handoff._items.qsize()
    for _ in range(more):
        model(x).sum().backward()
        steps += 1
    print(json.dumps({"queued": [queued, handoff._items.qsize()], "steps": steps}), flush=True)
    remove_observer(model)  # returns although the writer thread never will
print(json.dumps({"warnings": [str(w.message) for w in caught]}))
"""


def test_a_stalled_event_file_is_given_up_and_the_steps_and_history_go_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(run), str(MORE)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    progress, report = json.loads(lines[-2]), json.loads(lines[-1])
    said = "\n".join(report["warnings"])
    assert "could not be flushed (WriterStalledError" in said, said
    before, after = progress["queued"]
    assert after == before  # nothing queued for the stuck thread after the event file was given up
    history = pl.read_parquet(run / "history.parquet")
    assert history.height == progress["steps"] * ROWS_PER_SAMPLE  # every step's rows, none lost
    index = (run / "index.md").read_text()
    assert "could not be flushed (WriterStalledError" in index
