"""Crash recovery through the public API: SIGKILL a real training loop, then `finalize`.

Acceptance criterion: a process killed with SIGKILL mid-training leaves readable parts; `python -m
torchinstruments finalize DIR` then produces all artifacts, and its result.json matches the one a
normal `remove_observer` writes for the same rows.

Why the comparison is exact: the child and the reference share one deterministic training
definition (this file is also the child's script), run on one CPU thread so that every float
reduction happens in the same order. `buffer_rows` is set to the rows of one sample (forward plus
backward rows), and the observer appends a sample's forward rows and then its backward rows, so
after the first sample (whose forward and backward rows are written at once, two parts) each part
holds exactly one complete sample (the test checks this rather than assuming it). The K parts the
kill leaves are then samples 0..K-2, and the reference trains exactly K-1 steps. Only the
`timestamp` column may differ; result.json holds no timestamps (checked too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from polars.testing import assert_frame_equal
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.layout import list_parts

from conftest import sgd_step, strict_json

SEED = 20240611
LAYERS = 3  # Linear, Tanh, Linear: every leaf's output is measured and receives a gradient
ROWS_PER_SAMPLE = LAYERS * len(DEFAULT_METRICS) * 2  # x 2 signals: output, output_gradient
CONFIG = HistoryConfig(buffer_rows=ROWS_PER_SAMPLE, window=3)
PARTS_BEFORE_KILL = 8
STEP_SLEEP_S = 0.02  # slow enough that the kill lands mid-training, fast enough for the test
CHILD_LIFETIME_S = 120.0  # the child stops on its own if the parent never kills it
WAIT_S = 60.0
LEARNING_RATE = 0.05


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and its full-batch data, all derived from SEED."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(64, 6)
    y = x @ torch.randn(6, 1) + 0.1 * torch.randn(64, 1)
    return model, x, y


def child_main(directory: Path) -> None:
    """The killed process: observe every forward and train until killed (or a safety deadline)."""
    torch.set_num_threads(1)
    model, x, y = build()
    inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    deadline = time.monotonic() + CHILD_LIFETIME_S
    step = 0
    while time.monotonic() < deadline:
        loss = sgd_step(model, x, y, LEARNING_RATE)
        print(f"step {step} loss {loss:.6f}", flush=True)
        step += 1
        time.sleep(STEP_SLEEP_S)


def json_keys(node: Any) -> set[str]:
    """Every object key anywhere in a parsed JSON document."""
    if isinstance(node, dict):
        return set(node).union(*(json_keys(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(json_keys(v) for v in node))
    return set()


def kill_after_parts(directory: Path, log: Path) -> None:
    """Start the training child, wait for PARTS_BEFORE_KILL parts, SIGKILL it."""
    with log.open("w", encoding="utf-8") as out:
        child = subprocess.Popen(
            [sys.executable, __file__, str(directory)], stdout=out, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + WAIT_S
            while len(list_parts(directory)) < PARTS_BEFORE_KILL:
                if child.poll() is not None:
                    pytest.fail(f"training child exited early:\n{log.read_text('utf-8')}")
                if time.monotonic() > deadline:
                    pytest.fail(f"no {PARTS_BEFORE_KILL} parts after {WAIT_S} s")
                time.sleep(0.02)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert "step " in log.read_text("utf-8")  # the loop really was training


def test_sigkill_mid_training_then_finalize_matches_normal_removal(
    tmp_path: Path, one_thread: None
) -> None:
    crashed = tmp_path / "crashed"
    kill_after_parts(crashed, tmp_path / "child.log")
    assert not (crashed / "history.parquet").exists()

    # Every completed part reads back, and holds exactly one whole sample, in order.
    parts = list_parts(crashed)
    assert len(parts) >= PARTS_BEFORE_KILL
    # The first sample's forward rows and backward rows were each written at once (two parts);
    # every later part holds one whole sample.
    for kind, part in zip(("output", "output_gradient"), parts[:2], strict=True):
        frame = pl.read_parquet(part)
        assert frame["sample_id"].unique().to_list() == [0], part
        assert frame["signal"].unique().to_list() == [kind], part
        assert frame.height == ROWS_PER_SAMPLE // 2, part
    for number, part in enumerate(parts[2:], start=1):
        frame = pl.read_parquet(part)
        assert frame.height == ROWS_PER_SAMPLE, part
        assert frame["sample_id"].unique().to_list() == [number], part
        assert frame["signal"].value_counts().sort("signal").rows() == [
            ("output", ROWS_PER_SAMPLE // 2),
            ("output_gradient", ROWS_PER_SAMPLE // 2),
        ]
    samples = len(parts) - 1

    done = subprocess.run(
        [sys.executable, "-m", "torchinstruments", "finalize", str(crashed)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "no readable run info" not in done.stdout  # the layer catalog came from index.md
    for artifact in ("history.parquet", "result.json", "index.md"):
        assert (crashed / artifact).is_file(), artifact
    assert list_parts(crashed) == []
    assert not list(crashed.rglob("*.tmp"))

    # The same training, stopped normally after exactly the recovered samples.
    reference = tmp_path / "reference"
    model, x, y = build()
    inject_observer(
        model, output_dir=reference, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    try:
        for _ in range(samples):
            sgd_step(model, x, y, LEARNING_RATE)
    finally:
        remove_observer(model)

    recovered = strict_json(crashed / "result.json")
    normal = strict_json(reference / "result.json")
    assert not {k for k in json_keys(normal) if "time" in k.lower()}  # nothing run-specific
    assert recovered == normal
    first = recovered[0]["tensors"][0]
    assert first["observations"] == samples  # the comparison is not between two empty files

    crashed_history = pl.read_parquet(crashed / "history.parquet")
    normal_history = pl.read_parquet(reference / "history.parquet")
    assert crashed_history.height == samples * ROWS_PER_SAMPLE
    assert crashed_history["sample_id"].unique().sort().to_list() == list(range(samples))
    assert_frame_equal(crashed_history.drop("timestamp"), normal_history.drop("timestamp"))


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
