"""A plain training loop (no trainer callback) that calls `generate()` between its steps, with
the model left in train mode (as `generate()` leaves it): each token is a root forward under
no_grad, an evaluation forward. Its rows have mode eval, whatever the modules' training flags,
so a token never joins a training series; it expects no gradient, and no warning says that one
is missing. In a plain loop every root forward is on the sampler's one schedule (forward_index),
as index.md says.

The reference is a forward pre-hook of the test's own on the model, recording at each root call
whether grad was enabled and the model's training flag."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import polars as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import cli_in_process, read_history, strict_json

TOKENS = 3
STEPS = 3


def run(directory: Path) -> tuple[list[tuple[bool, bool]], list[str]]:
    """STEPS training steps, each followed by a generation of TOKENS tokens, every root forward
    sampled; returns each root call's (grad enabled, model.training) and the warnings."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=32)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(2, 20, (2, 6))
    calls: list[tuple[bool, bool]] = []

    def record(module: nn.Module, args: Any, kwargs: Any) -> None:
        calls.append((torch.is_grad_enabled(), module.training))

    model.register_forward_pre_hook(record, with_kwargs=True)
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prompt = ids[:, :3]
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=TOKENS,
                min_new_tokens=TOKENS,
                pad_token_id=0,
            )
        remove_observer(model)
    said = [str(w.message) for w in seen if "torchinstruments" in str(w.message)]
    return calls, said


def test_generated_tokens_are_evaluation_samples_of_their_own_series(tmp_path: Path) -> None:
    calls, said = run(tmp_path / "run")
    assert calls == ([(True, True)] + [(False, True)] * TOKENS) * STEPS  # train mode throughout
    history = read_history(tmp_path / "run")
    per_sample = (
        history.group_by("sample_id", maintain_order=True)
        .agg(
            pl.col("forward_index").first(),
            pl.col("mode").unique(),
            pl.col("grad_enabled").unique(),
            pl.col("signal").unique().sort(),
        )
        .sort("sample_id")
    )
    # One schedule in a plain loop: every root forward sampled, forward_index in call order.
    assert per_sample["forward_index"].to_list() == list(range(len(calls)))
    for row, (grad, _) in zip(per_sample.iter_rows(named=True), calls, strict=True):
        if grad:
            assert (row["mode"], row["grad_enabled"]) == (["train"], [True])
            assert row["signal"] == ["output", "output_gradient"]
        else:  # a generated token: an evaluation forward, though the model is in train mode
            assert (row["mode"], row["grad_enabled"]) == (["eval"], [False])
            assert row["signal"] == ["output"]
    layers = strict_json(tmp_path / "run" / "result.json")
    [head] = [layer for layer in layers if layer["layer"] == "lm_head"]
    by_mode = {(t["mode"], t["signal"]): t["observations"] for t in head["tensors"]}
    assert by_mode == {
        ("train", "output"): STEPS,
        ("train", "output_gradient"): STEPS,
        ("eval", "output"): STEPS * TOKENS,
    }
    assert not [text for text in said if "gradient" in text], said
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "a root forward called with grad disabled" in index
    # Where a reader meets `eval`, it never says module.training was False alone: here it was
    # True, and the forward's no_grad made its rows eval.
    shown = " ".join(cli_in_process("show", tmp_path / "run", "--metrics", "mean").stdout.split())
    assert "[eval]: the tensor's samples taken in eval mode (module.training False, a root " in (
        shown
    )
    assert "forward called under no_grad or inference_mode, or a trainer's evaluation)" in shown
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = cast(dict[str, list[str]], events.Tags())["histograms"]
    tag = next(t for t in tags if t.startswith("eval/"))
    described = events.SummaryMetadata(tag).summary_description
    assert "module.training False, in a root forward called under no_grad" in described
