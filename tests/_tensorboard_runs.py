"""What the TensorBoard tests share: a model whose leaves run in the reverse of their traversal
order, and a run's events read back as TensorBoard reads them (histograms, tag descriptions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    EventAccumulator,
)
from tensorboard.backend.event_processing.plugin_event_accumulator import (
    EventAccumulator as PluginEventAccumulator,
)
from torch import nn


def histograms(log_dir: Path) -> dict[str, list]:
    """Every histogram tag in `log_dir` with its events, as TensorBoard reads them."""
    accumulator = EventAccumulator(str(log_dir), size_guidance={HISTOGRAMS: 0})
    accumulator.Reload()
    tags: dict[str, Any] = accumulator.Tags()
    return {tag: accumulator.Histograms(tag) for tag in tags["histograms"]}


class Reversed(nn.Module):
    """Ten leaves, executed in the reverse of their traversal order."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = torch.tanh(block(x))
        return x


def descriptions(log_dir: Path) -> dict[str, str]:
    """Each tag's description as TensorBoard's UI reads it (the plugin accumulator)."""
    accumulator = PluginEventAccumulator(str(log_dir))
    accumulator.Reload()
    tags = cast(dict[str, Any], accumulator.Tags())["tensors"]
    return {tag: accumulator.SummaryMetadata(tag).summary_description for tag in tags}
