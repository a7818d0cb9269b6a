"""Reading `history.parts/` while a live run writes parts: every read succeeds.

A part is written under a temporary name outside `history.parts/` and renamed into it, so a
reader of the directory (`pl.read_parquet(run / "history.parts")`, which refuses a directory
holding files of different extensions), of its `*.parquet` glob, or through index.md's own
`history_of` only ever sees completed parts. The writer is a child process writing one part per
sample as fast as it can; this process reads in a loop until the child has written its parts.
"""

from __future__ import annotations

import subprocess
import sys
import time
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

from conftest import wait_for_rows

PARTS = 60
ROWS_PER_PART = 2 * len(DEFAULT_METRICS)  # one Linear: its output and its output gradient
WAIT_S = 120.0


def child_main(directory: Path) -> None:
    """The writer: one part per sample, PARTS of them, then wait for the reader to finish."""
    model = nn.Linear(4, 4)
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=ROWS_PER_PART),
    )
    for _ in range(PARTS):
        model(torch.randn(2, 4)).sum().backward()
    wait_for_rows(directory, PARTS * ROWS_PER_PART)  # the flush thread writes the later ones
    (directory.parent / "written").touch()
    sys.stdin.read()  # the reader closes stdin when it has read the last part
    remove_observer(model)


def test_reading_history_parts_while_parts_are_written_never_fails(tmp_path: Path) -> None:
    run = tmp_path / "stats"
    parts_dir = run / "history.parts"
    child = subprocess.Popen(
        [sys.executable, __file__, str(run)], stdin=subprocess.PIPE, stderr=subprocess.PIPE
    )
    failures: list[str] = []
    reads = 0
    parts_seen: set[int] = set()
    try:
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "written").exists():
            assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
            assert time.monotonic() < deadline, "the writer did not finish in time"
            if not list_parts(run):
                time.sleep(0.005)
                continue
            for read in (
                lambda: pl.read_parquet(parts_dir),
                lambda: pl.read_parquet(parts_dir / "*.parquet"),
                lambda: (
                    pl.scan_parquet(sorted(parts_dir.glob("part-*.parquet")), glob=False)
                    .select(pl.len())
                    .collect()
                ),
            ):
                try:
                    frame = read()
                except Exception as error:  # every kind of failure counts
                    failures.append(f"{type(error).__name__}: {error}")
                    continue
                reads += 1
                if "sample_id" in frame.columns:
                    parts_seen.add(frame.height // ROWS_PER_PART)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)
    assert child.returncode == 0
    assert failures == []
    # The reads really overlapped the writes: they saw the directory at many sizes.
    assert len(parts_seen) >= 10, sorted(parts_seen)
    assert reads >= 30
    assert pl.read_parquet(run / "history.parquet").height == PARTS * ROWS_PER_PART


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
