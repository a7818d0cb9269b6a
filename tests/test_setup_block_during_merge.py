"""index.md's setup block reads every row, once, while removal deletes merged parts one by one.

When history.parts/ holds a part the merge cannot read (left in place, and named), removal
cannot take the folder away in one rename: it writes history.parquet, then deletes the merged
parts one by one beside the unreadable one. A reader that runs the setup block meanwhile must
see every row exactly once: history.parquet holds the merged parts (its metadata lists them),
so a merged part still on disk is not read again, and one already gone is not missed. The
child is this file run as a script: it is killed with SIGKILL right after the merge deleted its
first part, a real kill at the point a reader can meet.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
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

from conftest import wait_for_rows

STEPS = 4
ROWS_PER_SAMPLE = 2 * len(DEFAULT_METRICS)  # one Linear: output and gradient
UNREADABLE = "part-000000999.parquet"


def child_main(directory: Path) -> None:
    """Write STEPS samples, one part each, add an unreadable part, and remove the observer,
    killed right after the merge deleted its first merged part."""
    model = nn.Linear(4, 2)
    config = HistoryConfig(buffer_rows=ROWS_PER_SAMPLE)
    inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=config
    )
    for _ in range(STEPS):
        model(torch.ones(3, 4)).sum().backward()
    wait_for_rows(directory, STEPS * ROWS_PER_SAMPLE)
    (directory / "history.parts" / UNREADABLE).write_bytes(b"not parquet")
    unlink = Path.unlink

    def then_killed(path: Path, missing_ok: bool = False) -> None:
        unlink(path, missing_ok=missing_ok)
        if path.parent.name == "history.parts":
            os.kill(os.getpid(), signal.SIGKILL)

    Path.unlink = then_killed  # type: ignore[method-assign]
    remove_observer(model)


def test_the_setup_block_reads_every_row_once_while_merged_parts_are_deleted(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "run"
    child = subprocess.run(
        [sys.executable, __file__, str(directory)], capture_output=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    merged = pl.read_parquet(directory / "history.parquet")
    assert merged.height == STEPS * ROWS_PER_SAMPLE  # the merge was done
    left = sorted(p.name for p in (directory / "history.parts").iterdir())
    # the first merged part is gone, others are still there beside the unreadable one
    assert UNREADABLE in left
    assert "part-000000000.parquet" not in left
    assert len(left) > 2
    page = (directory / "index.md").read_text("utf-8")
    setup = re.findall(r"```python\n(.*?)```", page, re.DOTALL)[0]
    session: dict = {}
    exec(compile(setup, "index.md:setup", "exec"), session)
    read = session["history"].collect()
    assert read.height == merged.height
    key = ["sample_id", "signal", "metric"]
    assert read.sort(key).select(key).equals(merged.sort(key).select(key))


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
