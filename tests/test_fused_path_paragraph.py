"""index.md's Layers section explains the encoder layers' fused fast path (taken layer by layer
in sampled forwards) only for a run that has one: an `nn.TransformerEncoderLayer` holding
selected layers, the observed model itself included. A model without one gets no such text."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

FUSED = "runs layer by layer in sampled forwards"


def one_forward(model: nn.Module, directory: Path, inputs: torch.Tensor) -> str:
    """index.md after one sampled forward of `model` in eval under no_grad."""
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    try:
        model.eval()
        with torch.no_grad():
            model(inputs)
    finally:
        remove_observer(model)
    return (directory / "index.md").read_text(encoding="utf-8")


def test_a_model_without_an_encoder_layer_has_no_fused_path_paragraph(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    assert FUSED not in one_forward(model, tmp_path / "run", torch.randn(8, 4))


def test_an_encoder_layer_run_names_the_layers_with_a_fused_path(tmp_path: Path) -> None:
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    index = one_forward(model, tmp_path / "run", torch.randn(2, 5, 8))
    assert FUSED in index
    assert "(`layers.0`, `layers.1`)" in index


def test_a_bare_encoder_layer_observed_itself_has_the_paragraph(tmp_path: Path) -> None:
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    index = one_forward(model, tmp_path / "run", torch.randn(2, 5, 8))
    assert FUSED in index
    assert "(the observed model itself)" in index
