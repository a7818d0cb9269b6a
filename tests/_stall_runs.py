"""The observed model of the stall scenarios (`test_stalled_*`): each blocks a write of its run
at a point of its own, around the same small model."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from torchinstruments import HistoryConfig

from conftest import observe


@contextlib.contextmanager
def observed_linear(
    run: Path, config: HistoryConfig | None = None
) -> Iterator[tuple[nn.Module, torch.Tensor, list[warnings.WarningMessage]]]:
    """A seeded `Linear(4, 2)` observed into `run` (every forward sampled; `config`: the
    history's, None the default), its input, and every warning said while the block runs."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        observe(model, run, history_config=config)
        yield model, x, caught
