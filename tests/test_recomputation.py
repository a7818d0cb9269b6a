"""Checkpointing's recomputation during a backward pass is no root forward and no call.

`checkpoint(model, x)` calls the model once in the forward and, during the backward, once more
to recompute what it did not keep (non-reentrant checkpointing stops that call as soon as it has
what the backward needs, with an exception of its own). That second call is torch's, not the
user's: it is not counted, not sampled and not observed, so a step has one root forward and one
sample, whose rows equal those of the same model run without checkpointing (plain hooks on a
deep copy, `hook_reference`). Under reentrant checkpointing the model's forward runs under
no_grad and its gradients flow only through the recomputation: the sample has output rows and
no gradient rows. Either way one warning says what such calls are and what they mean for
gradients, and index.md says it with their count.

The same holds for a checkpointed block recomputed inside a sampled forward, by a forward that
runs `torch.autograd.grad` itself (a physics-informed network's derivative, a potential's
forces): the recomputed calls are no calls of the layers, so the rows are those of the model
without checkpointing, each layer's call measured once.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver

from conftest import read_history
from hook_reference import run_both

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2


def model() -> nn.Sequential:
    """Five layers, none random: the checkpointed and the plain runs compute the same values."""
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))


def checkpointed_step(reentrant: bool) -> Any:
    """A step that checkpoints the whole model, as a training loop would write it."""

    def step(m: nn.Module, i: int) -> torch.Tensor:
        x = torch.randn(4, 6, requires_grad=True)
        out = checkpoint(m, x, use_reentrant=reentrant)
        out.square().sum().backward()
        return out

    return step


def plain_step(m: nn.Module, i: int) -> torch.Tensor:
    """The same step without checkpointing: the reference."""
    x = torch.randn(4, 6, requires_grad=True)
    out = m(x)
    out.square().sum().backward()
    return out


def counts_line(run_dir: Path) -> str:
    """index.md's line of counts: root forwards, samples, samples with output gradients."""
    found = re.search(r"- counts: (.*)", (run_dir / "index.md").read_text("utf-8"))
    assert found is not None, "index.md has no counts line"
    return found.group(1)


def recomputation_said(said: pytest.WarningsRecorder) -> int:
    """How many warnings said that the model was called during a backward pass."""
    return len([w for w in said if "called during a backward pass" in str(w.message)])


def test_a_model_checkpointed_whole_has_the_rows_of_the_plain_model(run_dir: Path) -> None:
    with pytest.warns(RuntimeWarning, match="called during a backward pass") as said:
        result = run_both(
            model(), checkpointed_step(False), run_dir, reference_step=plain_step, steps=STEPS
        )
    assert recomputation_said(said) == 1  # once per run, however many steps
    result.assert_conforms()
    assert sorted(set(result.history["forward_index"].to_list())) == list(range(STEPS))
    assert "interrupted" not in result.history["metric"].to_list()
    assert counts_line(run_dir).startswith(f"{STEPS} root forwards, {STEPS} samples, {STEPS} ")
    index = (run_dir / "index.md").read_text("utf-8")
    assert f"called during a backward pass {STEPS} times" in index


def test_a_model_checkpointed_whole_reentrantly_has_output_rows_and_says_why_no_gradients(
    run_dir: Path,
) -> None:
    with pytest.warns(RuntimeWarning, match="called during a backward pass") as said:
        result = run_both(
            model(), checkpointed_step(True), run_dir, reference_step=plain_step, steps=STEPS
        )
    assert recomputation_said(said) == 1
    gradients = {key: "reentrant" for key in result.recorder.tensors if key[3] != "output"}
    result.assert_conforms(unrecorded=gradients)
    assert set(result.history["signal"].to_list()) == {"output"}
    # Grad was disabled by torch's checkpointing, not by the loop: training rows, not eval's.
    assert set(result.history["mode"].to_list()) == {"train"}
    assert set(result.history["grad_enabled"].to_list()) == {False}
    assert counts_line(run_dir).startswith(f"{STEPS} root forwards, {STEPS} samples, 0 ")
    index = (run_dir / "index.md").read_text("utf-8")
    assert f"called during a backward pass {STEPS} times" in index


class Derivative(nn.Module):
    """Returns u(x) and du/dx, computed inside its forward with `torch.autograd.grad`; the
    network is checkpointed (non-reentrant) or not."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.requires_grad_(True)
        net = partial(checkpoint, self.net, use_reentrant=False) if self.checkpointed else self.net
        hidden = net(x)
        u = self.head(hidden)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return u, du


def derivative_step(m: nn.Module, i: int) -> torch.Tensor:
    u, du = m(torch.randn(5, 2))
    (u.square().sum() + du.square().sum()).backward()
    return u


def unchecked(m: nn.Module, i: int) -> torch.Tensor:
    """The reference: the same step with the copy's checkpointing switched off."""
    m.checkpointed = False  # type: ignore[assignment]
    return derivative_step(m, i)


def test_a_block_recomputed_inside_a_sampled_forward_is_no_call(run_dir: Path) -> None:
    result = run_both(
        Derivative(checkpointed=True), derivative_step, run_dir, reference_step=unchecked, steps=2
    )
    result.assert_conforms()
    assert set(result.history["call_index"].to_list()) == {0}


class CheckpointingStep(lightning.LightningModule):
    """A training step that checkpoints the observed part reentrantly, `checkpoint(self.net, x)`;
    every call of `net` records whether grad was enabled (the test's own record)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()
        self.calls: list[bool] = []
        self.net.register_forward_pre_hook(lambda *_: self.calls.append(torch.is_grad_enabled()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return checkpoint(self.net, x.requires_grad_(True), use_reentrant=True).square().sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_training_step_that_checkpoints_reentrantly_is_sampled_as_training(
    tmp_path: Path,
) -> None:
    """Reentrant checkpointing runs the module under no_grad, as generate() would, but a backward
    follows through its recomputation: its forwards are the training forwards, never evaluation
    forwards nor a step that "never called the observed module"."""
    module = CheckpointingStep()
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            LightningObserver(tmp_path / "run", module="net", sampler=EveryNForwardsSampler(1))
        ],
    )
    with pytest.warns(RuntimeWarning, match="called during a backward pass"):
        trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 6)), batch_size=4))
    assert module.calls == [False, True] * STEPS  # the forward, then torch's recomputation
    history = read_history(tmp_path / "run")
    per_sample = history.group_by("sample_id", "step", "mode", "grad_enabled", "signal").len()
    assert sorted(per_sample.drop("len").rows()) == [
        (i, i, "train", False, "output") for i in range(STEPS)
    ]
    index = (tmp_path / "run" / "index.md").read_text("utf-8")
    assert (
        counts_line(tmp_path / "run")
        == f"{STEPS} root forwards, {STEPS} samples, 0 samples with output gradients"
    )
    assert "never called the observed" not in index
