"""torch.func transforms in the conformance zoo: every row against plain hooks on a deep copy.

The reference is the plain model run without the transform, on the same values. `grad`: a plain
forward and `backward()` of the same loss. Forward mode (`jvp`, `jacfwd`): the plain forward;
`hessian` (jacfwd of jacrev): a plain forward and backward. `vmap` of a per-sample `grad`: the
plain model on the whole batch with the sum of the per-sample losses (each layer's output and the
gradient into it are then the underlying batch, as the model without vmap sees it). `jacrev` of
the scalar loss: a plain backward (its cotangent batch has one entry). Shapes are not compared
there (the library says in shape and index.md which it records). The other cases, and what the
reference is, are test_conformance_zoo.py's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _zoo import (
    Step,
    device_fixture,  # noqa: F401 (a fixture)
    tolerance_for,
)
from hook_reference import leaves, run_both

# One torch thread: the same reduction order on both sides, and tiny models run faster on one
# thread than on two contended ones. On a machine of two or more cores that leaves a core spare,
# so the CPU cases' tensors of 2**16 to 2**22 entries are measured by spare_core's worker
# (test_spare_core.py holds its rows to the training thread's, bit for bit).
pytestmark = pytest.mark.usefixtures("one_thread")


def func_model(device: torch.device) -> nn.Module:
    """Per-sample independent (no batch statistics), so vmap over samples is the batch."""
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)


def plain_backward(device: torch.device) -> Step:
    """The reference of the torch.func steps: the summed loss, one ordinary backward."""

    def step(m: nn.Module, i: int) -> Any:
        m(torch.randn(5, 6, device=device)).square().sum().backward()
        return {name: p.grad for name, p in m.named_parameters()}

    return step


def functional_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().sum()

    return loss


def func_grad_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        return torch.func.grad(functional_loss(m))(params, torch.randn(5, 6, device=device))

    return step


def func_vmap_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        per_sample = torch.func.vmap(torch.func.grad(functional_loss(m)), in_dims=(None, 0))
        grads = per_sample(params, torch.randn(5, 6, device=device))
        return {name: g.sum(0) for name, g in grads.items()}

    return step


def func_jacrev_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        params = {name: p.detach() for name, p in m.named_parameters()}
        return torch.func.jacrev(functional_loss(m))(params, torch.randn(5, 6, device=device))

    return step


@pytest.mark.parametrize(
    "transform", [func_grad_step, func_vmap_step, func_jacrev_step], ids=["grad", "vmap", "jacrev"]
)
def test_torch_func(
    run_dir: Path, device: torch.device, transform: Callable[[torch.device], Step]
) -> None:
    model = func_model(device)
    result = run_both(model, transform(device), run_dir, reference_step=plain_backward(device))
    # the transform's parameter gradients equal the plain backward's
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value)
    result.assert_conforms(tolerance=tolerance_for(device), compare_shapes=False)


def scalar_of(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().sum()

    return loss


def func_jvp_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        x = torch.randn(5, 6, device=device)
        return torch.func.jvp(scalar_of(m), (x,), (torch.ones_like(x),))

    return step


def func_jacfwd_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        return torch.func.jacfwd(scalar_of(m))(torch.randn(5, 6, device=device))

    return step


def func_hessian_step(device: torch.device) -> Step:
    def step(m: nn.Module, i: int) -> Any:
        return torch.func.hessian(scalar_of(m))(torch.randn(5, 6, device=device)[:1])

    return step


def plain_forward(device: torch.device, batch: int = 5, backward: bool = False) -> Step:
    """The reference of a forward-mode transform: the plain forward (and, where the transform
    runs a reverse pass inside, as `hessian`'s jacrev does, a plain backward of the loss)."""

    def step(m: nn.Module, i: int) -> Any:
        out = m(torch.randn(5, 6, device=device)[:batch])
        if backward:
            out.square().sum().backward()
        return out

    return step


FORWARD_MODE = {
    "jvp": (func_jvp_step, plain_forward),
    "jacfwd": (func_jacfwd_step, plain_forward),
    "hessian": (func_hessian_step, lambda device: plain_forward(device, 1, backward=True)),
}


@pytest.mark.parametrize("transform", list(FORWARD_MODE))
def test_torch_func_forward_mode(run_dir: Path, device: torch.device, transform: str) -> None:
    """Forward-mode transforms: the rows hold the plain model's values (no gradient flows back
    into an output under jvp or jacfwd; hessian's jacrev brings the plain backward's)."""
    model = func_model(device)
    unobserved = copy.deepcopy(model)
    step, reference = FORWARD_MODE[transform]
    result = run_both(model, step(device), run_dir, reference_step=reference(device))
    torch.manual_seed(1000)
    expected = list(leaves(step(device)(unobserved, 0)))
    for got, want in zip(leaves(result.observed_outputs[0]), expected, strict=True):
        assert torch.equal(got, want)  # the transform computed what it computes unobserved
    result.assert_conforms(tolerance=tolerance_for(device), compare_shapes=False)


def compiled_transform_step(transform: Step, backend: str) -> Step:
    """`transform`'s step inside a function compiled with `backend`: dynamo inlines the
    transform, meets the observed model's root wrapper inside it where it may not break the
    graph, and so runs the transform eagerly; the frames it enters there are compiled by the
    "eager" backend alone, under the transform (the others run them as Python)."""
    compiled = torch.compile(transform, backend=backend)

    def step(m: nn.Module, i: int) -> Any:
        return compiled(m, i)

    return step


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_func_inside_a_step_compiled_with_the_eager_backend(run_dir: Path) -> None:
    """A step compiled with backend="eager" calling `vmap` of `grad` over the observed model:
    each step returns the plain backward's gradients, sampled (forward 0, 2) or not (1, where
    the model's forward is compiled under the transforms), and the rows equal plain hooks. The
    step raised an AssertionError: the root wrapper's graph break in a frame compiled under the
    transforms, and a frame compiled from the library's gradient hook there, made dynamo fake
    the transforms' wrapped tensors. (Other backends run those frames as Python.) Dynamo runs
    the transforms as Python to break the graph at the root wrapper: warned and said."""
    device = torch.device("cpu")
    model = func_model(device)
    step = compiled_transform_step(func_vmap_step(device), "eager")
    backward = plain_backward(device)

    def reference(m: nn.Module, i: int) -> Any:
        m.zero_grad(set_to_none=True)  # each step's gradients, not their running sum
        return backward(m, i)

    with pytest.warns(RuntimeWarning, match="around the model in the transform ran as Python"):
        result = run_both(model, step, run_dir, reference_step=reference, steps=3, every=2)
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value)
    result.assert_conforms(compare_shapes=False)
    assert result.history["forward_index"].unique().sort().to_list() == [0, 2]
    index = " ".join((run_dir / "index.md").read_text("utf-8").split())
    assert "dynamo broke the graph at the transform's call and ran the whole transform so" in index
