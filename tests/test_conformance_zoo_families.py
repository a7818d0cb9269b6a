"""More real model families and training set-ups equal plain hooks (the zoo's second half).

test_conformance_zoo.py holds the first half and says what the reference is. These cases add
what users train that it lacks: a torchvision detector in train mode (a list of images and a
list of target dicts in, a dict of losses out; its transform returns an ImageList, which is no
tensor and has no rows), a segmentation model with an auxiliary head (a dict of two outputs),
an encoder-decoder trained on labels (BART), a packed variable-length batch through an LSTM
(it returns a PackedSequence, a named tuple whose `batch_sizes` is an int64 tensor),
`nn.Embedding(sparse=True)` and `nn.EmbeddingBag` (an empty bag, per-sample weights),
a channels_last ResNet, a Llama under bfloat16 autocast on the CPU, DenseNet's memory-efficient
blocks (torchvision's own checkpointing), quantization-aware training (fake-quantize modules
that return their input's values) and inference after quantization (dynamic, or the trained
model converted: quantized Linears whose weights a child holds packed); and decoders whose attention or feed-forward the zoo's Llama
does not have: Mistral's sliding window, Gemma 2's logit soft-capping and alternating local
attention, DeepSeek-V3's latent attention and shared-plus-routed experts, Qwen2-MoE's gated
shared expert, OLMoE, GPT-OSS's attention sinks and clamped experts, Phi-3's fused projections
and ModernBERT. CPU only; every forward sampled, two steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _zoo import Step, squares_step
from hook_reference import Conformance, leaves, run_both

pytestmark = pytest.mark.usefixtures("one_thread")


def detector() -> tuple[nn.Module, Step]:
    """Faster R-CNN (MobileNetV3 FPN) on two 64 x 64 images with one box each, its own losses."""
    detection = pytest.importorskip("torchvision.models.detection")
    model = detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=3,
        min_size=64,
        max_size=64,
        rpn_pre_nms_top_n_train=20,
        rpn_post_nms_top_n_train=10,
        rpn_batch_size_per_image=16,
        box_batch_size_per_image=8,
    )

    def step(m: nn.Module, i: int) -> Any:
        images = [torch.rand(3, 64, 64) for _ in range(2)]
        box = {"boxes": torch.tensor([[4.0, 4.0, 30.0, 40.0]]), "labels": torch.tensor([1])}
        losses = m(images, [box, dict(box)])
        torch.stack(list(losses.values())).sum().backward()
        return losses

    return model.train(), step


def segmentation() -> tuple[nn.Module, Step]:
    """DeepLabV3 (MobileNetV3) with its auxiliary classifier: `out` and `aux` both in the loss."""
    segmentation = pytest.importorskip("torchvision.models.segmentation")
    model = segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=True
    )

    def step(m: nn.Module, i: int) -> Any:
        out = m(torch.randn(2, 3, 64, 64))
        (out["out"].square().sum() + out["aux"].square().sum()).backward()
        return out

    return model.train(), step


def bart() -> tuple[nn.Module, Step]:
    """BART from a small config: its own loss on labels (decoder inputs shifted from them)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=16,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )

    def step(m: nn.Module, i: int) -> Any:
        out = m(input_ids=torch.randint(3, 64, (2, 8)), labels=torch.randint(3, 64, (2, 6)))
        out.loss.backward()
        return out.loss

    return transformers.BartForConditionalGeneration(config).train(), step


class PackedLSTM(nn.Module):
    """Sequences of lengths 5, 2 and 3, packed unsorted, through an LSTM, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        rnn = nn.utils.rnn
        packed = rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        return self.head(rnn.pad_packed_sequence(out, batch_first=True)[0])


def packed_lstm() -> tuple[nn.Module, Step]:
    def step(m: nn.Module, i: int) -> Any:
        out = m(torch.randn(3, 5, 4), torch.tensor([5, 2, 3]))
        out.square().sum().backward()
        return out

    return PackedLSTM(), step


class Bags(nn.Module):
    """A sparse embedding with a padding index, and bags summed (weighted), averaged (sparse
    gradient) and maxed; the second of four bags is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8, sparse=True, padding_idx=0)
        self.weighted = nn.EmbeddingBag(50, 8, mode="sum")
        self.averaged = nn.EmbeddingBag(50, 8, mode="mean", sparse=True)
        self.maxed = nn.EmbeddingBag(50, 8, mode="max")
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> Any:
        flat = ids.flatten()
        bags = self.weighted(flat, offsets, per_sample_weights=weights)
        bags = bags + self.averaged(flat, offsets) + self.maxed(ids)
        return self.head(self.embed(ids).mean(1) + bags)


def embedding_bags() -> tuple[nn.Module, Step]:
    def step(m: nn.Module, i: int) -> Any:
        ids = torch.randint(1, 50, (4, 5))
        ids[0, :2] = 0  # the padding index
        out = m(ids, torch.tensor([0, 5, 5, 12]), torch.rand(20))
        out.square().sum().backward()
        return out

    return Bags(), step


def channels_last_resnet() -> tuple[nn.Module, Step]:
    models = pytest.importorskip("torchvision.models")
    model = models.resnet18(weights=None, num_classes=4).to(memory_format=torch.channels_last)
    return model, squares_step(
        lambda: torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    )


def llama_bfloat16_autocast() -> tuple[nn.Module, Step]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )

    def step(m: nn.Module, i: int) -> Any:
        ids = torch.randint(0, 64, (2, 8))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss

    return transformers.LlamaForCausalLM(config).train(), step


def memory_efficient_densenet() -> tuple[nn.Module, Step]:
    densenet = pytest.importorskip("torchvision.models.densenet")
    model = densenet.DenseNet(
        growth_rate=8,
        block_config=(2, 2),
        num_init_features=8,
        bn_size=2,
        memory_efficient=True,
        num_classes=3,
    )
    return model, squares_step(lambda: torch.randn(2, 3, 32, 32))


class Quantizable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        quantization = torch.ao.quantization
        self.quant, self.dequant = quantization.QuantStub(), quantization.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def quantization_aware() -> tuple[nn.Module, Step]:
    """`prepare_qat`: fake-quantize modules inside the Linears and after the stubs."""
    quantization = torch.ao.quantization
    model = Quantizable().train()
    model.qconfig = quantization.get_default_qat_qconfig("x86")  # pyrefly: ignore[bad-argument-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation note
        prepared = quantization.prepare_qat(model)
    return prepared, squares_step(lambda: torch.randn(3, 8))


def quantized(how: str) -> Callable[[], tuple[nn.Module, Step]]:
    """CPU inference after quantization: `quantize_dynamic` of the Linears (and an LSTM), or
    the quantization-aware model `convert`ed (static quantized Linears). Each quantized Linear
    keeps its packed weights in a `_packed_params` child it never calls."""

    def build() -> tuple[nn.Module, Step]:
        quantization = torch.ao.quantization
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notes
            if how == "dynamic":
                model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
                model.append(nn.LSTM(4, 4, batch_first=True))
                model = quantization.quantize_dynamic(model, {nn.Linear, nn.LSTM})
            else:
                prepared, _ = quantization_aware()
                prepared(torch.randn(3, 8))  # its observers see values before convert
                model = quantization.convert(prepared.eval())

        def step(m: nn.Module, i: int) -> Any:
            with torch.no_grad():
                return m(torch.randn(2, 3, 8))

        return model.eval(), step

    return build


def quantized_linears_are_layers(result: Conformance) -> None:
    """Each quantized Linear has rows; its packed-weights holder is no layer."""
    assert not [layer for layer in result.catalog if "_packed_params" in layer]
    linears = {"0", "2"} if "3" in result.catalog else {"fc1", "fc2"}
    assert linears <= set(result.history["layer"].to_list())


def has_int64_batch_sizes(result: Conformance) -> None:
    rows = result.history.filter(result.history["layer"] == "lstm")
    assert {"[0].batch_sizes", "[0].data"} <= set(rows["tensor_path"].to_list())


def has_the_empty_bags_zeros(result: Conformance) -> None:
    history = result.history
    weighted = history.filter(
        history["layer"] == "weighted",
        history["signal"] == "output",
        history["metric"] == "zero_fraction",
    )
    assert weighted["shape"].to_list()[0] == [4, 8]
    assert min(weighted["value"].to_list()) >= 8 / 32  # the empty bag's row is zeros


def has_losses_and_images(result: Conformance) -> None:
    assert "transform" in result.catalog
    assert "roi_heads.box_predictor.cls_score" in result.history["layer"].to_list()


CASES: dict[str, tuple[Callable[[], tuple[nn.Module, Step]], Callable[[Conformance], None]]] = {
    "fasterrcnn_train": (detector, has_losses_and_images),
    "deeplabv3_with_aux": (segmentation, lambda result: None),
    "bart_with_labels": (bart, lambda result: None),
    "packed_lstm": (packed_lstm, has_int64_batch_sizes),
    "sparse_embedding_and_bags": (embedding_bags, has_the_empty_bags_zeros),
    "channels_last_resnet18": (channels_last_resnet, lambda result: None),
    "llama_bfloat16_autocast": (llama_bfloat16_autocast, lambda result: None),
    "densenet_memory_efficient": (memory_efficient_densenet, lambda result: None),
    "quantization_aware_training": (quantization_aware, lambda result: None),
    "dynamic_quantization": (quantized("dynamic"), quantized_linears_are_layers),
    "static_quantization": (quantized("static"), quantized_linears_are_layers),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rows_of_more_model_families_equal_plain_hooks(run_dir: Path, name: str) -> None:
    build, check = CASES[name]
    model, step = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers that never ran, checkpointing's own notes
        result = run_both(model, step, run_dir, steps=2)
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        for a, b in zip(leaves(got), leaves(want), strict=True):
            assert torch.equal(a, b)  # the observed model computed what the copy did
    result.assert_conforms()
    check(result)


DECODER = {
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 16,
}
ROUTED = {"num_experts_per_tok": 1, "moe_intermediate_size": 8}
DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral_sliding_window": ("Mistral", {"sliding_window": 4}),
    "gemma2": ("Gemma2", {"head_dim": 8, "sliding_window": 4}),
    "deepseek_v3": (
        "DeepseekV3",
        {
            **ROUTED,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 8,
            "q_lora_rank": 8,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "qwen2_moe": (
        "Qwen2Moe",
        {**ROUTED, "num_experts": 8, "shared_expert_intermediate_size": 16},
    ),
    "olmoe": ("Olmoe", {"num_experts": 8, "num_experts_per_tok": 1}),
    "gpt_oss": ("GptOss", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 1}),
    "phi3": ("Phi3", {"pad_token_id": 0}),
}


@pytest.mark.parametrize("name", [*DECODERS, "modernbert"])
def test_rows_of_more_decoders_equal_plain_hooks(run_dir: Path, name: str) -> None:
    transformers = pytest.importorskip("transformers")
    if name == "modernbert":
        config = transformers.ModernBertConfig(
            **{k: v for k, v in DECODER.items() if k != "num_key_value_heads"}, pad_token_id=0
        )
        model = transformers.ModernBertForMaskedLM(config)
    else:
        family, settings = DECODERS[name]
        config = getattr(transformers, f"{family}Config")(**DECODER, **settings)
        model = getattr(transformers, f"{family}ForCausalLM")(config)

    def step(m: nn.Module, i: int) -> Any:
        ids = torch.randint(0, 64, (2, 8))
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers that never ran (an unused dropout, say)
        result = run_both(model.train(), step, run_dir, steps=2)
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        assert torch.equal(got, want)
    result.assert_conforms()
