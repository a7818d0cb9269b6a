"""torch.func transforms: rows hold the values the plain model computes, and say what they are.

Under `grad` and `jacrev` a layer returns wrapper tensors without storage, under `vmap` a batched
tensor whose per-sample view hides the batch: the rows describe the unwrapped values (for `vmap`
the whole underlying batch, with the vmapped sizes first in `shape`), and index.md says so.
(Both directions against plain hooks on every transform: `tests/test_conformance_torch_func.py`.)
Gradients that torch.autograd's own, older vmap batches over cotangents
(`is_grads_batched=True`) are measured over their whole batch the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.gradients import BATCHED_GRADIENTS_NOTE
from torchinstruments.records import MetricValue

from conftest import assert_matches_numpy, read_history


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def loss_of(m: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(m, params, (x,)).square().sum()

    return loss


def grad(m: nn.Module, x: torch.Tensor) -> object:
    return torch.func.grad(loss_of(m))(dict(m.named_parameters()), x)


def jacrev(m: nn.Module, x: torch.Tensor) -> object:
    return torch.func.jacrev(loss_of(m))(dict(m.named_parameters()), x)


def vmap(m: nn.Module, x: torch.Tensor) -> object:
    return torch.func.vmap(torch.func.grad(loss_of(m)), in_dims=(None, 0))(
        dict(m.named_parameters()), x
    )


def nested_vmap(m: nn.Module, x: torch.Tensor) -> object:
    return torch.func.vmap(torch.func.vmap(m, in_dims=1), in_dims=0)(x)


@pytest.mark.parametrize(
    ("transform", "x_shape", "row_shape"),
    [
        (grad, (5, 6), [5, 8]),
        (jacrev, (5, 6), [5, 8]),
        (vmap, (5, 6), [5, 8]),
        (nested_vmap, (2, 6, 3), [2, 3, 8]),  # vmapped sizes outermost first, then per sample
    ],
    ids=["grad", "jacrev", "vmap", "nested_vmap"],
)
def test_rows_hold_the_plain_models_values(
    tmp_path: Path, transform: Callable[..., object], x_shape: tuple[int, ...], row_shape: list[int]
) -> None:
    observed = model()
    x = torch.randn(*x_shape)
    inject_observer(observed, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match="torch.func: layers returned tensors wrapped"):
        transform(observed, x)
    remove_observer(observed)
    rows = read_history(tmp_path / "s").filter(pl.col("signal") == "output", pl.col("layer") == "0")
    assert rows["value"].null_count() == 0
    assert rows["shape"].to_list() == [row_shape] * rows.height
    plain = x if transform is not nested_vmap else x.movedim(2, 1)  # the vmapped dims first
    want = observed[0](plain).detach().numpy()
    got = {r["metric"]: MetricValue(r["value"]) for r in rows.rows(named=True)}
    assert_matches_numpy(got, want)
    assert (
        "torch.func: layers returned tensors wrapped" in (tmp_path / "s" / "index.md").read_text()
    )


def test_per_sample_gradients_are_measured_over_the_batch(tmp_path: Path) -> None:
    """Under vmap(grad), the gradient into each output is the per-sample gradient; the rows
    describe all of them together, which is the plain summed-loss backward's gradient."""
    observed = model()
    reference = model()
    reference.load_state_dict(observed.state_dict())
    x = torch.randn(5, 6)
    inject_observer(observed, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning):
        vmap(observed, x)
    remove_observer(observed)
    hidden = reference[0](x)
    hidden.retain_grad()
    reference[2](reference[1](hidden)).square().sum().backward()
    assert hidden.grad is not None
    rows = read_history(tmp_path / "s").filter(
        pl.col("signal") == "output_gradient", pl.col("layer") == "0"
    )
    got = {r["metric"]: MetricValue(r["value"]) for r in rows.rows(named=True)}
    assert_matches_numpy(got, hidden.grad.numpy())
    assert np.isfinite(rows["value"].to_numpy()).all()


def test_gradients_batched_over_cotangents_are_measured_over_the_batch(tmp_path: Path) -> None:
    """`torch.autograd.grad(..., is_grads_batched=True)` (what `torch.autograd.functional.jacobian`
    and `hessian` run with `vectorize=True`) batches its cotangents with torch.autograd's own vmap,
    older than torch.func's: the gradient into each output is one per cotangent, and the rows
    describe all of them together, the cotangents' count first in `shape`, as under vmap."""
    observed = model()
    reference = model()
    reference.load_state_dict(observed.state_dict())
    x = torch.randn(5, 6, requires_grad=True)
    cotangents = torch.randn(4, 5, 3)
    inject_observer(observed, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match="is_grads_batched=True") as caught:
        torch.autograd.grad(observed(x), x, grad_outputs=cotangents, is_grads_batched=True)
    assert len(caught) == 1  # said once, and nothing failed
    remove_observer(observed)
    assert BATCHED_GRADIENTS_NOTE in (tmp_path / "s" / "index.md").read_text()
    outputs = []
    for layer in reference:
        outputs.append(layer(outputs[-1] if outputs else x))
    gradients = read_history(tmp_path / "s").filter(pl.col("signal") == "output_gradient")
    assert sorted(set(gradients["layer"])) == ["0", "1", "2"]
    for name, output in zip(["0", "1", "2"], outputs, strict=True):
        want = torch.stack(
            [torch.autograd.grad(outputs[-1], output, c, retain_graph=True)[0] for c in cotangents]
        )
        rows = gradients.filter(pl.col("layer") == name)
        assert rows["shape"].to_list() == [list(want.shape)] * rows.height
        got = {r["metric"]: MetricValue(r["value"]) for r in rows.rows(named=True)}
        assert_matches_numpy(got, want.numpy())


def test_a_vmap_ensemble_warns_once_that_its_layers_have_no_gradient_rows(tmp_path: Path) -> None:
    """An ensemble of `stack_module_state` + `functional_call` under `vmap`, backward outside
    vmap: the batched outputs report requires_grad=False and take no hook (as for plain
    `register_hook`), though gradients reach the values under them. One warning at the forward
    names the first layer and the transform; index.md names every layer, not as a frozen one."""
    members = [model() for _ in range(3)]
    params, buffers = torch.func.stack_module_state(members)  # type: ignore[arg-type]
    base = model()
    inject_observer(base, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))

    def member(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor) -> object:
        return torch.func.functional_call(base, (p, b), (x,))

    x = torch.randn(4, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = torch.func.vmap(member, in_dims=(0, 0, None))(params, buffers, x)
            assert isinstance(out, torch.Tensor)
            out.square().sum().backward()
    remove_observer(base)
    assert params["0.weight"].grad is not None  # gradients did flow, outside vmap
    said = [str(w.message) for w in caught if "requires_grad=False" in str(w.message)]
    assert len(said) == 1
    assert "layer '0'" in said[0]
    assert "vmap" in said[0]
    history = read_history(tmp_path / "s")
    assert set(history["signal"]) == {"output"}
    index = (tmp_path / "s" / "index.md").read_text()
    assert "3 selected layers returned outputs wrapped by a torch.func transform" in index
    assert "`0` (vmap), `1` (vmap), `2` (vmap)" in index
    assert "never returned an output that requires grad" not in index


def test_a_vmapped_frozen_model_is_said_to_need_no_grad_not_to_be_hidden(tmp_path: Path) -> None:
    """Under vmap, outputs whose values require no grad (a frozen model, input without grad)
    are the ordinary case: no gradient exists, and index.md says so, with no transform warning."""
    frozen = model().requires_grad_(False)
    inject_observer(frozen, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.func.vmap(frozen)(torch.randn(3, 4, 6))
    remove_observer(frozen)
    assert not [w for w in caught if "requires_grad=False" in str(w.message)]
    index = (tmp_path / "s" / "index.md").read_text()
    assert "3 selected layers never returned an output that requires grad" in index
    assert "wrapped by a torch.func transform that report" not in index
