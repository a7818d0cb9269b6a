"""Control flow operators in an eager model: `torch.cond` whose branches call layers, or call
another observed model.

In eager mode `torch.cond` compiles its branches with dynamo (`fullgraph=True`) under any compile
stance but force_eager, so in a sampled forward dynamo meets a layer's forward proxy inside them. There the
layers in the branches run unmeasured (dynamo traces them into the op's graph), and the run says
so; the layers outside it are compared with plain hooks on a deep copy (`hook_reference`). An
observed model called in such a branch runs there unobserved (its root wrapper too), said. A
custom autograd.Function, whose forward a compiled caller traces as a body of its own, falls
back to eager where it breaks: the model called there is measured. A function marked
`torch.compiler.nested_compile_region` is traced as one graph: the model runs there unobserved.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments import inject_observer, remove_observer

from _zoo import squares_step
from hook_reference import assert_conforms, run_both


class Branches(nn.Module):
    """`torch.cond` on the sign of `pre`'s output: `then` in one branch, `other` in the other."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.then, self.other = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.pre(x)
        return torch.cond(h.sum() > 0, lambda t: self.then(t), lambda t: self.other(t), (h,))


def test_layers_called_in_torch_cond_branches_run_unmeasured_and_are_said(
    run_dir: Path, one_thread: None
) -> None:
    """The sampled forwards run (the first compiles the branches, the second finds dynamo
    loaded), with the plain model's outputs; the layer outside the op equals plain hooks, those
    in its branches have no rows, and the warning and index.md say why. Hooks inside the
    branches would make the plain model raise too (dynamo cannot trace them), so the reference
    hooks `pre` alone."""
    step = squares_step(lambda: torch.randn(3, 4))
    with pytest.warns(RuntimeWarning, match=r"inside a higher-order op \(torch.cond"):
        result = run_both(Branches(), step, run_dir, steps=2, names=["pre"])
    for observed, reference in zip(result.observed_outputs, result.reference_outputs, strict=True):
        assert torch.equal(observed, reference)
    assert_conforms(result.history, result.recorder)
    assert result.catalog == ["pre", "then", "other"]
    assert set(result.history["layer"].unique()) == {"pre"}
    index = (run_dir / "index.md").read_text("utf-8")
    assert (
        "inside a higher-order op (torch.cond, torch.while_loop), unmeasured: `then`, `other`."
        in index
    )


class CallsInCond(nn.Module):
    """`torch.cond` whose branches call `inner`, a model observed by itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> Any:
        return torch.cond(x.sum() > 0, lambda t: self.inner(t), lambda t: -self.inner(t), (x,))


def test_observed_model_called_in_another_models_torch_cond_runs_unobserved_and_is_said(
    tmp_path: Path,
) -> None:
    """The branches trace the observed model's forward through its root wrapper into their
    graph: each step (with grad and backward, then under no_grad, which compiles the branches
    again) returns the plain model's output, with the plain gradients; those root forwards are
    neither counted nor sampled, and the warning and index.md say why (the run has no rows)."""
    plain = CallsInCond()
    outer = CallsInCond()
    outer.load_state_dict(plain.state_dict())
    inject_observer(outer.inner, output_dir=tmp_path / "stats")
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5], [-1.0, 2.0, -0.5, 4.0]])
    with pytest.warns(RuntimeWarning, match="traced the model's own forward into that graph"):
        observed = outer(x)
    observed.square().sum().backward()
    expected = plain(x)
    expected.square().sum().backward()
    assert torch.equal(observed, expected)
    for mine, theirs in zip(outer.parameters(), plain.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)  # type: ignore[arg-type]
    with torch.no_grad():
        assert torch.equal(outer(-x), plain(-x))
    with pytest.warns(RuntimeWarning, match="no sample was recorded"):
        remove_observer(outer.inner)
    index = (tmp_path / "stats" / "index.md").read_text("utf-8")
    assert "the observed model was called inside code that torch.compile traced as one" in index
    assert "those root forwards were neither counted nor sampled" in index


class Doubled(torch.autograd.Function):
    """A custom autograd.Function whose forward calls the observed model (`model`); its backward
    doubles the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return model(x)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return grads[0].sum(-1, keepdim=True).expand(-1, 4) * 2, None


def through_function(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    output = Doubled.apply(x.requires_grad_(), model)
    output.sum().backward()
    return output.detach()


@pytest.mark.usefixtures("fresh_dynamo")
def test_observed_model_called_in_a_compiled_autograd_function_forward_is_measured(
    run_dir: Path,
) -> None:
    """A compiled step calling the observed model inside a custom autograd.Function's forward:
    dynamo may break the graph there (it runs the Function eagerly at its `apply`), so the model
    is observed there as in eager mode, and its rows equal plain hooks. Dynamo names that body
    by a string, not an op, and the model ran in its graph unobserved ("neither counted nor
    sampled"), as in a torch.cond branch, where a break would raise."""
    step = torch.compile(through_function, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_both(
            nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
            lambda m, i: step(m, torch.randn(3, 4)),
            run_dir,
            reference_step=lambda m, i: through_function(m, torch.randn(3, 4)),
            steps=3,
            every=2,
        )
    for observed, reference in zip(result.observed_outputs, result.reference_outputs, strict=True):
        assert torch.equal(observed, reference)
    result.assert_conforms()
    assert result.history["forward_index"].unique().sort().to_list() == [0, 2]
    assert not [w for w in caught if "torchinstruments" in str(w.message)]  # nothing unobserved


@torch.compiler.nested_compile_region
def region(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def through_region(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    output = region(model, x) * 2
    output.sum().backward()
    return output.detach()


@pytest.mark.usefixtures("fresh_dynamo")
def test_observed_model_called_in_a_nested_compile_region_runs_unobserved_and_is_said(
    tmp_path: Path,
) -> None:
    """A compiled step calling the observed model in a `torch.compiler.nested_compile_region`
    function, which dynamo traces as one graph: the model's forward is traced into it, each
    step returns the plain model's output and gradients, and the run says its forwards were
    neither counted nor sampled. The step raised an InternalTorchDynamoError: dynamo read the
    root wrapper again for the region's reuse guards outside the region's body, where the
    wrapper took the read for a call and broke the graph inside it."""
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    observed = copy.deepcopy(plain)
    inject_observer(observed, output_dir=tmp_path / "stats")
    step = torch.compile(through_region, backend="eager")
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="a function marked torch.compiler.nested_compile"):
        assert torch.equal(step(observed, x), through_region(plain, x))
    assert torch.equal(step(observed, x), through_region(plain, x))  # the graph, reused
    for mine, theirs in zip(observed.parameters(), plain.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)  # type: ignore[arg-type]
    with pytest.warns(RuntimeWarning, match="no sample was recorded"):
        remove_observer(observed)
    index = (tmp_path / "stats" / "index.md").read_text("utf-8")
    assert "those root forwards were neither counted nor sampled" in index
