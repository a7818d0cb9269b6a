"""Real models whose layers run a varying number of times per root forward equal plain hooks.

The zoo's cases (test_conformance_zoo.py) call each layer the same way on every step. These
call them as routing and control flow decide: a mixture of experts whose router sends no token
to some experts (an expert called on an empty batch, or not called at all, so the calls and
layers of a sample differ from the next sample's), Hugging Face's Mixtral (its experts one
module) and Switch Transformers (an expert module per expert, called only when a token reaches
it), ALBERT (one set of layers called once per depth: call_index 0, 1, 2), a language model
whose embedding is also its output projection and whose block runs twice, a recurrent cell
applied until a data-dependent halt, `generate` (a root forward per new token, with a cache),
and an L-BFGS step (several root forwards and backwards in one optimizer step). Each runs three
steps (every forward sampled, then every second one), compared both ways against plain hooks
on a deep copy (`hook_reference.run_both`); result.json counts, per layer, the sampled forwards
plain hooks saw it run in; and each test also checks that the variation it names happened.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import polars as pl
import pytest
import torch
from torch import nn

from hook_reference import Conformance, run_both

pytestmark = pytest.mark.usefixtures("one_thread")

Step = Callable[[nn.Module, int], Any]
EXPERTS = 4


def squares(inputs: Callable[[], torch.Tensor]) -> Step:
    """Forward on fresh inputs, backward of the sum of squares."""

    def step(m: nn.Module, i: int) -> torch.Tensor:
        out = m(inputs())
        out.square().sum().backward()
        return out.detach()

    return step


class RoutedExperts(nn.Module):
    """Top-1 routing of tokens to `EXPERTS` expert MLPs, as mixture-of-experts code writes it:
    an expert no token reaches is called on an empty batch, or (`skip_idle`) not called."""

    def __init__(self, skip_idle: bool) -> None:
        super().__init__()
        self.skip_idle = skip_idle
        self.gate = nn.Linear(8, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(EXPERTS)
        )
        with torch.no_grad():  # expert 0 takes most tokens, expert 3 almost none
            self.gate.bias.copy_(torch.tensor([3.0, 0.0, 0.0, -9.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, chosen = self.gate(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            tokens = (chosen == index).nonzero(as_tuple=True)[0]
            if self.skip_idle and tokens.numel() == 0:
                continue
            out = out.index_add(0, tokens, expert(x[tokens]) * weight[tokens, None])
        return out


def routed(skip_idle: bool) -> tuple[nn.Module, Step]:
    return RoutedExperts(skip_idle), squares(lambda: torch.randn(5, 8))


def hugging_face(model: str, config: str, **settings: Any) -> tuple[nn.Module, Step]:
    """A Hugging Face model from a small config, in train mode, and a step of its own loss on
    random tokens (labels = inputs)."""
    transformers = pytest.importorskip("transformers")
    built = getattr(transformers, model)(getattr(transformers, config)(**settings)).train()

    def step(m: nn.Module, i: int) -> torch.Tensor:
        ids = torch.randint(0, 64, (2, 8))
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach()

    return built, step


DECODER = {
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 16,
}


def mixtral() -> tuple[nn.Module, Step]:
    """Eight experts, one per token: its auxiliary load-balancing loss in the step's loss."""
    settings = {"num_local_experts": 8, "num_experts_per_tok": 1, "output_router_logits": True}
    return hugging_face("MixtralForCausalLM", "MixtralConfig", **DECODER, **settings)


def switch_transformers() -> tuple[nn.Module, Step]:
    """Top-1 routing to eight experts with room for two tokens each: tokens over capacity
    dropped, and an expert module called only when a token reaches it."""
    return hugging_face(
        "SwitchTransformersForConditionalGeneration",
        "SwitchTransformersConfig",
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_sparse_encoder_layers=1,
        num_decoder_layers=2,
        num_sparse_decoder_layers=1,
        num_heads=2,
        num_experts=8,
        expert_capacity=2,
        decoder_start_token_id=0,
    )


def albert() -> tuple[nn.Module, Step]:
    """Three hidden layers sharing one layer's modules."""
    return hugging_face(
        "AlbertForMaskedLM",
        "AlbertConfig",
        vocab_size=64,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )


class TiedLanguageModel(nn.Module):
    """The embedding's weight is the output projection; `proj` and `norm` run twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.tanh(self.proj(self.embed(ids))))
        hidden = self.norm(self.proj(hidden))
        return hidden @ self.embed.weight.T


def tied() -> tuple[nn.Module, Step]:
    return TiedLanguageModel(), squares(lambda: torch.randint(0, 30, (2, 6)))


class AdaptiveSteps(nn.Module):
    """A GRU cell applied until its accumulated halting probability passes a random threshold
    (adaptive computation time): one to six calls, as the data decide."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.cell = nn.GRUCell(8, 8)
        self.halt = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        hidden = torch.zeros_like(x)
        halted = torch.zeros(())
        for _ in range(6):
            hidden = self.cell(x, hidden)
            halted = halted + torch.sigmoid(self.halt(hidden)).mean()
            if halted.item() > 0.5 + 1.5 * torch.rand(()).item():
                break
        return hidden


def adaptive() -> tuple[nn.Module, Step]:
    return AdaptiveSteps(), squares(lambda: torch.randn(3, 4))


def generate() -> tuple[nn.Module, Step]:
    """Greedy decoding of three tokens by a small Llama in eval mode, with its KV cache."""
    model, _ = hugging_face("LlamaForCausalLM", "LlamaConfig", **DECODER)

    def step(m: nn.Module, i: int) -> torch.Tensor:
        prompt = torch.randint(3, 64, (2, 4))
        generated = cast(Any, m).generate  # a method of Hugging Face models, not of nn.Module
        return generated(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)

    return model.eval(), step


def lbfgs() -> tuple[nn.Module, Step]:
    """torch.optim.LBFGS: its closure runs a forward and a backward per evaluation."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizers: dict[int, torch.optim.LBFGS] = {}  # one per model: the observed and the copy

    def step(m: nn.Module, i: int) -> torch.Tensor:
        optimizer = optimizers.setdefault(
            id(m), torch.optim.LBFGS(m.parameters(), max_iter=3, history_size=2)
        )
        x, y = torch.randn(6, 4), torch.randn(6, 1)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = (m(x) - y).square().mean()
            loss.backward()
            return loss

        return optimizer.step(closure).detach()

    return model, step


def runs_per_sample(result: Conformance, layer: str) -> list[int]:
    """How many calls of `layer` each sample's output rows hold (0 where it never ran)."""
    rows = result.history.filter(pl.col("signal") == "output", pl.col("metric") == "mean")
    samples = sorted(rows["sample_id"].unique().to_list())
    calls = rows.filter(pl.col("layer") == layer).group_by("sample_id").agg(pl.len())
    counted = dict(zip(calls["sample_id"].to_list(), calls["len"].to_list(), strict=True))
    return [counted.get(sample, 0) for sample in samples]


def expert_rows(result: Conformance) -> pl.DataFrame:
    """The output rows (metric mean) of the routed experts' last Linear."""
    return result.history.filter(
        pl.col("layer").str.contains(r"^experts\.\d\.2$"),
        pl.col("signal") == "output",
        pl.col("metric") == "mean",
    )


def idle_expert_had_an_empty_batch(result: Conformance) -> None:
    empty = expert_rows(result).filter(pl.col("shape").list.first() == 0)
    assert empty.height, "no expert was called on an empty batch"
    assert empty["unavailable_reason"].to_list()[0] == "empty tensor"


def idle_expert_was_skipped(result: Conformance) -> None:
    ran = expert_rows(result).group_by("sample_id").agg(pl.len())["len"].to_list()
    assert min(ran) < EXPERTS, "every expert ran in every sample"


def switch_experts_vary(result: Conformance) -> None:
    experts = result.history.filter(pl.col("layer").str.contains(r"experts\.expert_\d+\.wo$"))
    per_sample = experts.group_by("sample_id").agg(pl.col("layer").n_unique())["layer"]
    assert max(per_sample.to_list()) < 16, "all 8 experts of both sparse layers ran"


def albert_layers_run_three_times(result: Conformance) -> None:
    ffn = "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn"
    assert set(runs_per_sample(result, ffn)) == {3}
    attention = "albert.encoder.albert_layer_groups.0.albert_layers.0.attention"
    assert attention in result.catalog  # it passes its attention_dropout's rate to a kernel
    assert f"{attention}.attention_dropout" not in result.catalog


def tied_block_runs_twice(result: Conformance) -> None:
    assert set(runs_per_sample(result, "proj")) == {2}
    assert set(runs_per_sample(result, "norm")) == {2}


def cell_runs_vary(result: Conformance) -> None:
    assert len(set(runs_per_sample(result, "cell"))) > 1, "the same number of cell calls"


def one_root_forward_per_token(result: Conformance) -> None:
    assert max(result.history["forward_index"].to_list()) == 3 * 3 - 1  # 3 steps of 3 tokens
    assert not result.history["grad_enabled"].any()  # generate runs under no_grad


def several_forwards_per_step(result: Conformance) -> None:
    assert max(result.history["forward_index"].to_list()) > 3  # more root forwards than steps
    assert "output_gradient" in result.history["signal"].to_list()


def sampled_forwards_counted(result: Conformance, run_dir: Path) -> None:
    """result.json's `sampled_forwards` of each layer is the number of sampled forwards in which
    plain hooks saw it return (every layer here returns tensors)."""
    ran: dict[str, set[int]] = {}
    for sample_id, layer, _, signal, _ in result.recorder.tensors:
        if signal == "output":
            ran.setdefault(layer, set()).add(sample_id)
    catalog = json.loads((run_dir / "result.json").read_text("utf-8"))
    counted = {entry["layer"]: entry["sampled_forwards"] for entry in catalog}
    assert counted == {layer: len(ran.get(layer, ())) for layer in counted}


CASES: dict[str, tuple[Callable[[], tuple[nn.Module, Step]], Callable[[Conformance], None]]] = {
    "experts_called_on_empty_batches": (lambda: routed(False), idle_expert_had_an_empty_batch),
    "idle_experts_skipped": (lambda: routed(True), idle_expert_was_skipped),
    "mixtral": (mixtral, lambda result: None),
    "switch_transformers": (switch_transformers, switch_experts_vary),
    "albert_shared_layers": (albert, albert_layers_run_three_times),
    "tied_embedding_and_block_called_twice": (tied, tied_block_runs_twice),
    "data_dependent_recurrence": (adaptive, cell_runs_vary),
    "generate": (generate, one_root_forward_per_token),
    "lbfgs_closure": (lbfgs, several_forwards_per_step),
}


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_rows_equal_plain_hooks_when_calls_vary(run_dir: Path, name: str, every: int) -> None:
    build, happened = CASES[name]
    model, step = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers that never ran in a sample are warned about
        result = run_both(model, step, run_dir, steps=3, every=every)
    for observed, reference in zip(result.observed_outputs, result.reference_outputs, strict=True):
        assert torch.equal(observed, reference)  # the observed model computed what the copy did
    result.assert_conforms()
    sampled_forwards_counted(result, run_dir)
    if every == 1:
        happened(result)
