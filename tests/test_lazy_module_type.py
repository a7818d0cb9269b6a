"""A lazy module (`nn.LazyLinear`) becomes another class at its first call (`nn.Linear`): its
rows and result.json give the class the layer had when it was measured, and index.md says that
the class changed after injection (its Layers table lists the class at injection).

The reference is `type(module).__name__` read by the test after the run."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history, strict_json


def test_a_materialised_lazy_layer_is_recorded_as_the_class_it_became(tmp_path: Path) -> None:
    model = nn.Sequential(nn.LazyLinear(6), nn.ReLU(), nn.Linear(6, 1))
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    try:
        for _ in range(2):
            model(torch.randn(8, 4)).sum().backward()
    finally:
        remove_observer(model)
    assert type(model[0]).__name__ == "Linear"
    history = read_history(tmp_path / "run")
    types = history.group_by("layer").agg(pl.col("module_type").unique()).sort("layer")
    assert types.rows() == [("0", ["Linear"]), ("1", ["ReLU"]), ("2", ["Linear"])]
    layers = strict_json(tmp_path / "run" / "result.json")
    assert [(r["layer"], r["module_type"]) for r in layers] == [
        ("0", "Linear"),
        ("1", "ReLU"),
        ("2", "Linear"),
    ]
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "`0` (LazyLinear at injection, Linear when measured)" in index
