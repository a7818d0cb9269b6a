"""Attention is recorded by the default selection: nn.MultiheadAttention counts as one layer.

Its only child, `out_proj`, is a parameter holder that MultiheadAttention never calls as a module
(it passes the weight to the functional kernel), so a leaf-only rule would see nothing of
attention. Every value is compared with plain hooks on a deep copy, reduced with NumPy.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history, read_result
from hook_reference import HookRecorder, assert_profiles_match, observed_profiles, run_both

DECODER_LAYERS = [
    "self_attn",
    "multihead_attn",
    "linear1",
    "dropout",
    "linear2",
    "norm1",
    "norm2",
    "norm3",
    "dropout1",
    "dropout2",
    "dropout3",
]


def decoder() -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(
        d_model=8, nhead=2, dim_feedforward=16, dropout=0.1, batch_first=True
    )


def test_default_selection_records_attention_not_its_parameter_holder(run_dir: Path) -> None:
    model = decoder()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    remove_observer(model)
    names = [entry["layer"] for entry in read_result(run_dir)]
    assert sorted(names) == sorted(DECODER_LAYERS)
    assert "self_attn.out_proj" not in names


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_decoder_attention_outputs_and_gradients_match_hooks(run_dir: Path, mode: str) -> None:
    model = decoder().train(mode == "train")
    reference_model = copy.deepcopy(model)
    recorder = HookRecorder(reference_model, DECODER_LAYERS)
    tgt, memory = torch.randn(2, 5, 8), torch.randn(2, 7, 8)

    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    torch.manual_seed(1)
    model(tgt, memory).square().sum().backward()
    remove_observer(model)

    torch.manual_seed(1)
    reference_model(tgt, memory).square().sum().backward()

    observed = observed_profiles(read_history(run_dir), 0)
    assert ("self_attn", 0, "output", "[0]") in observed
    assert ("multihead_attn", 0, "output_gradient", "[0]") in observed
    assert_profiles_match(observed, recorder.profiles)
    entry = next(e for e in read_result(run_dir) if e["layer"] == "self_attn")
    assert {(t["signal"], t["tensor_path"]) for t in entry["tensors"]} == {
        ("output", "[0]"),
        ("output_gradient", "[0]"),
    }


def test_selector_still_overrides_the_default(run_dir: Path) -> None:
    model = decoder()
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        selector=lambda name, module: name in {"self_attn.out_proj", "linear1"},
    )
    model(torch.randn(2, 5, 8), torch.randn(2, 7, 8))
    with pytest.warns(RuntimeWarning, match=r"never ran.*self_attn\.out_proj"):
        remove_observer(model)
    assert [entry["layer"] for entry in read_result(run_dir)] == ["self_attn.out_proj", "linear1"]


class BiasFreeAttention(nn.Module):
    """nn.MultiheadAttention without biases: `out_proj.bias` is a parameter slot set to None."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, bias=False, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x)[0])


def bias_free_encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, bias=False, batch_first=True)


@pytest.mark.parametrize(
    ("build", "attention"),
    [(BiasFreeAttention, "attn"), (bias_free_encoder, "self_attn")],
    ids=["multihead_attention", "transformer_encoder_layer"],
)
def test_bias_free_attention_is_recorded_as_one_layer_like_plain_hooks(
    run_dir: Path, build: Any, attention: str
) -> None:
    def step(model: nn.Module, i: int) -> torch.Tensor:
        output = model(torch.randn(2, 5, 8))
        output.square().sum().backward()
        return output

    result = run_both(build(), step, run_dir)
    assert attention in result.catalog
    assert f"{attention}.out_proj" not in result.catalog
    assert attention in result.history["layer"].unique().to_list()
    result.assert_conforms()
