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

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

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
