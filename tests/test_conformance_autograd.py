"""The autograd patterns training loops run: every row equals plain hooks on a deep copy.

Each case is a small model and a step that drives autograd the way real loops do: activation
checkpointing (reentrant and not, `checkpoint_sequential`, selective checkpointing, the
distributed `checkpoint_wrapper`, Hugging Face's own), several backwards per optimizer step,
`retain_graph=True` with two backwards of one graph, `create_graph=True` (a gradient penalty,
and a backward of the parameters' gradients), `torch.autograd.grad` instead of `.backward()`
(over the parameters, over one weight only before a full backward, with `inputs=`), a
non-scalar backward with its gradient, several forwards before one backward, no_grad and
inference_mode forwards between a forward and its backward, an evaluation forward whose output
is never backpropagated, activations offloaded by `save_on_cpu`, and in-place ops, views and
aliases after layers. Compared both ways as the zoo compares (`hook_reference`): every
reference tensor has a row, every row has a reference tensor, and every value equals NumPy's.
What plain hooks see is the definition: the first backward that reaches an output brings its
gradient; a recomputation during a backward is no call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from hook_reference import run_both

pytestmark = pytest.mark.usefixtures("one_thread")

Step = Callable[[nn.Module, int], Any]


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))


def squares(m: nn.Module, i: int) -> torch.Tensor:
    """Forward on fresh inputs, backward of the sum of squares."""
    out = m(torch.randn(4, 6))
    out.square().sum().backward()
    return out


# --- checkpointing ------------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """A block between two layers, under `checkpoint` or `checkpoint_sequential` (two segments;
    the last runs plainly), reentrant or not."""

    def __init__(self, reentrant: bool, sequential: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU())
        self.out = nn.Linear(8, 3)
        self.reentrant, self.sequential = reentrant, sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.sequential:
            x = checkpoint_sequential(self.block, 2, x, use_reentrant=self.reentrant)
        else:
            x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.out(x)


class Selective(nn.Module):
    """Selective activation checkpointing: matrix products saved, the rest recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op == torch.ops.aten.mm.default:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        contexts = functools.partial(create_selective_checkpoint_contexts, policy)
        x = checkpoint(self.block, self.inp(x), use_reentrant=False, context_fn=contexts)
        return self.out(x)


def wrapped_blocks(kind: str) -> nn.Module:
    """torch.distributed's `checkpoint_wrapper` around two blocks (`apply_activation_checkpointing`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = nn.Sequential(
        nn.Linear(6, 8),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        nn.Sequential(nn.Linear(8, 8), nn.GELU()),
        nn.Linear(8, 3),
    )
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=getattr(CheckpointImpl, kind))
    blocks = (model[1], model[2])
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: any(m is b for b in blocks)
    )
    return model


def input_requires_grad(m: nn.Module, i: int) -> torch.Tensor:
    """An input that requires grad (reentrant checkpointing's gradients flow through it)."""
    out = m(torch.randn(4, 6, requires_grad=True))
    out.square().sum().backward()
    return out


def gpt2_checkpointed(reentrant: bool) -> tuple[nn.Module, Step]:
    """A tiny GPT-2 from a config under Hugging Face's own gradient checkpointing."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config).train()
    enable = getattr(model, "activation_checkpointing_enable", None)
    enable = enable or getattr(model, "gradient_checkpointing_enable")  # noqa: B009
    enable({"use_reentrant": reentrant})

    def step(m: nn.Module, i: int) -> torch.Tensor:
        ids = torch.randint(0, 64, (2, 8))
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits

    return model, step


# --- backward patterns ---------------------------------------------------------------------------


def accumulation(m: nn.Module, i: int) -> torch.Tensor:
    """Two backwards per optimizer step (a plain SGD update every second step)."""
    out = m(torch.randn(4, 6))
    (out.square().sum() / 2).backward()
    if i % 2 == 1:
        with torch.no_grad():
            for p in m.parameters():
                assert p.grad is not None
                p -= 0.1 * p.grad
                p.grad = None
    return out


def retained(m: nn.Module, i: int) -> torch.Tensor:
    """Two backwards of one graph: the first brings the rows' gradients."""
    out = m(torch.randn(4, 6))
    out.square().sum().backward(retain_graph=True)
    (out * 3).sum().backward()
    return out


def gradient_penalty(m: nn.Module, i: int) -> torch.Tensor:
    """`autograd.grad(..., create_graph=True)` of the input, then a backward through both."""
    x = torch.randn(4, 6, requires_grad=True)
    out = m(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.square().sum() + grad.square().sum()).backward()
    return out


def double_backward(m: nn.Module, i: int) -> torch.Tensor:
    """`backward(create_graph=True)`, then a backward of the parameters' gradients' norm."""
    out = m(torch.randn(4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on the grad/parameter reference cycle
        out.square().sum().backward(create_graph=True)
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    penalty = torch.stack([g.square().sum() for g in grads]).sum()
    penalty.backward()
    for p in m.parameters():
        p.grad = None
    return out


def grad_of_parameters(m: nn.Module, i: int) -> torch.Tensor:
    out = m(torch.randn(4, 6))
    torch.autograd.grad(out.square().sum(), list(m.parameters()))
    return out


def third_weight(m: nn.Module) -> torch.Tensor:
    """The weight of `mlp()`'s second Linear (its module "2")."""
    return m.get_parameter("2.weight")


def grad_of_one_weight_then_backward(m: nn.Module, i: int) -> torch.Tensor:
    """A pass that reaches only the layers from module "2" on, then a full one."""
    out = m(torch.randn(4, 6))
    loss = out.square().sum()
    torch.autograd.grad(loss, [third_weight(m)], retain_graph=True)
    (loss * 2).backward()
    return out


def backward_with_inputs(m: nn.Module, i: int) -> torch.Tensor:
    out = m(torch.randn(4, 6))
    out.square().sum().backward(inputs=[third_weight(m)])
    return out


def non_scalar(m: nn.Module, i: int) -> torch.Tensor:
    out = m(torch.randn(4, 6))
    out.backward(torch.randn_like(out))
    return out


def four_forwards_one_backward(m: nn.Module, i: int) -> torch.Tensor:
    outs = [m(torch.randn(4, 6)) for _ in range(4)]
    torch.stack([o.square().sum() * (k + 1) for k, o in enumerate(outs)]).sum().backward()
    return outs[0]


def evaluation_between(context: Callable[[], Any]) -> Step:
    """An evaluation forward (eval mode, under `context`) between a forward and its backward."""

    def step(m: nn.Module, i: int) -> torch.Tensor:
        out = m(torch.randn(4, 6))
        m.eval()
        with context():
            m(torch.randn(4, 6))
        m.train()
        out.square().sum().backward()
        return out

    return step


def evaluation_never_backpropagated(m: nn.Module, i: int) -> torch.Tensor:
    """An evaluation forward with grad enabled whose output no backward reaches, then a step."""
    m.eval()
    m(torch.randn(4, 6))
    m.train()
    return squares(m, i)


def offloaded(m: nn.Module, i: int) -> torch.Tensor:
    """Activations saved for backward offloaded to the host (`save_on_cpu`)."""
    with torch.autograd.graph.save_on_cpu():
        out = m(torch.randn(4, 6))
    out.square().sum().backward()
    return out


# --- in-place ops, views, aliases ---------------------------------------------------------------


class InPlaceAfter(nn.Module):
    """In-place ops on a layer's output in the parent's forward, and an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h += 1.0
        h.mul_(2)
        h[:, :2] = 0
        h = self.act(h) + 0.5
        h.add_(0.5)
        return self.b(h)


class Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


class Columns(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :4]


class Views(nn.Module):
    """Layers returning views of another layer's output; an in-place ReLU through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.t, self.columns = nn.Linear(6, 8), Transpose(), Columns()
        self.act, self.flat, self.b = nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        v = self.act(self.t(h))  # changes `h` in place, through the view
        picked = self.columns(self.flat(v.transpose(0, 1)))
        return self.b(picked) + h.sum(-1, keepdim=True)


class PassThrough(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Aliases(nn.Module):
    """Layers that return the very tensor they got (Identity, Dropout in eval, Flatten of a
    flat tensor, a pass-through called twice), and a layer's output used by two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.identity, self.drop = nn.Linear(6, 8), nn.Identity(), nn.Dropout(0.5)
        self.flat, self.same = nn.Flatten(), PassThrough()
        self.b, self.c = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        aliased = self.same(self.same(self.flat(self.drop(self.identity(h)))))
        return self.b(aliased) + self.c(h)


CASES: dict[str, Callable[[], tuple[nn.Module, Step]]] = {
    "checkpoint_reentrant": lambda: (Checkpointed(True, False), squares),
    "checkpoint_non_reentrant": lambda: (Checkpointed(False, False), squares),
    "checkpoint_sequential_reentrant": lambda: (Checkpointed(True, True), squares),
    "checkpoint_sequential_non_reentrant": lambda: (Checkpointed(False, True), squares),
    "checkpoint_reentrant_input_requires_grad": lambda: (
        Checkpointed(True, False),
        input_requires_grad,
    ),
    "selective_checkpointing": lambda: (Selective(), squares),
    "checkpoint_wrapper_reentrant": lambda: (wrapped_blocks("REENTRANT"), squares),
    "checkpoint_wrapper_non_reentrant": lambda: (wrapped_blocks("NO_REENTRANT"), squares),
    "gpt2_gradient_checkpointing": lambda: gpt2_checkpointed(False),
    "gpt2_gradient_checkpointing_reentrant": lambda: gpt2_checkpointed(True),
    "accumulation": lambda: (mlp(), accumulation),
    "retain_graph": lambda: (mlp(), retained),
    "gradient_penalty": lambda: (mlp(), gradient_penalty),
    "double_backward": lambda: (mlp(), double_backward),
    "grad_of_parameters": lambda: (mlp(), grad_of_parameters),
    "grad_of_one_weight_then_backward": lambda: (mlp(), grad_of_one_weight_then_backward),
    "backward_with_inputs": lambda: (mlp(), backward_with_inputs),
    "non_scalar_backward": lambda: (mlp(), non_scalar),
    "four_forwards_one_backward": lambda: (mlp(), four_forwards_one_backward),
    "no_grad_between": lambda: (mlp(), evaluation_between(torch.no_grad)),
    "inference_mode_between": lambda: (mlp(), evaluation_between(torch.inference_mode)),
    "evaluation_never_backpropagated": lambda: (mlp(), evaluation_never_backpropagated),
    "save_on_cpu": lambda: (Checkpointed(False, False), offloaded),
    "in_place_after_layers": lambda: (InPlaceAfter(), squares),
    "views": lambda: (Views(), squares),
    "aliases": lambda: (Aliases().eval(), squares),
}
EVERY = {"accumulation": 3, "four_forwards_one_backward": 2}  # samples on some forwards only


@pytest.mark.parametrize("name", list(CASES))
def test_rows_under_autograd_patterns_equal_plain_hooks(run_dir: Path, name: str) -> None:
    model, step = CASES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # checkpointing's own notes, and reentrant gaps said
        result = run_both(model, step, run_dir, steps=4, every=EVERY.get(name, 1))
    result.assert_conforms()
    assert "output_gradient" in result.history["signal"].to_list()
