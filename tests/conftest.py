"""Shared fixtures: small models, run directories, and readers for what a run wrote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, has_observer, remove_observer


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state."""
    torch.manual_seed(0)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh, not yet existing run directory."""
    return tmp_path / "stats"


@pytest.fixture
def every_forward() -> EveryNForwardsSampler:
    """A sampler that samples every root forward."""
    return EveryNForwardsSampler(1)


@pytest.fixture
def cleanup() -> Iterator[list[nn.Module]]:
    """Models appended here get their observer removed even when a test fails."""
    models: list[nn.Module] = []
    yield models
    for model in models:
        if has_observer(model):
            remove_observer(model)


def mlp(width: int = 8, depth: int = 3) -> nn.Sequential:
    """Linear+ReLU blocks; leaves are Linear and ReLU."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def read_history(directory: Path) -> pl.DataFrame:
    """The merged history written at removal."""
    return pl.read_parquet(directory / "history.parquet")


def read_result(directory: Path) -> list[dict[str, Any]]:
    """result.json, rejecting NaN and Infinity."""

    def reject(constant: str) -> Any:
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads((directory / "result.json").read_text("utf-8"), parse_constant=reject)


def values(frame: pl.DataFrame, **where: Any) -> list[float | None]:
    """`value` column of the rows matching all `column=value` filters, in sample order."""
    for column, wanted in where.items():
        frame = frame.filter(pl.col(column) == wanted)
    return frame.sort("sample_id")["value"].to_list()


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, learning_rate: float) -> float:
    """One ordinary training step: forward, MSE loss, backward, plain SGD update.

    Written out rather than `torch.optim.SGD` because the first optimizer a process builds imports
    torch._dynamo (seconds), which adds nothing to tests that start fresh interpreters.
    """
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter -= learning_rate * parameter.grad
    return loss.item()
