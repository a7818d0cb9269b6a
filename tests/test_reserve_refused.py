"""A disk reserve that cannot be written at inject is said, never passed over in silence.

The reserve (`rundir.reserve`) is what lets the final state file and index.md land on a disk
that fills up during the run; a run that could not write it has no such promise. The refusal is
real: the child process may write no file larger than 96 KiB (RLIMIT_FSIZE, with SIGXFSZ
ignored, so the write fails with EFBIG as a full disk fails with ENOSPC): the state file,
index.md (at most 64 KiB) and the parts of a small model fit, the reserve (twice the state file
and index.md, plus 64 KiB) does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

from torchinstruments.rundir.reserve import RESERVE_FILE
from torchinstruments.rundir.state import Status, read_state

from conftest import child_report

STEPS = 3
ROWS_PER_SAMPLE = 18  # one Linear, default metrics, output and gradient

CHILD = r"""
import json, resource, signal, sys, warnings
import torch
from torch import nn
from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

run, steps = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (96 * 1024, 96 * 1024))
torch.manual_seed(0)
model = nn.Linear(4, 2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
print(json.dumps([str(w.message) for w in caught]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE and SIGXFSZ are POSIX")
def test_a_reserve_the_disk_refuses_at_inject_is_warned_and_noted_in_index(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    said = child_report(CHILD, run, STEPS)
    (warned,) = [w for w in said if RESERVE_FILE in w]
    assert f"the disk reserve ({RESERVE_FILE}) could not be written at injection" in warned
    assert "File too large" in warned
    assert "may not fit" in warned
    index = (run / "index.md").read_text(encoding="utf-8")
    assert f"The disk reserve ({RESERVE_FILE}) could not be written at injection" in index
    # the run itself is whole: only the promise for a disk that fills up is missing
    assert read_state(run).status is Status.COMPLETE
    assert pl.read_parquet(run / "history.parquet").height == STEPS * ROWS_PER_SAMPLE
    assert not (run / RESERVE_FILE).exists()
