"""A run whose model never reaches remove_observer still ends complete: nothing written is lost."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer

from conftest import read_result, run_status


def test_collected_model_finalizes_its_run(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
    del model
    gc.collect()
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history["sample_id"].unique().sort().to_list() == [0, 1]
    assert not (run_dir / "history.parts").exists() or not any(
        (run_dir / "history.parts").iterdir()
    )
    assert [len(layer["tensors"]) for layer in read_result(run_dir)] == [2, 2]


def test_process_exiting_without_removal_finalizes_its_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "stats"
    script = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        from torchinstruments import EveryNForwardsSampler, inject_observer

        model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        inject_observer(model, output_dir={str(run_dir)!r}, sampler=EveryNForwardsSampler(1))
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
        # no remove_observer: the interpreter exits with the model still observed
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2]
    assert set(history["signal"]) == {"output", "output_gradient"}
    assert run_status(run_dir) == "complete"
