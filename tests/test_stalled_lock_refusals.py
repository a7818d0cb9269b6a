"""A directory whose lock a given-up write of this very process still holds is refused for that
reason: the stuck write is named, never a model left observed or a removal still to call.

The stall is real: the temporary of the state file is a FIFO that no one reads, so removal's
finish blocks opening it, as a write to a stalled network file system blocks. Removal gives the
finish up and returns; its thread keeps the run's lock while the write hangs. The same process
then asks for the directory again (a notebook cell run again), without and with resume=True.
Once the FIFO gets a reader (the file system answers again), the write returns, the thread
releases the lock, and resume=True continues the run. Run in a child process, under a timeout.
"""

from __future__ import annotations

from pathlib import Path

from torchinstruments.rundir.layout import STATE_FILE
from torchinstruments.rundir.state import read_state

from conftest import child_report

# The children's floor of removal_wait_s (sinks.directory.MIN_REMOVAL_WAIT_S, 10 s), shortened
# by each child (its first lines) to keep the suite short: the stalls are real FIFOs either way.
FLOOR_S = 3.0

CHILD = r"""
import json, os, sys, time, warnings
import torch
from torch import nn
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
import torchinstruments.sinks.directory as directory_sink
directory_sink.MIN_REMOVAL_WAIT_S = 3.0  # FLOOR_S: the test's floor, shortened; the stall is real
from torchinstruments.rundir.layout import STATE_FILE, temporary_path
from torchinstruments.rundir.lock import live_writer

from pathlib import Path

run = Path(sys.argv[1])
warnings.simplefilter("ignore")
config = HistoryConfig(flush_seconds=1.0)
model = nn.Linear(4, 2)
inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
model(torch.randn(3, 4)).sum().backward()
fifo = temporary_path(run / STATE_FILE)
os.mkfifo(fifo)  # the finish's write of the state file blocks opening it
remove_observer(model)  # gives the finish up; its thread holds the lock
refusals = {}
for resume in (False, True):
    try:
        inject_observer(nn.Linear(4, 2), output_dir=run, resume=resume, history_config=config)
        refusals[str(resume)] = None
    except Exception as error:
        refusals[str(resume)] = [type(error).__name__, str(error)]
# The file system answers again: the FIFO gets a reader (the write's open returns) and a writer
# (the fsync's open of it for reading returns too; the fsync of a FIFO then fails, so the
# write ends, as a failed one, and its thread releases the lock).
reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
deadline = time.monotonic() + 120
while live_writer(run) is not None and time.monotonic() < deadline:
    time.sleep(0.01)
os.close(writer)
os.close(reader)
again = nn.Linear(4, 2)
inject_observer(again, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
again(torch.randn(3, 4)).sum().backward()
remove_observer(again)
print(json.dumps(refusals))
"""


def test_a_directory_held_by_a_given_up_finish_of_this_process_is_refused_naming_that_write(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    refusals = child_report(CHILD, run)
    kinds = {resume: refusal[0] for resume, refusal in refusals.items()}
    assert kinds == {"False": "FileExistsError", "True": "RunLockedError"}
    for _, message in refusals.values():
        assert "remove_observer's finish of the run in this process" in message, message
        assert f"after a write had not returned in {FLOOR_S:g} s" in message
        assert f"its thread still waits on {STATE_FILE}:" in message
        assert f"Not written: {STATE_FILE}." in message  # index.md is written before it
        assert f"check the disk or file system under {run}" in message
        assert "pass another output_dir" in message
        assert "was not removed" not in message  # it was removed
        assert "Wait for it to end (remove_observer)" not in message  # it was called
    # once the write returned, the lock was released and the run continued in a second attempt
    assert [attempt.attempt for attempt in read_state(run).attempts] == [0, 1]
