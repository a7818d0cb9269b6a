"""A continued run (resume=True) refused at inject is no attempt of the run: once its opening's
writes end (failed at once, or returned after inject gave them up), the state file and index.md
are as the earlier attempts left them, so the next resume=True neither counts it as killed nor
lists it in the Attempts table.

The stall is a gate on index.md's write at inject, opened only after inject raised: the state
file's write before it landed, as a write to a file system that stopped answering lands once it
answers again.
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchinstruments.sinks.directory as directory_sink
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.rundir.layout import INDEX_FILE, temporary_path
from torchinstruments.rundir.lock import live_writer
from torchinstruments.rundir.state import read_state

CONFIG = HistoryConfig(flush_seconds=0.2)


def one_attempt(model: nn.Module, run: Path, *, resume: bool) -> None:
    """Inject, one training step, remove."""
    inject_observer(
        model,
        output_dir=run,
        sampler=EveryNForwardsSampler(1),
        history_config=CONFIG,
        resume=resume,
    )
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)


def attempts(run: Path) -> list[tuple[int, str]]:
    return [(a.attempt, a.ended) for a in read_state(run).attempts]


def test_a_continuation_whose_write_returned_after_inject_gave_it_up_is_no_attempt(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(directory_sink, "MIN_REMOVAL_WAIT_S", 0.5)
    model = nn.Linear(4, 2)
    one_attempt(model, run_dir, resume=False)
    before = (run_dir / INDEX_FILE).read_text(encoding="utf-8")
    gate = threading.Event()
    real = directory_sink.write_index

    def stalled(directory: Path, state: Any, *args: Any, **kwargs: Any) -> None:
        gate.wait()
        real(directory, state, *args, **kwargs)

    monkeypatch.setattr(directory_sink, "write_index", stalled)
    with pytest.raises(TimeoutError, match="put back as the earlier attempts left them"):
        inject_observer(model, output_dir=run_dir, history_config=CONFIG, resume=True)
    assert attempts(run_dir) == [(0, "removed"), (1, "in progress")]  # its state file landed
    monkeypatch.setattr(directory_sink, "write_index", real)
    gate.set()  # the file system answers again: the write returns, landed
    deadline = time.monotonic() + 60
    while live_writer(run_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live_writer(run_dir) is None
    assert attempts(run_dir) == [(0, "removed")]
    assert (run_dir / INDEX_FILE).read_text(encoding="utf-8") == before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_attempt(model, run_dir, resume=True)
    assert attempts(run_dir) == [(0, "removed"), (1, "removed")]
    assert not [w for w in caught if "killed" in str(w.message)]
    index = (run_dir / INDEX_FILE).read_text(encoding="utf-8").splitlines()
    assert [line.split("|")[1].strip() for line in index if re.match(r"\| \d+ \|", line)] == [
        "0",
        "1",
    ]


def test_a_continuation_whose_write_failed_at_inject_is_no_attempt(run_dir: Path) -> None:
    model = nn.Linear(4, 2)
    one_attempt(model, run_dir, resume=False)
    blocker = temporary_path(run_dir / INDEX_FILE)
    blocker.mkdir()  # index.md's write fails, after the state file's landed
    with pytest.raises(IsADirectoryError, match=f"{INDEX_FILE} could not be written"):
        inject_observer(model, output_dir=run_dir, history_config=CONFIG, resume=True)
    assert attempts(run_dir) == [(0, "removed")]
    blocker.rmdir()
    one_attempt(model, run_dir, resume=True)
    assert attempts(run_dir) == [(0, "removed"), (1, "removed")]
