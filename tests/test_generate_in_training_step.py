"""A training step that generates before it computes its loss (as reinforcement-learning
trainers do): transformers' `generate()` runs one root forward per token under no_grad, which no
backward can follow. Under a trainer callback those are no training forwards: they never take
the training sampler's samples (which, counted with them, landed on the tokens and never on the
forward that trains), and with `record_eval` they are evaluation forwards, rows of mode eval.

The reference is a forward pre-hook of the test's own recording, at each call, whether grad
was enabled and the Trainer's global step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver

from conftest import read_history

TOKENS = 3


class GeneratingTrainer(Trainer):
    """Generates a continuation of each batch's prompt, then trains on the batch."""

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        ids = inputs["input_ids"]
        assert isinstance(model, GPT2LMHeadModel)
        model.generate(
            ids[:, :3],
            attention_mask=torch.ones_like(ids[:, :3]),
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            pad_token_id=0,
        )
        return super().training_step(model, inputs, *args, **kwargs)


def train(tmp_path: Path, callback: HuggingFaceObserver) -> list[tuple[bool, int]]:
    """4 optimizer steps; returns each call's (grad enabled, global step)."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=32)
    model = GPT2LMHeadModel(config)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(2, 20, (8, 6))]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = GeneratingTrainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    calls: list[tuple[bool, int]] = []

    def record(module: nn.Module, args: Any, kwargs: Any) -> None:
        calls.append((torch.is_grad_enabled(), trainer.state.global_step))

    model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train()
    return calls


@pytest.mark.parametrize("record_eval", [False, True])
def test_generate_inside_a_training_step_never_takes_a_training_sample(
    tmp_path: Path, record_eval: bool
) -> None:
    callback = HuggingFaceObserver(
        tmp_path / "run", sampler=EveryNForwardsSampler(1), record_eval=record_eval
    )
    calls = train(tmp_path, callback)
    assert [grad for grad, _ in calls] == ([False] * TOKENS + [True]) * 4
    history = read_history(tmp_path / "run")
    per_sample = (
        history.group_by("sample_id")
        .agg(
            pl.col("mode").unique(),
            pl.col("grad_enabled").unique(),
            pl.col("step").first(),
            pl.col("signal").unique().sort(),
        )
        .sort("sample_id")
    )
    trained = per_sample.filter(pl.col("mode").list.contains("train"))
    assert trained["step"].to_list() == [0, 1, 2, 3]  # each step's loss forward, and only it
    assert all(g.to_list() == [True] for g in trained["grad_enabled"])
    assert all(s.to_list() == ["output", "output_gradient"] for s in trained["signal"])
    evaluation = per_sample.filter(pl.col("mode").list.contains("eval"))
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    if record_eval:  # the tokens: their own series, no gradient rows
        assert evaluation.height == TOKENS * 4
        assert all(g.to_list() == [False] for g in evaluation["grad_enabled"])
        assert all(s.to_list() == ["output"] for s in evaluation["signal"])
    else:
        assert evaluation.height == 0
        assert f"{TOKENS * 4} evaluation forwards inside the fit" in index
        assert "under no_grad inside a training step" in index
