"""The smoke subset: inject, sampled train steps, a compiled model, remove, against plain hooks.

Part of the suite, and also what `.ci/floor` runs on the oldest torch pyproject allows, in an
environment of its own, together with the SIGKILL-then-finalize test of test_crash_recovery.py:
it needs only torch, polars, numpy, pytest and the library.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from conftest import mlp
from hook_reference import run_both

LAYERS = [str(index) for index in range(6)]  # mlp(): three Linear + ReLU blocks


class TrainStep:
    """One SGD step on a batch seeded by its index, with an optimizer per model it is given."""

    def __init__(self) -> None:
        self.optimizers: dict[int, torch.optim.Optimizer] = {}

    def __call__(self, model: nn.Module, index: int) -> torch.Tensor:
        optimizer = self.optimizers.get(id(model))
        if optimizer is None:
            optimizer = self.optimizers[id(model)] = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(torch.randn(4, 8))
        out.square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return out.detach()


def test_sampled_train_steps_match_plain_hooks(run_dir: Path) -> None:
    model = mlp()
    both = run_both(model, TrainStep(), run_dir, steps=4, every=2, names=LAYERS)
    both.assert_conforms()
    assert sorted(both.history["forward_index"].unique().to_list()) == [0, 2]
    for observed, reference in zip(both.observed_outputs, both.reference_outputs, strict=True):
        assert torch.equal(observed, reference)
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_a_compiled_model_records_what_hooks_see(run_dir: Path) -> None:
    model = mlp()
    both = run_both(
        model,
        TrainStep(),
        run_dir,
        steps=4,
        every=2,
        names=LAYERS,
        prepare=lambda plain: torch.compile(plain, backend="eager"),
    )
    both.assert_conforms()
    assert sorted(both.history["forward_index"].unique().to_list()) == [0, 2]
    index = (run_dir / "index.md").read_text("utf-8")
    assert "not recorded: forwards run under torch.compile" not in index
