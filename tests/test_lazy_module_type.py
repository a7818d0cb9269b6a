"""A lazy module (`nn.LazyLinear`) becomes another class at its first call (`nn.Linear`): its
rows, result.json and TensorBoard tag descriptions give the class the layer had when measured,
and index.md says that the class changed after injection (its Layers table lists the class at
injection).

The reference is `type(module).__name__` read by the test after the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import polars as pl
import torch
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from torchinstruments import (
    EveryNForwardsSampler,
    TensorBoardSink,
    inject_observer,
    remove_observer,
)

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


def _descriptions(log_dir: Path) -> dict[str, str]:
    """Each tag's description as TensorBoard's UI reads it (the plugin accumulator)."""
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    tags = cast(dict[str, Any], accumulator.Tags())["tensors"]
    return {tag: accumulator.SummaryMetadata(tag).summary_description for tag in tags}


def test_a_materialised_lazy_layers_tensorboard_tags_name_the_class_its_rows_give(
    tmp_path: Path,
) -> None:
    """The tag descriptions (the run directory's events and a caller's logger) name the class
    the layer had when measured, as its rows do, not the lazy class it had at injection."""
    model = nn.Sequential(nn.LazyLinear(6), nn.ReLU())
    writer = SummaryWriter(str(tmp_path / "caller"))
    inject_observer(
        model,
        output_dir=tmp_path / "run",
        sampler=EveryNForwardsSampler(1),
        sinks=[TensorBoardSink(writer)],
    )
    try:
        model(torch.randn(8, 4)).sum().backward()
    finally:
        remove_observer(model)
        writer.close()
    for log_dir in (tmp_path / "run" / "tensorboard", tmp_path / "caller"):
        said = _descriptions(log_dir)
        for tag in ("0/call_0/output/tensor", "0/call_0/output_gradient/tensor"):
            assert " of layer `0` (Linear), call 0." in said[tag], (log_dir, said[tag])
