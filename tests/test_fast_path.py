"""nn.TransformerEncoder: inner layers are measured on sampled forwards, fast path kept otherwise.

In eval without gradients (no_grad, inference_mode, or frozen weights and inputs) PyTorch runs
each TransformerEncoderLayer, the observed model itself included, as one fused kernel
(`torch._transformer_encoder_layer_fwd`) that calls none of its submodules; it takes the
layer-by-layer path instead when hooks are attached. A sampled forward takes that same
layer-by-layer path, so it computes what a model with hooks computes; an unsampled forward keeps
the fused kernel and is bit-identical to the unobserved model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history, read_result
from hook_reference import HookRecorder, assert_profiles_match, observed_profiles

INNER = ["self_attn", "linear1", "dropout", "linear2", "norm1", "norm2", "dropout1", "dropout2"]
SELECTED = [f"layers.{i}.{name}" for i in range(2) for name in INNER]


def encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        d_model=16, nhead=4, dim_feedforward=32, dropout=0.1, batch_first=True
    )
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the fused encoder-layer kernel (the fast path)."""
    calls = [0]
    fused: Callable[..., Any] = torch._transformer_encoder_layer_fwd

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    return calls


def test_default_selection_is_every_inner_computing_layer(run_dir: Path) -> None:
    model = encoder()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    remove_observer(model)
    assert sorted(entry["layer"] for entry in read_result(run_dir)) == sorted(SELECTED)


@pytest.mark.parametrize(
    ("mode", "grad"), [("train", True), ("eval", True), ("eval", False)], ids=str
)
def test_inner_layers_match_hooks(run_dir: Path, mode: str, grad: bool) -> None:
    model = encoder().train(mode == "train")
    reference_model = copy.deepcopy(model)
    recorder = HookRecorder(reference_model, SELECTED)
    x = torch.randn(3, 5, 16)

    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    torch.manual_seed(1)
    with torch.set_grad_enabled(grad):
        out = model(x)
    if grad:
        out.square().sum().backward()
    remove_observer(model)

    torch.manual_seed(1)
    with torch.set_grad_enabled(grad):
        reference = reference_model(x)
    if grad:
        reference.square().sum().backward()

    assert torch.equal(out, reference)
    observed = observed_profiles(read_history(run_dir), 0)
    assert {key[0] for key in observed} == set(SELECTED)
    assert_profiles_match(observed, recorder.profiles)
    index = (run_dir / "index.md").read_text("utf-8")
    for name in SELECTED:
        assert f"| `{name}` |" in index


def test_unsampled_eval_forwards_keep_the_fast_path_bit_identical(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = encoder().eval()
    plain = copy.deepcopy(model)
    x = torch.randn(3, 5, 16)
    fused = count_fused_calls(monkeypatch)
    with torch.no_grad():
        expected = plain(x)
    assert fused[0] == 2  # the unobserved model takes the fast path in both layers

    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    with torch.no_grad():
        sampled = model(x)  # forward_index 0: sampled, layer by layer
        assert fused[0] == 2
        unsampled = model(x)  # forward_index 1: not sampled, fused
        assert fused[0] == 4
    remove_observer(model)
    assert torch.equal(unsampled, expected)
    assert sampled.shape == expected.shape
    history = read_history(run_dir)
    assert set(history["layer"].unique()) == set(SELECTED)
    assert set(history["sample_id"].unique()) == {0}
    with torch.no_grad():
        assert torch.equal(model(x), expected)  # removal leaves the fast path as it was
    assert fused[0] == 6


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_padded_batch_is_measured_over_real_entries_like_hooks_see_it(run_dir: Path) -> None:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    plain = copy.deepcopy(model)
    reference_model = copy.deepcopy(model)
    recorder = HookRecorder(reference_model, SELECTED)
    x = torch.randn(3, 5, 16)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True
    with torch.no_grad():
        expected = plain(x, src_key_padding_mask=mask)
        reference = reference_model(x, src_key_padding_mask=mask)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with torch.no_grad():
        out = model(x, src_key_padding_mask=mask)
    remove_observer(model)
    assert torch.equal(out, expected)
    assert torch.equal(out, reference)
    history = read_history(run_dir)
    # inside the encoder the batch is packed (nested): measured over the 13 real positions
    assert history.filter(pl.col("layer") == "layers.0.linear1")["shape"].to_list()[0] is None
    assert_profiles_match(observed_profiles(history, 0), recorder.profiles)


def observe_twice(model: nn.Module, run_dir: Path, x: torch.Tensor, context: Any) -> torch.Tensor:
    """Two forwards under `context`, the first sampled; returns the sampled one's output."""
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    with context():
        sampled = model(x)
        model(x)
    remove_observer(model)
    return sampled


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize(
    "context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"]
)
def test_encoder_layer_observed_itself_is_measured_like_hooks_in_eval_without_grad(
    run_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    recwarn: pytest.WarningsRecorder,
    norm_first: bool,
    context: Any,
) -> None:
    model = nn.TransformerEncoderLayer(
        16, 4, 32, dropout=0.0, batch_first=True, norm_first=norm_first
    ).eval()
    plain, reference_model = copy.deepcopy(model), copy.deepcopy(model)
    recorder = HookRecorder(reference_model, INNER)
    x = torch.randn(3, 5, 16)
    fused = count_fused_calls(monkeypatch)
    with context():
        expected = plain(x)
        reference = reference_model(x)  # hooks attached: layer by layer
    assert fused[0] == 1

    sampled = observe_twice(model, run_dir, x, context)

    assert fused[0] == 2  # the unsampled forward kept the fused kernel
    assert torch.equal(sampled, reference)
    assert torch.allclose(sampled, expected, atol=1e-5)
    history = read_history(run_dir)
    assert set(history["layer"].unique()) == set(INNER)
    assert_profiles_match(observed_profiles(history, 0), recorder.profiles)
    assert [entry["sampled_forwards"] for entry in read_result(run_dir)] == [1] * len(INNER)
    assert not [w for w in recwarn if "never ran" in str(w.message)]


@pytest.mark.parametrize("wrapped", [False, True], ids=["observed_itself", "inside_a_model"])
def test_frozen_encoder_layer_with_grad_enabled_is_measured_like_hooks(
    run_dir: Path, wrapped: bool
) -> None:
    # Weights that need no gradient and an input that needs none: the fused kernel runs even
    # with grad enabled (a frozen feature extractor).
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential(layer) if wrapped else layer
    model.eval().requires_grad_(False)
    reference_model = copy.deepcopy(model)
    recorder = HookRecorder(reference_model, [f"0.{n}" for n in INNER] if wrapped else INNER)
    x = torch.randn(3, 5, 16)
    reference = reference_model(x)

    sampled = observe_twice(model, run_dir, x, torch.enable_grad)

    assert torch.equal(sampled, reference)
    assert_profiles_match(observed_profiles(read_history(run_dir), 0), recorder.profiles)


class CallsTheClassForward(nn.Module):
    """Calls its encoder layer past the layer's own forward (what no proxy can see)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.TransformerEncoderLayer.forward(self.block, x)


def test_layers_a_fused_kernel_skipped_past_the_layer_forward_are_said_why(run_dir: Path) -> None:
    model = CallsTheClassForward().eval()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with torch.no_grad():
        model(torch.randn(3, 5, 16))
    with pytest.warns(RuntimeWarning, match="never ran") as caught:
        remove_observer(model)
    (warning,) = [str(w.message) for w in caught if "never ran" in str(w.message)]
    index = (run_dir / "index.md").read_text("utf-8")
    for text, block in ((warning, "'block'"), (index, "`block`")):  # index.md: as code
        assert f"8 inside nn.TransformerEncoderLayer {block}" in text
        assert "fused fast path in eval without grad calls no submodule" in text
        assert "train mode or with grad enabled" in text
    assert read_history(run_dir).height == 0


def test_encoder_layer_observed_itself_keeps_its_fused_kernel_after_a_sampled_forward_raised(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
    plain = copy.deepcopy(model)
    x = torch.randn(3, 5, 16)
    fused = count_fused_calls(monkeypatch)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            model(torch.randn(3, 5, 8))  # sampled: raises on its layer-by-layer path
        unsampled = model(x)
        assert fused[0] == 1  # the fused kernel is back for the unsampled forward
        model(x)  # sampled, layer by layer
        assert fused[0] == 1
        assert torch.equal(unsampled, plain(x))
    remove_observer(model)
    history = read_history(run_dir)
    assert set(history.filter(pl.col("sample_id") == 1)["layer"].unique()) == set(INNER)
