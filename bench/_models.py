"""Models shared by the benchmarks, so that their figures are about the same networks."""

from __future__ import annotations

import torch
from torch import nn


def cnn() -> tuple[nn.Module, torch.Tensor]:
    """Three convolutions with batch norm, pooling and a classifier; batch 16 of 32x32."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return model, torch.randn(16, 3, 32, 32)


def transformer() -> tuple[nn.Module, torch.Tensor]:
    """4 encoder blocks, d_model 128, sequence 64, batch 16."""
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    return model, torch.randn(16, 64, 128)
