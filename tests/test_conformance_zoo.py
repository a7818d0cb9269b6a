"""The conformance zoo: real model code, every row against plain hooks on a deep copy.

Each case observes a model for one or two steps (every forward sampled, unless it says otherwise)
and runs a deep copy of it with `register_forward_hook` + `Tensor.register_hook`, reduced with
NumPy (`hook_reference`). Both directions are compared: every reference tensor has a row, every
row has a reference tensor, and every value equals NumPy's within a float64-rounding tolerance.
The cases run on the CPU, and on CUDA too when it is available (skipped otherwise).

References that need a definition:
- torch.func: the reference is the plain model run without the transform, on the same values.
  `grad`: a plain forward and `backward()` of the same loss. `vmap` of a per-sample `grad`: the
  plain model on the whole batch with the sum of the per-sample losses (each layer's output and
  the gradient into it are then the underlying batch, as the model without vmap sees it). `jacrev`
  of the scalar loss: a plain backward (its cotangent batch has one entry). Shapes are not
  compared there (the library says in shape and index.md which it records).
- non-reentrant checkpointing: the forward's calls; the recomputation during backward runs
  outside any root forward and is neither a call nor a row.
- torch.compile: sampled forwards run eagerly, so their rows equal the eager copy's; the
  unsampled forward between them runs the compiled graph and has no rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hook_reference import (
    ACCELERATOR_TOLERANCE,
    CPU_TOLERANCE,
    Conformance,
    Tolerance,
    leaves,
    run_both,
)

# Deterministic kernels on CUDA (set before the first CUDA call makes a cuBLAS handle).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The device a case runs on; on CUDA with deterministic algorithms."""
    name = request.param
    if name == "cpu":
        yield torch.device("cpu")
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield torch.device(name)
    finally:
        torch.use_deterministic_algorithms(False)


def tolerance_for(device: torch.device) -> Tolerance:
    return CPU_TOLERANCE if device.type == "cpu" else ACCELERATOR_TOLERANCE


def assert_same_results(result: Conformance, exact: bool) -> None:
    """The observed steps computed what the copy computed."""
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        for a, b in zip(leaves(got), leaves(want), strict=True):
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b)


def check(
    result: Conformance, device: torch.device, *, compare_shapes: bool = True, exact: bool = True
) -> None:
    """Results equal, and the rows conform in both directions; at least one row per layer."""
    assert_same_results(result, exact and device.type == "cpu")
    result.assert_conforms(tolerance=tolerance_for(device), compare_shapes=compare_shapes)
    recorded = set(result.history["layer"].unique().to_list())
    assert recorded, "no rows at all"


def backward_of_squares(model: nn.Module, inputs: Callable[[], Any]) -> Callable[..., Any]:
    """A step: forward on fresh inputs, backward of the sum of squares of the output."""

    def step(m: nn.Module, i: int) -> Any:
        out = m(inputs())
        first = next(iter(leaves(out)))
        first.float().square().sum().backward()
        return out

    return step


# --- in-place activations: torchvision and a small MLP ------------------------------------------


def test_mlp_with_inplace_relu(run_dir: Path, device: torch.device) -> None:
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True)
    ).to(device)
    step = backward_of_squares(model, lambda: torch.randn(4, 8, device=device))
    check(run_both(model, step, run_dir), device)


def test_resnet18(run_dir: Path, device: torch.device) -> None:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(device)
    step = backward_of_squares(model, lambda: torch.randn(2, 3, 32, 32, device=device))
    check(run_both(model, step, run_dir), device)


def test_mobilenet_v3_small(run_dir: Path, device: torch.device) -> None:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10).to(device)
    step = backward_of_squares(model, lambda: torch.randn(2, 3, 32, 32, device=device))
    check(run_both(model, step, run_dir), device)


# --- Hugging Face models from tiny configs (no downloads) ---------------------------------------


def tokens(device: torch.device) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), device=device)


def loss_step(m: nn.Module, i: int, device: torch.device, **extra: Any) -> Any:
    """A Hugging Face step: the model's own loss on random tokens (labels = inputs)."""
    ids = tokens(device)
    out = m(input_ids=ids, labels=ids, **extra)
    out.loss.backward()
    return out.loss


def test_gpt2(run_dir: Path, device: torch.device) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).to(device).train()
    check(run_both(model, lambda m, i: loss_step(m, i, device), run_dir), device)


def test_bert(run_dir: Path, device: torch.device) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = transformers.BertForMaskedLM(config).to(device).train()
    check(run_both(model, lambda m, i: loss_step(m, i, device), run_dir), device)


def test_t5(run_dir: Path, device: torch.device) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        use_cache=False,
    )
    model = transformers.T5ForConditionalGeneration(config).to(device).train()
    check(run_both(model, lambda m, i: loss_step(m, i, device), run_dir), device)


# --- torch.nn building blocks -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "grad"), [("train", True), ("eval", True), ("eval", False)], ids=str
)
def test_transformer_encoder(run_dir: Path, device: torch.device, mode: str, grad: bool) -> None:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
    model.train(mode == "train")

    def step(m: nn.Module, i: int) -> Any:
        with torch.set_grad_enabled(grad):
            out = m(torch.randn(3, 5, 16, device=device))
        if grad:
            out.square().sum().backward()
        return out

    check(run_both(model, step, run_dir), device)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent(run_dir: Path, device: torch.device, kind: str) -> None:
    rnn = getattr(nn, kind)(8, 16, num_layers=2, batch_first=True)
    model = nn.Sequential(rnn).to(device)  # outputs a tuple: [0], [1] or [1][0], [1][1]
    step = backward_of_squares(model, lambda: torch.randn(2, 5, 8, device=device))
    check(run_both(model, step, run_dir, steps=2), device)


class Checkpointed(nn.Module):
    """Two blocks, each under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def test_non_reentrant_checkpointing(run_dir: Path, device: torch.device) -> None:
    model = Checkpointed().to(device)
    step = backward_of_squares(model, lambda: torch.randn(4, 8, device=device))
    check(run_both(model, step, run_dir), device)


def test_bf16_autocast(run_dir: Path, device: torch.device) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    model = model.to(device)

    def step(m: nn.Module, i: int) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = m(torch.randn(4, 8, device=device))
        out.float().square().sum().backward()
        return out

    result = run_both(model, step, run_dir)
    assert "bfloat16" in result.history["dtype"].unique().to_list()
    check(result, device)


def test_inductor_compiled_model(run_dir: Path, device: torch.device) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    step = backward_of_squares(model, lambda: torch.randn(4, 8, device=device))
    result = run_both(model, step, run_dir, steps=3, every=2, prepare=lambda m: torch.compile(m))
    assert sorted(result.history["forward_index"].unique().to_list()) == [0, 2]
    check(result, device, exact=False)  # the unsampled step ran inductor's kernels


# --- torch.func ---------------------------------------------------------------------------------


def func_model(device: torch.device) -> nn.Module:
    """Per-sample independent (no batch statistics), so vmap over samples is the batch."""
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)


def plain_backward(device: torch.device) -> Callable[[nn.Module, int], Any]:
    """The reference of the torch.func steps: the summed loss, one ordinary backward."""

    def step(m: nn.Module, i: int) -> Any:
        m(torch.randn(5, 6, device=device)).square().sum().backward()
        return {name: p.grad for name, p in m.named_parameters()}

    return step


def functional_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().sum()

    return loss


def func_grad_step(device: torch.device) -> Callable[[nn.Module, int], Any]:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        return torch.func.grad(functional_loss(m))(params, torch.randn(5, 6, device=device))

    return step


def func_vmap_step(device: torch.device) -> Callable[[nn.Module, int], Any]:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        per_sample = torch.func.vmap(torch.func.grad(functional_loss(m)), in_dims=(None, 0))
        grads = per_sample(params, torch.randn(5, 6, device=device))
        return {name: g.sum(0) for name, g in grads.items()}

    return step


def func_jacrev_step(device: torch.device) -> Callable[[nn.Module, int], Any]:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        return torch.func.jacrev(functional_loss(m))(params, torch.randn(5, 6, device=device))

    return step


FUNC_XFAIL = pytest.mark.xfail(
    strict=True, reason="issue 18: torch.func-wrapped tensors are measured as null today"
)


@FUNC_XFAIL
@pytest.mark.parametrize(
    "transform",
    [func_grad_step, func_vmap_step, func_jacrev_step],
    ids=["grad", "vmap", "jacrev"],
)
def test_torch_func(
    run_dir: Path, device: torch.device, transform: Callable[[torch.device], Any]
) -> None:
    model = func_model(device)
    result = run_both(
        model, transform(device), run_dir, reference_step=plain_backward(device), steps=1
    )
    # results: the transform's parameter gradients equal the plain backward's
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value)
    result.assert_conforms(tolerance=tolerance_for(device), compare_shapes=False)
