"""A sampled forward whose backward runs after `remove_observer` (the observer removed between a
forward and its backward): the closed observer records no gradient of it, and index.md says
which samples no gradient had reached while their outputs could still get one. A sample whose
backward came before the removal, or whose outputs were dropped without one, is not named."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

NOTE = "no gradient had reached"


def observed(run_dir: Path) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    return model


def test_a_backward_after_removal_has_no_gradient_rows_and_index_names_its_sample(
    tmp_path: Path,
) -> None:
    model = observed(tmp_path / "s")
    model(torch.randn(3, 4)).sum().backward()  # sample 0: a whole step
    model(torch.randn(3, 4))  # sample 1: dropped, no backward: nothing to say
    out = model(torch.randn(3, 4))  # sample 2: its backward comes after the removal
    remove_observer(model)
    out.sum().backward()
    history = pl.read_parquet(tmp_path / "s" / "history.parquet")
    signals = history.group_by("sample_id").agg(pl.col("signal").unique().sort()).sort("sample_id")
    assert signals["signal"].to_list() == [["output", "output_gradient"], ["output"], ["output"]]
    assert "interrupted" not in set(history["metric"])
    index = (tmp_path / "s" / "index.md").read_text("utf-8")
    notes = [line for line in index.splitlines() if NOTE in line]
    assert len(notes) == 1
    assert notes[0].startswith(f"**Note:** sample 2: {NOTE} its outputs when remove_observer")


def test_a_removal_after_the_last_backward_names_no_sample_though_its_outputs_are_kept(
    tmp_path: Path,
) -> None:
    model = observed(tmp_path / "s")
    kept = [model(torch.randn(3, 4)) for _ in range(2)]
    for out in kept:
        out.sum().backward()
    remove_observer(model)  # `kept` still holds both graphs: each had its gradients
    assert NOTE not in (tmp_path / "s" / "index.md").read_text("utf-8")
