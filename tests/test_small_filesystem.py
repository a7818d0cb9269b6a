"""A real full disk: a 2 MiB tmpfs that a filler file fills to the last byte, through removal.

Every write fails for real (Polars, TensorBoard, the state file), nothing is injected. The run's
reserve (`rundir.reserve`) gives the final state file and index.md their room at removal, so
both state the lost ranges; after the filler is deleted, `finalize` merges what was written and
keeps saying what is missing. Mounting needs root (CAP_SYS_ADMIN); elsewhere the test is skipped
and says why (`test_write_failure.py` covers the same logic with injected failures).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.layout import list_parts
from torchinstruments.rundir.state import Status, read_state

from conftest import rows_in_parts, wait_for_rows

ROWS_PER_SAMPLE = 18  # one Linear, default metrics, output and gradient


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A tmpfs of 2 MiB (or the size a test passes indirectly) mounted under tmp_path
    (unmounted afterwards), or a skip saying why not."""
    size = getattr(request, "param", "2m")
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs Linux and root (CAP_SYS_ADMIN)")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """A file that takes every free byte of `disk`."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        block = b"\xff" * 65536
        while True:
            try:
                f.write(block)
            except OSError:
                break
        for size in (4096, 512, 1):  # the last partial blocks
            while True:
                try:
                    f.write(b"\xff" * size)
                except OSError:
                    break
    return filler


# TensorBoard's writer thread neither dies nor prints a traceback on ENOSPC: the run reports it
# once, as a TensorBoard problem.
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_disk_full_through_removal_leaves_a_true_ledger(small_disk: Path) -> None:
    run = small_disk / "run"
    model = nn.Linear(2, 2)
    inject_observer(
        model,
        output_dir=run,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=180, max_buffered_rows=1800, flush_seconds=600),
    )
    x = torch.randn(1, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for _ in range(20):  # sample 0 at once (two parts), samples 1-10 in a third part
            model(x).sum().backward()
        wait_for_rows(run, 11 * ROWS_PER_SAMPLE)  # the flush thread writes that third part
        filler = fill(small_disk)
        assert os.statvfs(small_disk).f_bavail == 0
        for _ in range(300):  # 11-110 buffered up to the cap, 111-319 dropped
            model(x).sum().backward()
        remove_observer(model)  # the backlog cannot be written either
    said = [str(w.message) for w in caught if "TensorBoard events" in str(w.message)]
    assert len(said) == 1, said
    assert "No space left on device" in said[0]
    assert any("TensorBoard events" in p for p in read_state(run).live_problems)
    expected = [
        (100 * ROWS_PER_SAMPLE, 11, 110, "not written at removal"),
        (209 * ROWS_PER_SAMPLE, 111, 319, "dropped at the memory cap"),
    ]
    for moment in ("after removal", "after finalize"):
        state = read_state(run)
        assert state.status is Status.INCOMPLETE, moment
        losses = sorted(
            (loss.rows, loss.first_sample_id, loss.last_sample_id, loss.reason)
            for loss in state.losses
        )
        assert [loss[:3] for loss in losses] == [e[:3] for e in expected], moment
        for loss, (*_, why) in zip(losses, expected, strict=True):
            assert loss[3].startswith(why), moment
            assert "No space left on device" in loss[3]
        index = (run / "index.md").read_text("utf-8")
        assert "**State: INCOMPLETE.**" in index, moment
        assert "1,800 rows of samples 11-110 were recorded but not written" in index, moment
        assert "3,762 rows of samples 111-319 were recorded but not written" in index, moment
        if moment == "after removal":
            filler.unlink()  # the space comes back
            finalize(run)
    history = pl.read_parquet(run / "history.parquet")
    assert sorted(history["sample_id"].unique()) == list(range(11))
    assert state.rows_recorded == 320 * ROWS_PER_SAMPLE
    assert history.height == state.rows_recorded - sum(loss.rows for loss in state.losses)
    assert not (run / "history.parts").exists()  # merged


DEEP_ROWS_PER_SAMPLE = 8 * 2 * 9  # eight Linears, output and gradient, nine metrics
DEEP_SAMPLES = 1 + 24 * 32  # the first sample written at once, then chunks of 32 samples


@pytest.mark.parametrize("small_disk", ["16m"], indirect=True)
def test_a_merge_the_full_disk_refuses_keeps_the_parts_and_finalize_completes_it_later(
    small_disk: Path,
) -> None:
    # every row is in parts before the disk fills; history.parquet then needs more than the
    # reserve gives back (random inputs: values that do not compress away)
    run = small_disk / "run"
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    inject_observer(
        model,
        output_dir=run,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=32 * DEEP_ROWS_PER_SAMPLE, flush_seconds=600),
        max_histogram_modules=1,
    )
    for _ in range(DEEP_SAMPLES):
        model(torch.randn(8, 16)).sum().backward()
    rows = DEEP_SAMPLES * DEEP_ROWS_PER_SAMPLE
    wait_for_rows(run, rows)
    written = pl.concat([pl.read_parquet(p) for p in list_parts(run)])
    filler = fill(small_disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        remove_observer(model)

    said = "\n".join(str(w.message) for w in caught)
    assert "merging history.parts/ into history.parquet failed" in said, said
    assert "No space left on device" in said, said
    state = read_state(run)
    assert state.status is Status.INCOMPLETE  # never "complete" without history.parquet
    assert state.rows_recorded == rows
    assert not (run / "history.parquet").exists()
    assert rows_in_parts(run) == rows  # every part kept for finalize
    index = (run / "index.md").read_text("utf-8")
    assert "**State: INCOMPLETE.**" in index
    assert "merging history.parts/ into history.parquet failed" in index

    filler.unlink()  # the space comes back
    report = finalize(run)
    assert report.problems == ()
    assert read_state(run).status is Status.COMPLETE  # the live run's exact count is met
    history = pl.read_parquet(run / "history.parquet")
    key = ["sample_id", "layer", "signal", "metric"]
    assert history.sort(key).equals(written.sort(key))
    assert not (run / "history.parts").exists()
