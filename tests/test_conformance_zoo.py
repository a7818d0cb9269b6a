"""The conformance zoo: real model code, every row against plain hooks on a deep copy.

Each case observes a model for one or two steps (every forward sampled, unless it says otherwise)
and runs a deep copy of it with `register_forward_hook` + `Tensor.register_hook`, reduced with
NumPy (`hook_reference`). Both directions are compared: every reference tensor has a row, every
row has a reference tensor, and every value equals NumPy's within a float64-rounding tolerance.
The cases run on the CPU, and on CUDA too when it is available (skipped otherwise); on CUDA the
zoo also counts host synchronisations: none added to an unsampled step (run under
`torch.cuda.set_sync_debug_mode("error")` when the plain model itself syncs never), at most one
per sampled forward and one per backward on a (steady-state) sampled step. `bench/device_check.sh` runs the CUDA
half on one GPU.

References that need a definition:
- torch.func: the reference is the plain model run without the transform, on the same values.
  `grad`: a plain forward and `backward()` of the same loss. Forward mode (`jvp`, `jacfwd`):
  the plain forward; `hessian` (jacfwd of jacrev): a plain forward and backward. `vmap` of a per-sample `grad`: the
  plain model on the whole batch with the sum of the per-sample losses (each layer's output and
  the gradient into it are then the underlying batch, as the model without vmap sees it). `jacrev`
  of the scalar loss: a plain backward (its cotangent batch has one entry). Shapes are not
  compared there (the library says in shape and index.md which it records).
- non-reentrant checkpointing: the forward's calls; the recomputation during backward is
  neither a root forward nor a call nor a row (`hook_reference` skips what a backward pass
  calls, also inside a root forward). Reentrant checkpointing runs its block under no_grad in
  the forward: output rows, and no gradient rows (plain hooks have none).
- torch.compile: sampled forwards run eagerly, so their rows equal the eager copy's; the
  unsampled forward between them runs the compiled graph and has no rows.
Tensor parallelism and FSDP2 are in test_conformance_distributed.py (two gloo processes).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections import namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

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

# One torch thread: the same reduction order on both sides, and tiny models run faster on one
# thread than on two contended ones. On a machine of two or more cores that leaves a core spare,
# so the CPU cases' tensors of 2**16 to 2**22 entries are measured by spare_core's worker
# (test_spare_core.py holds its rows to the training thread's, bit for bit).
pytestmark = pytest.mark.usefixtures("one_thread")

HAS_CUDA = torch.cuda.is_available()
CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]

Step = Callable[[nn.Module, int], Any]
Case = Callable[[torch.device], tuple[nn.Module, Step]]


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
    """Results equal, and the rows conform in both directions."""
    assert_same_results(result, exact and device.type == "cpu")
    result.assert_conforms(tolerance=tolerance_for(device), compare_shapes=compare_shapes)
    assert not result.history.is_empty(), "no rows at all"


def squares_step(inputs: Callable[[], torch.Tensor]) -> Step:
    """A step: forward on fresh inputs, backward of the sum of squares of the first output."""

    def step(m: nn.Module, i: int) -> Any:
        out = m(inputs())
        first = next(iter(leaves(out)))
        first.float().square().sum().backward()
        return out

    return step


# --- the cases: (model, step) on a device -------------------------------------------------------


def mlp_inplace_relu(device: torch.device) -> tuple[nn.Module, Step]:
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True)
    )
    return model.to(device), squares_step(lambda: torch.randn(4, 8, device=device))


def resnet18(device: torch.device) -> tuple[nn.Module, Step]:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    return model.to(device), squares_step(lambda: torch.randn(2, 3, 32, 32, device=device))


def mobilenet_v3_small(device: torch.device) -> tuple[nn.Module, Step]:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10)
    return model.to(device), squares_step(lambda: torch.randn(2, 3, 32, 32, device=device))


def own_loss_step(device: torch.device) -> Step:
    """A Hugging Face step: the model's own loss on random tokens (labels = inputs)."""

    def step(m: nn.Module, i: int) -> Any:
        ids = torch.randint(0, 64, (2, 8), device=device)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss

    return step


def hugging_face(
    model: str, config: str, step: Callable[[torch.device], Step] = own_loss_step, **settings: Any
) -> Case:
    """A Hugging Face model (`model`, a class of transformers) built from a small `config` of
    `settings`, in train mode, and its `step` (by default its own loss on random tokens)."""

    def case(device: torch.device) -> tuple[nn.Module, Step]:
        transformers = pytest.importorskip("transformers")
        built = getattr(transformers, model)(getattr(transformers, config)(**settings))
        return built.to(device).train(), step(device)

    return case


# Sizes shared by the small text models: two layers of width 16, two heads.
TEXT = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
gpt2 = hugging_face(
    "GPT2LMHeadModel",
    "GPT2Config",
    vocab_size=64,
    n_positions=16,
    n_embd=16,
    n_layer=2,
    n_head=2,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
)
bert = hugging_face(
    "BertForMaskedLM", "BertConfig", **TEXT, intermediate_size=32, max_position_embeddings=16
)
# RoBERTa numbers its positions from its padding index + 1: more than the 8 tokens need.
roberta = hugging_face(
    "RobertaForMaskedLM", "RobertaConfig", **TEXT, intermediate_size=32, max_position_embeddings=20
)
distilbert = hugging_face(
    "DistilBertForMaskedLM",
    "DistilBertConfig",
    vocab_size=64,
    dim=16,
    n_layers=2,
    n_heads=2,
    hidden_dim=32,
    max_position_embeddings=16,
)
t5 = hugging_face(
    "T5ForConditionalGeneration",
    "T5Config",
    vocab_size=64,
    d_model=16,
    d_kv=8,
    d_ff=32,
    num_layers=2,
    num_heads=2,
    decoder_start_token_id=0,
    use_cache=False,
)
# A decoder of today's kind: RMSNorm, rotary positions, gated MLP, grouped-query SDPA.
llama = hugging_face(
    "LlamaForCausalLM",
    "LlamaConfig",
    **{**TEXT, "num_attention_heads": 4},
    num_key_value_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
)


def images(device: torch.device) -> Step:
    """A step on two random 32 x 32 RGB images."""
    return squares_step(lambda: torch.randn(2, 3, 32, 32, device=device))


# Hugging Face's ViT: patch embedding by a convolution, a classification head.
vit = hugging_face(
    "ViTForImageClassification",
    "ViTConfig",
    images,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    image_size=32,
    patch_size=8,
    num_labels=3,
)


def contrastive_step(device: torch.device) -> Step:
    """CLIP's step: texts and images in one forward, its own contrastive loss."""

    def step(m: nn.Module, i: int) -> Any:
        ids = torch.randint(0, 64, (2, 8), device=device)
        pixels = torch.randn(2, 3, 32, 32, device=device)
        out = m(input_ids=ids, pixel_values=pixels, return_loss=True)
        out.loss.backward()
        return out.loss

    return step


TOWER = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
}
clip = hugging_face(
    "CLIPModel",
    "CLIPConfig",
    contrastive_step,
    text_config={**TOWER, "vocab_size": 64, "max_position_embeddings": 16},
    vision_config={**TOWER, "image_size": 32, "patch_size": 8},
    projection_dim=8,
)


def speech_step(device: torch.device) -> Step:
    """Whisper's step: 8 mel bins of 32 frames (16 positions after its convolutions), its own loss
    on six random target tokens."""

    def step(m: nn.Module, i: int) -> Any:
        features = torch.randn(2, 8, 32, device=device)
        out = m(input_features=features, labels=torch.randint(1, 64, (2, 6), device=device))
        out.loss.backward()
        return out.loss

    return step


# Whisper: an audio encoder and a text decoder with cross-attention.
whisper = hugging_face(
    "WhisperForConditionalGeneration",
    "WhisperConfig",
    speech_step,
    vocab_size=64,
    d_model=16,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    num_mel_bins=8,
    max_source_positions=16,
    max_target_positions=16,
    decoder_start_token_id=0,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)


def transformer_encoder(mode: str, grad: bool) -> Case:
    def case(device: torch.device) -> tuple[nn.Module, Step]:
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
        model.train(mode == "train")

        def step(m: nn.Module, i: int) -> Any:
            with torch.set_grad_enabled(grad):
                out = m(torch.randn(3, 5, 16, device=device))
            if grad:
                out.square().sum().backward()
            return out

        return model, step

    return case


def recurrent(kind: str) -> Case:
    def case(device: torch.device) -> tuple[nn.Module, Step]:
        # a tuple output: [0], and [1] (GRU) or [1][0], [1][1] (LSTM)
        model = nn.Sequential(getattr(nn, kind)(8, 16, num_layers=2, batch_first=True))
        return model.to(device), squares_step(lambda: torch.randn(2, 5, 8, device=device))

    return case


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


def non_reentrant_checkpointing(device: torch.device) -> tuple[nn.Module, Step]:
    return Checkpointed().to(device), squares_step(lambda: torch.randn(4, 8, device=device))


def bf16_autocast(device: torch.device) -> tuple[nn.Module, Step]:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))

    def step(m: nn.Module, i: int) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = m(torch.randn(4, 8, device=device))
        out.float().square().sum().backward()
        return out

    return model.to(device), step


def parametrized(device: torch.device) -> tuple[nn.Module, Step]:
    """torch.nn.utils.parametrize: each module is a layer, its parametrizations are not."""
    norms = nn.utils.parametrizations
    model = nn.Sequential(
        norms.weight_norm(nn.Conv1d(3, 8, 3, padding=1), dim=2),
        nn.ReLU(),
        nn.Flatten(),
        norms.spectral_norm(nn.Linear(8 * 6, 16)),
        nn.Tanh(),
        norms.orthogonal(nn.Linear(16, 16)),
    )
    return model.to(device), squares_step(lambda: torch.randn(4, 3, 6, device=device))


def waveforms(device: torch.device) -> Step:
    """A step on two random waveforms of 400 samples."""
    return squares_step(lambda: torch.randn(2, 400, device=device))


# Hugging Face's wav2vec2: its positional convolution is weight-normed (parametrize).
wav2vec2 = hugging_face(
    "Wav2Vec2Model",
    "Wav2Vec2Config",
    waveforms,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    conv_dim=(8, 8),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2,
    vocab_size=10,
    layerdrop=0.0,  # the encoder layer runs in the one step (its draw skipped it)
    mask_time_prob=0.0,  # SpecAugment draws from NumPy's RNG, which the steps do not seed
)


def torchscript_submodule(device: torch.device) -> tuple[nn.Module, Step]:
    """A scripted block among eager layers: observed around it (TorchScript is never a layer)."""
    scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    model = nn.Sequential(nn.Linear(8, 8), scripted, nn.ReLU(), nn.Linear(8, 4))
    return model.to(device), squares_step(lambda: torch.randn(4, 8, device=device))


def swin(version: int) -> Case:
    """torchvision's Swin Transformer: its window attention passes `qkv` and `proj`'s weights
    to a functional kernel (the attention is the layer); V2 also calls a small MLP for its bias."""

    def case(device: torch.device) -> tuple[nn.Module, Step]:
        swin_transformer = pytest.importorskip("torchvision.models.swin_transformer")
        parts = {}
        if version == 2:
            parts = {
                "block": swin_transformer.SwinTransformerBlockV2,
                "downsample_layer": swin_transformer.PatchMergingV2,
            }
        model = swin_transformer.SwinTransformer(
            patch_size=[4, 4],
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=[2, 2],
            stochastic_depth_prob=0.0,
            num_classes=4,
            **parts,
        )
        return model.to(device), squares_step(lambda: torch.randn(2, 3, 32, 32, device=device))

    return case


# Hugging Face's Mamba: its mixer passes `conv1d` and `dt_proj`'s weights to functional kernels
# (the mixer is the layer).
mamba = hugging_face(
    "MambaForCausalLM",
    "MambaConfig",
    vocab_size=64,
    hidden_size=16,
    state_size=4,
    num_hidden_layers=2,
    expand=2,
)


def checkpointed_llama(reentrant: bool) -> Case:
    """The Llama case under Hugging Face's own activation checkpointing of every decoder layer
    (non-reentrant, its default; reentrant: the layers inside run under no_grad in the forward,
    and plain hooks, as the rows, have no gradient of them)."""

    def case(device: torch.device) -> tuple[nn.Module, Step]:
        model, step = llama(device)
        # `gradient_checkpointing_enable` before transformers named it activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None)
        enable = enable or getattr(model, "gradient_checkpointing_enable")  # noqa: B009
        enable({"use_reentrant": reentrant})
        return model, step

    return case


Heads = namedtuple("Heads", ["policy", "value"])


@dataclasses.dataclass
class Features:
    hidden: torch.Tensor
    extra: dict[Any, Any]


class Trunk(nn.Module):
    """A layer (its own weight) returning a dataclass, with a dict of an int key, a tuple key and
    a None value inside."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> Features:
        hidden = torch.tanh(x @ self.weight)
        gates = {0: hidden.square(), ("gate", 1): torch.sigmoid(hidden), "unused": None}
        return Features(hidden, gates)


class PolicyValueHead(nn.Module):
    """A layer returning a named tuple of a dict and a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8) * 0.3)

    def forward(self, features: Features) -> Heads:
        gated = features.hidden + features.extra[0] * features.extra[("gate", 1)]
        out = gated @ self.weight.T
        return Heads({"mean": out[:, :2], "log_std": out[:, :2].clamp(-2.0, 0.0)}, out[:, 2])


class StructuredOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = Trunk()
        self.head = PolicyValueHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.head(self.trunk(x))
        return heads.policy["mean"] * heads.policy["log_std"].exp() + heads.value[:, None]


def structured_outputs(device: torch.device) -> tuple[nn.Module, Step]:
    """Layers returning a dataclass and a named tuple with dicts inside (paths `.extra[0]`,
    `.extra[('gate', 1)]`, `.policy['mean']`)."""
    model = StructuredOutputs().to(device)
    return model, squares_step(lambda: torch.randn(4, 8, device=device))


def transformer_with_masks(device: torch.device) -> tuple[nn.Module, Step]:
    """nn.Transformer (encoder and decoder) in eval under no_grad, with a padding mask (the
    encoder's nested-tensor fast path, as it runs when a hook is attached) and a causal mask."""
    model = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True).to(device).eval()

    def step(m: nn.Module, i: int) -> Any:
        padding = torch.zeros(3, 5, dtype=torch.bool, device=device)
        padding[0, 3:] = True
        padding[1, 1:] = True
        causal = nn.Transformer.generate_square_subsequent_mask(4, device=device)
        source, target = torch.randn(3, 5, 16, device=device), torch.randn(3, 4, 16, device=device)
        with torch.no_grad():
            return m(
                source,
                target,
                tgt_mask=causal,
                tgt_is_causal=True,
                src_key_padding_mask=padding,
                memory_key_padding_mask=padding,
            )

    return model, step


def encoder_layer_observed_itself(device: torch.device) -> tuple[nn.Module, Step]:
    """A bare nn.TransformerEncoderLayer as the model, in eval under inference_mode: its own
    fused kernel, which plain hooks on its sublayers switch off, as sampled forwards do."""
    model = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
    model = model.to(device).eval()

    def step(m: nn.Module, i: int) -> Any:
        with torch.inference_mode():
            return m(torch.randn(3, 5, 16, device=device))

    return model, step


CASES: dict[str, Case] = {
    "mlp_inplace_relu": mlp_inplace_relu,
    "resnet18": resnet18,
    "mobilenet_v3_small": mobilenet_v3_small,
    "gpt2": gpt2,
    "bert": bert,
    "roberta": roberta,
    "distilbert": distilbert,
    "t5": t5,
    "llama": llama,
    "vit": vit,
    "clip": clip,
    "whisper": whisper,
    "transformer_encoder_train": transformer_encoder("train", True),
    "transformer_encoder_eval": transformer_encoder("eval", True),
    "transformer_encoder_eval_no_grad": transformer_encoder("eval", False),
    "lstm": recurrent("LSTM"),
    "gru": recurrent("GRU"),
    "non_reentrant_checkpointing": non_reentrant_checkpointing,
    "bf16_autocast": bf16_autocast,
    "parametrized": parametrized,
    "wav2vec2": wav2vec2,
    "torchscript_submodule": torchscript_submodule,
    "swin": swin(1),
    "swin_v2": swin(2),
    "mamba": mamba,
    "llama_activation_checkpointing": checkpointed_llama(reentrant=False),
    "llama_reentrant_checkpointing": checkpointed_llama(reentrant=True),
    "structured_outputs": structured_outputs,
    "transformer_with_masks": transformer_with_masks,
    "encoder_layer_observed_itself": encoder_layer_observed_itself,
}
STEPS = {"lstm": 2, "gru": 2}  # two samples: call indices and sample ids restart per forward
# Parametrized modules (torch.nn.utils.parametrize) are layers, the modules of their weights not.
PARAMETRIZED = {"parametrized": ["0", "3", "5"], "wav2vec2": ["encoder.pos_conv_embed.conv"]}
HELD_NOT_CALLED = {  # a module that hands children's weights or settings to a kernel has rows
    "bert": ("bert.encoder.layer.0.attention.self", "bert.encoder.layer.0.attention.self.dropout"),
    "roberta": (
        "roberta.encoder.layer.0.attention.self",
        "roberta.encoder.layer.0.attention.self.dropout",
    ),
    "distilbert": (
        "distilbert.transformer.layer.0.attention",
        "distilbert.transformer.layer.0.attention.dropout",
    ),
    "gpt2": ("transformer.h.0.attn", "transformer.h.0.attn.attn_dropout"),
    "swin": ("features.1.0.attn", "features.1.0.attn.qkv"),
    "swin_v2": ("features.1.0.attn", "features.1.0.attn.proj"),
    "mamba": ("backbone.layers.0.mixer", "backbone.layers.0.mixer.conv1d"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rows_equal_plain_hooks(run_dir: Path, device: torch.device, name: str) -> None:
    model, step = CASES[name](device)
    result = run_both(model, step, run_dir, steps=STEPS.get(name, 1))
    if name == "bf16_autocast":
        assert "bfloat16" in result.history["dtype"].unique().to_list()
    if name in HELD_NOT_CALLED:  # and the children it never calls have none
        layer, holder = HELD_NOT_CALLED[name]
        assert layer in result.catalog
        assert holder not in result.catalog
        assert layer in result.history["layer"].unique().to_list()
    if name == "structured_outputs":
        paths = set(result.history["tensor_path"].to_list())
        assert {".extra[0]", ".extra[('gate', 1)]", ".policy['mean']", ".value"} <= paths
    if name == "torchscript_submodule":
        assert result.catalog == ["0", "2", "3"]
    if name in PARAMETRIZED:
        assert not [layer for layer in result.catalog if ".parametrizations" in layer]
        assert set(PARAMETRIZED[name]) <= set(result.history["layer"].unique().to_list())
    check(result, device)


def test_inductor_compiled_model(run_dir: Path, device: torch.device) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    step = squares_step(lambda: torch.randn(4, 8, device=device))
    result = run_both(model, step, run_dir, steps=3, every=2, prepare=torch.compile)
    assert sorted(result.history["forward_index"].unique().to_list()) == [0, 2]
    check(result, device, exact=False)  # the unsampled step ran inductor's kernels


def test_inductor_compiled_model_across_shape_changes(run_dir: Path, device: torch.device) -> None:
    """The batch size changes every step: the unsampled steps compile, then recompile with
    dynamic shapes (torch.compile's automatic dynamic), the sampled ones between them run
    eagerly; their rows equal the eager copy's."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(device)

    def step(m: nn.Module, i: int) -> Any:
        return squares_step(lambda: torch.randn(2 + i, 8, device=device))(m, i)

    result = run_both(model, step, run_dir, steps=5, every=2, prepare=torch.compile)
    assert sorted(result.history["forward_index"].unique().to_list()) == [0, 2, 4]
    assert sorted({s[0] for s in result.history["shape"].to_list()}) == [2, 4, 6]
    check(result, device, exact=False)  # the unsampled steps ran inductor's kernels


# --- torch.func ---------------------------------------------------------------------------------


def func_model(device: torch.device) -> nn.Module:
    """Per-sample independent (no batch statistics), so vmap over samples is the batch."""
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)


def plain_backward(device: torch.device) -> Step:
    """The reference of the torch.func steps: the summed loss, one ordinary backward."""

    def step(m: nn.Module, i: int) -> Any:
        m(torch.randn(5, 6, device=device)).square().sum().backward()
        return {name: p.grad for name, p in m.named_parameters()}

    return step


def functional_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().sum()

    return loss


def func_grad_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        return torch.func.grad(functional_loss(m))(params, torch.randn(5, 6, device=device))

    return step


def func_vmap_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        per_sample = torch.func.vmap(torch.func.grad(functional_loss(m)), in_dims=(None, 0))
        grads = per_sample(params, torch.randn(5, 6, device=device))
        return {name: g.sum(0) for name, g in grads.items()}

    return step


def func_jacrev_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        return torch.func.jacrev(functional_loss(m))(params, torch.randn(5, 6, device=device))

    return step


@pytest.mark.parametrize(
    "transform", [func_grad_step, func_vmap_step, func_jacrev_step], ids=["grad", "vmap", "jacrev"]
)
def test_torch_func(
    run_dir: Path, device: torch.device, transform: Callable[[torch.device], Step]
) -> None:
    model = func_model(device)
    result = run_both(model, transform(device), run_dir, reference_step=plain_backward(device))
    # the transform's parameter gradients equal the plain backward's
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value)
    result.assert_conforms(tolerance=tolerance_for(device), compare_shapes=False)


def scalar_of(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().sum()

    return loss


def func_jvp_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        x = torch.randn(5, 6, device=device)
        return torch.func.jvp(scalar_of(m), (x,), (torch.ones_like(x),))

    return step


def func_jacfwd_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        return torch.func.jacfwd(scalar_of(m))(torch.randn(5, 6, device=device))

    return step


def func_hessian_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        return torch.func.hessian(scalar_of(m))(torch.randn(5, 6, device=device)[:1])

    return step


def plain_forward(device: torch.device, batch: int = 5, backward: bool = False) -> Step:
    """The reference of a forward-mode transform: the plain forward (and, where the transform
    runs a reverse pass inside, as `hessian`'s jacrev does, a plain backward of the loss)."""

    def step(m: nn.Module, i: int) -> Any:
        out = m(torch.randn(5, 6, device=device)[:batch])
        if backward:
            out.square().sum().backward()
        return out

    return step


FORWARD_MODE = {
    "jvp": (func_jvp_step, plain_forward),
    "jacfwd": (func_jacfwd_step, plain_forward),
    "hessian": (func_hessian_step, lambda device: plain_forward(device, 1, backward=True)),
}


@pytest.mark.parametrize("transform", list(FORWARD_MODE))
def test_torch_func_forward_mode(run_dir: Path, device: torch.device, transform: str) -> None:
    """Forward-mode transforms: the rows hold the plain model's values (no gradient flows back
    into an output under jvp or jacfwd; hessian's jacrev brings the plain backward's)."""
    model = func_model(device)
    unobserved = copy.deepcopy(model)
    step, reference = FORWARD_MODE[transform]
    result = run_both(model, step(device), run_dir, reference_step=reference(device))
    torch.manual_seed(1000)
    expected = list(leaves(step(device)(unobserved, 0)))
    for got, want in zip(leaves(result.observed_outputs[0]), expected, strict=True):
        assert torch.equal(got, want)  # the transform computed what it computes unobserved
    result.assert_conforms(tolerance=tolerance_for(device), compare_shapes=False)


# --- CUDA: host synchronisations ----------------------------------------------------------------


def count_host_syncs(fn: Callable[[], Any]) -> int:
    """How many synchronising CUDA calls `fn` makes (torch's sync debug mode, warn level)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def run_without_host_syncs(fn: Callable[[], Any]) -> None:
    """Run `fn` with any synchronising CUDA call raising."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@CUDA_ONLY
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_host_syncs(run_dir: Path, name: str) -> None:
    device = torch.device("cuda")
    model, step = CASES[name](device)
    plain = copy.deepcopy(model)
    step(plain, 0)  # warm-up: lazy CUDA initialisation is not the step's
    plain_syncs = count_host_syncs(lambda: step(plain, 1))
    step(model, 0)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    try:
        sampled = [count_host_syncs(lambda: step(model, 1))]  # forward_index 0: sampled
        if plain_syncs == 0:
            run_without_host_syncs(lambda: step(model, 2))  # forward_index 1: not sampled
            unsampled = 0
        else:
            unsampled = count_host_syncs(lambda: step(model, 2))
        sampled.append(count_host_syncs(lambda: step(model, 3)))  # forward_index 2: sampled
    finally:
        remove_observer(model)
    torch.cuda.synchronize()
    print(f"{name}: host syncs per step: plain {plain_syncs}, sampled {sampled}")
    assert unsampled == plain_syncs
    # Steady state (the second sampled step; the first may make one-time constants): one
    # transfer when the sampled forward ends, one when its backward ends.
    passes = 1 if name == "transformer_encoder_eval_no_grad" else 2
    assert plain_syncs <= sampled[1] <= plain_syncs + passes, (sampled, plain_syncs)
