"""The conformance zoo's cases: real model code (torchvision, tiny Hugging Face models from
configs, `nn.Transformer*`, RNNs, checkpointing, autocast, parametrizations, TorchScript,
structured outputs), each a (model, step) on a device; `CASES` by name."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from _zoo import Case, Step, squares_step


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
