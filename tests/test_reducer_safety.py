"""A custom reducer cannot change training: in-place changes to its argument are caught.

The reducer gets a tensor of its own; if it modifies it (the version counter moves), its metrics
are null with a reason naming it, one warning says so, the reducers after it still see the
original values, and the model trains exactly as the unobserved copy does.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, reasons, remove_observer
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.records import MetricValue

from conftest import mlp, read_history, sgd_step


class Doubling:
    """Modifies its argument in place (a bug a user could write)."""

    metrics = ("doubled_sum",)

    def __call__(self, tensor: torch.Tensor) -> dict[str, Any]:
        tensor.mul_(2)
        return {"doubled_sum": tensor.sum()}


class AbsMax:
    metrics = ("abs_max",)

    def __call__(self, tensor: torch.Tensor) -> dict[str, Any]:
        return {"abs_max": tensor.abs().amax()}


def test_in_place_reducer_is_reported_and_training_is_unchanged(run_dir: Path) -> None:
    model = mlp(width=6, depth=2)
    reference = copy.deepcopy(model)
    outputs: list[np.ndarray] = []
    reference[0].register_forward_hook(
        lambda module, args, out: outputs.append(out.detach().numpy().copy())
    )
    x, y = torch.randn(8, 6), torch.randn(8, 6)

    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), reducers=[Doubling(), AbsMax()]
    )
    with pytest.warns(RuntimeWarning, match=r"reducer .*Doubling.* modified its argument in place"):
        losses = [sgd_step(model, x, y, 0.1) for _ in range(3)]
    remove_observer(model)
    reference_losses = [sgd_step(reference, x, y, 0.1) for _ in range(3)]

    assert losses == reference_losses
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, expected)
    history = read_history(run_dir)
    doubled = history.filter(pl.col("metric") == "doubled_sum")
    assert doubled.height == 3 * 4 * 2  # samples x layers x signals
    assert doubled["value"].null_count() == doubled.height
    assert all(
        "Doubling" in r and "modified its argument in place" in r
        for r in doubled["unavailable_reason"]
    )
    abs_max = history.filter(
        (pl.col("metric") == "abs_max") & (pl.col("layer") == "0") & (pl.col("signal") == "output")
    ).sort("sample_id")
    assert abs_max["value"].to_list() == [
        pytest.approx(float(np.abs(out).max())) for out in outputs
    ]


def test_reducer_without_side_effects_sees_the_live_values(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), reducers=[AbsMax()]
    )
    out = model(torch.randn(4, 3))
    remove_observer(model)
    rows = read_history(run_dir).filter(
        (pl.col("metric") == "abs_max") & (pl.col("signal") == "output")
    )
    assert rows["value"].to_list() == [pytest.approx(out.detach().abs().max().item())]


def test_each_modifying_function_is_named_in_its_reason_and_warned_about_once(
    run_dir: Path,
) -> None:
    def clamp_then_max(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clamp_(min=0).amax()

    def scaled_sum(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.mul_(2).sum()

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        reducers=[clamp_then_max, scaled_sum, {"halved": lambda t: t.div_(2).sum()}],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(4, 3)).sum().backward()
    remove_observer(model)
    modified = [str(w.message) for w in caught if "modified its argument" in str(w.message)]
    assert len(modified) == 3
    for name in ("reducer clamp_then_max ", "reducer scaled_sum ", "reducer <lambda> of metric"):
        assert sum(name in message for message in modified) == 1
    rows = read_history(run_dir).filter(pl.col("metric").is_in(["clamp_then_max", "scaled_sum"]))
    assert rows.height == 2 * 2 * 2 * 2  # samples x layers x signals x metrics
    for metric, reason in rows.select("metric", "unavailable_reason").iter_rows():
        assert reason.startswith(f"reducer {metric} modified its argument in place")


def test_a_custom_value_that_is_no_float_is_that_reducers_null_not_the_statistics() -> None:
    """A reducer's value that cannot become a float64 (an int beyond it, a meta tensor) is
    null in that metric's rows with the reducer's reason (no finite value, or the reducer's
    error), never a failure of the default statistics, which stay measured."""
    measurer = Measurer(
        {
            "big": lambda t: 10**400,
            "meta": lambda t: torch.tensor(1.0, device="meta"),
            "fine": lambda t: 2.0,
        }
    )
    x = torch.randn(10)
    pending = measurer.launch(x)
    vector = pending.device_vector
    values = pending.resolve([] if vector is None else vector.tolist())
    got = dict(zip(measurer.metrics, values, strict=True))
    assert got["big"] == MetricValue(None, reasons.NON_FINITE_RESULT)
    assert got["meta"].value is None
    assert got["meta"].reason is not None
    assert got["meta"].reason.startswith("reducer error: RuntimeError: ")
    assert got["fine"] == MetricValue(2.0)
    assert got["mean"].value == pytest.approx(float(x.double().mean()))
    assert got["max"] == MetricValue(float(x.max()))


def random_subsample_mean(tensor: torch.Tensor) -> torch.Tensor:
    """A reducer estimating the mean from a random subsample (it draws from torch's RNG)."""
    flat = tensor.flatten()
    return flat[torch.randint(flat.numel(), (4,))].mean()


def test_a_reducer_drawing_random_numbers_leaves_the_training_rng_as_it_was(
    run_dir: Path,
) -> None:
    model = mlp()
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        reducers=[random_subsample_mean],
    )
    x = torch.randn(2, 8)
    torch.manual_seed(0)
    model(x)
    observed = torch.rand(3)
    remove_observer(model)
    torch.manual_seed(0)
    model(x)
    assert torch.equal(torch.rand(3), observed)


class UnshowableReducer:
    """A correct reducer whose repr raises (a proxy of something gone)."""

    metrics = ("unshowable_mean",)

    def __call__(self, tensor: torch.Tensor) -> dict[str, Any]:
        return {"unshowable_mean": tensor.mean()}

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_a_correct_reducer_whose_repr_raises_is_accepted_and_measures(run_dir: Path) -> None:
    model = mlp()
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), reducers=[UnshowableReducer()]
    )
    model(torch.randn(2, 8))
    remove_observer(model)
    values = read_history(run_dir).filter(pl.col("metric") == "unshowable_mean")["value"]
    assert values.len() > 0
    assert values.null_count() == 0
