"""Forwards that no backward follows (evaluation, each token of `generate()`) expect no gradient:
index.md's "series that stop" query names only what lost a gradient a backward should have
brought. The reference is the run's own samples read back with Polars: which ones a backward
reached (they have output_gradient rows), and which layer's output the loss never used."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history


def page_queries(directory: Path) -> dict[str, object]:
    """Run index.md's setup block, then its "series that stop" block, as printed."""
    setup, *blocks = re.findall(
        r"```python\n(.*?)```", (directory / "index.md").read_text("utf-8"), re.DOTALL
    )
    (block,) = [code for code in blocks if "no_gradient = " in code]
    namespace: dict[str, object] = {}
    exec(compile(setup, "index.md:setup", "exec"), namespace)
    exec(compile(block, "index.md:stop", "exec"), namespace)
    return namespace


class WithUnused(nn.Module):
    """GPT-2 with a head whose output the loss never uses: its gradient rows never come."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=32)
        self.gpt = GPT2LMHeadModel(config)
        self.unused = nn.Linear(20, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(ids).logits
        self.unused(logits.detach())
        return logits


def test_generate_and_evaluation_forwards_are_not_series_without_gradients(
    tmp_path: Path,
) -> None:
    """A plain loop that trains, then generates tokens (each a root forward under no_grad, the
    model left in train mode as generate() leaves it) and evaluates: the samples without a
    backward are not "tensors with no output_gradient row" nor gradient series that stopped;
    the head the loss never uses still is."""
    torch.manual_seed(0)
    model = WithUnused()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 20, (2, 6))
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    try:
        for _ in range(2):
            logits = model(ids)
            nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():  # generate()'s loop: one root forward per token, KV cache aside
                prompt = ids[:, :3]
                for _ in range(3):
                    token = model(prompt)[:, -1].argmax(-1, keepdim=True)
                    prompt = torch.cat([prompt, token], dim=1)
        model.eval()
        with torch.no_grad():
            model(ids)
    finally:
        remove_observer(model)

    history = read_history(tmp_path / "run")
    backward = set(history.filter(pl.col("signal") == "output_gradient")["sample_id"])
    assert backward == {0, 4}  # the training forwards; 6 tokens and 1 evaluation without one
    # Called under no_grad: evaluation forwards, eval rows though the tokens ran in train mode.
    assert set(history.filter(~pl.col("grad_enabled"))["mode"]) == {"eval"}
    found = page_queries(tmp_path / "run")
    no_gradient, stopped = found["no_gradient"], found["stopped"]
    assert isinstance(no_gradient, pl.DataFrame)
    assert isinstance(stopped, pl.DataFrame)
    assert no_gradient.select("layer", "mode").rows() == [("unused", "train")]
    assert stopped.height == 0


def test_a_real_generate_between_training_steps_leaves_no_series_without_gradients(
    tmp_path: Path,
) -> None:
    """transformers' own `generate()` (KV cache, no_grad) between training steps."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=32)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(2, 20, (2, 6))
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    try:
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            model.generate(
                ids[:, :3], attention_mask=torch.ones(2, 3), max_new_tokens=4, pad_token_id=0
            )
    finally:
        remove_observer(model)
    history = read_history(tmp_path / "run")
    assert history["sample_id"].n_unique() == 2 * (1 + 4)
    found = page_queries(tmp_path / "run")
    no_gradient, stopped = found["no_gradient"], found["stopped"]
    assert isinstance(no_gradient, pl.DataFrame)
    assert isinstance(stopped, pl.DataFrame)
    assert no_gradient.height == 0, no_gradient
    assert stopped.height == 0, stopped
