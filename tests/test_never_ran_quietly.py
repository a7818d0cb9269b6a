"""Popular models' default runs warn only of what a user can act on.

A layer that never runs in any run of a model is no news: Hugging Face's GPT-2 attention passes
its `attn_dropout`'s rate to SDPA (or its eager function) and calls the module only on a path
off by default, so the attention is the layer (`selection.py`); T5 and BART keep a `shared`
embedding their forward never calls, whose weight their `embed_tokens` hold and run, so it is a
tied twin, noted in index.md and left out of the removal warning (`never_ran.py`). A layer that
never ran for any other reason (a branch not taken, a head of another type tied to the
embedding) is still warned.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.selection import default_layers

from conftest import read_history


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("torchinstruments:")]


def observed_steps(model: nn.Module, directory: Path, step: Any, steps: int = 2) -> list[str]:
    """Runs `steps` sampled train steps; the library's warnings, removal included."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
        for _ in range(steps):
            step(model)
        remove_observer(model)
    return ours(caught)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_attention_is_the_layer_and_a_default_run_warns_nothing(
    tmp_path: Path, attention: str
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, use_cache=False,
        bos_token_id=0, eos_token_id=0, attn_implementation=attention,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).train()
    layers = default_layers(model)
    assert "transformer.h.0.attn" in layers
    assert not [name for name in layers if name.endswith("attn_dropout")]
    hooked: list[torch.Tensor] = []
    model.transformer.h[0].attn.register_forward_hook(
        lambda module, args, output: hooked.append(output[0].detach())
    )
    ids = torch.randint(0, 64, (2, 8))

    def step(m: nn.Module) -> None:
        m(input_ids=ids, labels=ids).loss.backward()

    assert observed_steps(model, tmp_path / "run", step) == []
    rows = read_history(tmp_path / "run").filter(
        layer="transformer.h.0.attn", signal="output", metric="mean", tensor_path="[0]"
    )
    means = [tensor.double().mean().item() for tensor in hooked]
    assert rows["value"].to_list() == pytest.approx(means, rel=1e-9)


def test_t5_shared_embedding_is_noted_as_a_tied_twin_not_warned(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).train()
    assert model.shared.weight is model.encoder.embed_tokens.weight  # tied, two modules
    ids = torch.randint(0, 64, (2, 6))

    def step(m: nn.Module) -> None:
        m(input_ids=ids, labels=ids).loss.backward()

    assert observed_steps(model, tmp_path / "run", step) == []
    index = (tmp_path / "run" / "index.md").read_text()
    assert "`shared` (as `encoder.embed_tokens`, `decoder.embed_tokens`)" in index


class TiedTwins(nn.Module):
    """Two embeddings holding one weight (one called), a head tied to it (maybe called), and a
    branch that is never taken."""

    def __init__(self, use_head: bool) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 4)
        self.embed = nn.Embedding(10, 4)
        self.embed.weight = self.shared.weight
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.shared.weight
        self.unused = nn.Linear(4, 4)
        self.use_head = use_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        return self.head(hidden) if self.use_head else hidden


def sum_backward(ids: torch.Tensor) -> Any:
    return lambda m: m(ids).sum().backward()


def test_a_tied_twin_is_noted_while_a_branch_not_taken_is_warned(tmp_path: Path) -> None:
    warned = observed_steps(
        TiedTwins(use_head=True), tmp_path / "run", sum_backward(torch.arange(6))
    )
    assert len(warned) == 1
    assert "1 of 4 selected layers never ran" in warned[0]
    assert "'unused'" in warned[0]
    assert "'shared'" not in warned[0]
    index = (tmp_path / "run" / "index.md").read_text()
    assert "Tied weights: 1 selected layer never ran" in index
    assert "`shared` (as `embed`)" in index


def test_a_tied_layer_of_another_type_that_never_ran_is_warned(tmp_path: Path) -> None:
    """A head holding the embedding's weight computes something else: not a twin."""
    warned = observed_steps(
        TiedTwins(use_head=False), tmp_path / "run", sum_backward(torch.arange(6))
    )
    assert len(warned) == 1
    assert "2 of 4 selected layers never ran" in warned[0]
    assert "'head'" in warned[0]
    assert "'unused'" in warned[0]


class IdleTwins(nn.Module):
    """Two embeddings holding one weight, neither called."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 4)
        self.embed = nn.Embedding(10, 4)
        self.embed.weight = self.shared.weight
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_twins_that_both_never_ran_are_warned(tmp_path: Path) -> None:
    warned = observed_steps(IdleTwins(), tmp_path / "run", sum_backward(torch.randn(3, 4)))
    assert len(warned) == 1
    assert "2 of 3 selected layers never ran" in warned[0]
    assert "'shared', 'embed'" in warned[0]
    assert "Tied weights" not in (tmp_path / "run" / "index.md").read_text()


class Residual(nn.Module):
    """Calls `drop` only `if self.use_res_connect`, as torchvision's MBConv calls its
    stochastic depth, and `extra` only under a setting that is true."""

    def __init__(self, use_res_connect: bool) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)
        self.extra = nn.Tanh()
        self.use_res_connect = use_res_connect
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        if self.use_res_connect:
            out = self.drop(out) + x
        if self.use_extra and out.shape[0] > 100:  # not a plain setting: a real branch
            out = self.extra(out)
        return out


def test_a_layer_switched_off_by_its_parents_setting_is_noted_not_warned(tmp_path: Path) -> None:
    """The setting is named as the layer is, by its literal: the parent's name holds a line
    break."""
    model = nn.Sequential()
    model.add_module("a\nb", Residual(use_res_connect=False))
    model.add_module("1", Residual(use_res_connect=True))
    warned = observed_steps(model, tmp_path / "run", sum_backward(torch.randn(3, 4)))
    assert len(warned) == 1
    assert "2 of 6 selected layers never ran" in warned[0]
    assert "'a\\nb.extra', '1.extra'" in warned[0]
    assert "'a\\nb.drop'" not in warned[0]
    index = (tmp_path / "run" / "index.md").read_text()
    assert "Switched off: 1 selected layer never ran" in index
    assert "`'a\\nb.drop'` (`'a\\nb.use_res_connect'`)" in index


def test_efficientnet_googlenet_and_quantizable_mobilenet_in_eval_warn_nothing(
    tmp_path: Path,
) -> None:
    """EfficientNet's first block of each stage has no residual, so its stochastic depth is
    never called; GoogLeNet calls its auxiliary heads only in training; the quantizable
    MobileNetV2 adds its residual through a method of its `skip_add` (`skip_add.add(x, y)`,
    which runs the `activation_post_process` inside) only `if self.use_res_connect`."""
    torchvision = pytest.importorskip("torchvision")
    efficientnet = torchvision.models.efficientnet_b0(num_classes=4).eval()
    googlenet = torchvision.models.googlenet(num_classes=4, init_weights=False).eval()
    quantizable = torchvision.models.quantization.mobilenet_v2(num_classes=4).eval()
    x = torch.randn(1, 3, 64, 64)
    for index, model in enumerate([efficientnet, googlenet, quantizable]):
        assert observed_steps(model, tmp_path / f"run{index}", lambda m: m(x), steps=1) == []
    index_md = (tmp_path / "run0" / "index.md").read_text()
    assert "`features.1.0.stochastic_depth` (`features.1.0.use_res_connect`)" in index_md
    assert "`aux1.fc1` (`training`)" in (tmp_path / "run1" / "index.md").read_text()
    skip = "`features.1.skip_add.activation_post_process` (`features.1.use_res_connect`)"
    assert skip in (tmp_path / "run2" / "index.md").read_text()
