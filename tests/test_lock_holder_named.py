"""A refusal of a locked run directory names who holds the lock: a live run, or a finalize.

A finalize holds the run lock while it completes the directory; a second finalize (or a
resume) started meanwhile is refused, and the refusal must not say that "a run is still
writing there" (the user would go looking for a training process that ended long ago). The
holder here is a real finalize in a child process, paused in its merge.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import run_cli

PAUSED_FINALIZE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from torchinstruments.rundir import finish

    def paused(directory):
        print("merging", flush=True)
        time.sleep(120)

    finish.merge_history = paused
    finish.finalize(Path(sys.argv[1]))
    """
)


def test_a_directory_a_finalize_holds_is_refused_naming_the_finalize(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    inject_observer(model, output_dir=tmp_path, sampler=EveryNForwardsSampler(1))
    model(torch.ones(2, 3)).sum().backward()
    remove_observer(model)
    holder = subprocess.Popen(
        [sys.executable, "-c", PAUSED_FINALIZE, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "merging"
        refused = run_cli("finalize", tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 2
    said = " ".join(refused.stderr.split())
    assert f"in use by a live process (pid {holder.pid}, torchinstruments finalize)" in said
    assert "a finalize is completing the run there" in said
    assert "a run is still writing there" not in said
    assert run_cli("finalize", tmp_path).returncode == 0  # the dead holder's lock is gone


@pytest.mark.skipif(sys.platform == "win32", reason="fcntl")
def test_a_run_taking_its_lock_while_a_reader_probes_it_is_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that tells a live run from a dead one (`show`, a parent's index.md) takes the
    lock and drops it at once; a run (or finalize) taking it in between tries again, and gets it
    once the probe's second system call ran, instead of calling the directory in use."""
    import fcntl

    from torchinstruments.rundir import lock

    (tmp_path / ".lock").touch()
    probe = os.open(tmp_path / ".lock", os.O_RDWR)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the reader's probe holds it now
    real = lock._try_lock
    tries: list[bool] = []

    def probe_ends_after_the_first_try(fd: int, locker: Any) -> bool:
        tries.append(real(fd, locker))
        fcntl.flock(probe, fcntl.LOCK_UN)  # the probe's release
        return tries[-1]

    monkeypatch.setattr(lock, "_try_lock", probe_ends_after_the_first_try)
    try:
        with lock.RunLock(tmp_path):
            assert tries == [False, True]
            assert lock.writer_ended(tmp_path) is False  # held by this run now
    finally:
        os.close(probe)
    assert lock.writer_ended(tmp_path) is True
