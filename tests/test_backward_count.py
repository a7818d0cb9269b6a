"""The samples with a backward are counted, not kept: the count is exact, memory stays flat."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.gradients import RECENT_SAMPLES
from torchinstruments.registry import OBSERVERS

from conftest import read_history, strict_json


def test_a_sample_with_two_backwards_counts_once_and_no_id_set_grows(run_dir: Path) -> None:
    model = nn.Linear(3, 2)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    recorder = OBSERVERS[model].gradients
    out = model(torch.randn(4, 3))  # sample 0: two backward passes through it
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    model(torch.randn(4, 3))  # sample 1: no backward
    steps = RECENT_SAMPLES + 50
    for _ in range(steps):  # samples 2.. : one backward each
        model(torch.randn(4, 3)).sum().backward()
    assert recorder.backward_samples == 1 + steps
    assert len(recorder._recent) == RECENT_SAMPLES  # bounded, whatever the run's length
    assert not hasattr(recorder, "sample_ids")
    remove_observer(model)

    history = read_history(run_dir)
    with_gradient = history.filter(history["signal"] == "output_gradient")["sample_id"].n_unique()
    state = strict_json(run_dir / ".state.json")
    assert state["counts"]["backward_samples"] == with_gradient == 1 + steps
