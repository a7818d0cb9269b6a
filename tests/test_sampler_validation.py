"""Samplers are checked at inject, and a non-bool decision is an error said once, not a guess."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import mlp, read_history


def test_a_sampler_class_is_refused_with_a_hint_to_instantiate_it(run_dir: Path) -> None:
    model = mlp()
    with pytest.raises(TypeError, match=r"sampler.*class.*EveryNForwardsSampler\(\.\.\.\)"):
        inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler)
    assert not run_dir.exists()


class NoIndex:
    """Forgot the forward_index argument."""

    def should_sample(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "NoIndex()"


class TwoArguments:
    def should_sample(self, forward_index: int, step: int) -> bool:
        return True

    def __repr__(self) -> str:
        return "TwoArguments()"


@pytest.mark.parametrize("sampler", [NoIndex(), TwoArguments()], ids=repr)
def test_a_should_sample_that_cannot_take_the_forward_index_is_refused_at_inject(
    run_dir: Path, sampler: object
) -> None:
    model = mlp()
    with pytest.raises(TypeError) as caught:
        inject_observer(model, output_dir=run_dir, sampler=sampler)
    message = str(caught.value)
    assert message.startswith(f"sampler={sampler!r} has should_sample(")
    assert "cannot be called as should_sample(forward_index)" in message
    assert not run_dir.exists()
    assert all("forward" not in m.__dict__ for m in model.modules())


class Flexible:
    """Takes the index among optional arguments, or through a builtin without a signature."""

    def should_sample(self, forward_index: int = 0, *extra: int, step: int = 0) -> bool:
        return forward_index % 2 == 0


def test_a_should_sample_that_accepts_one_positional_argument_is_accepted(run_dir: Path) -> None:
    model = mlp()
    builtin = type("Builtin", (), {"should_sample": staticmethod(bool)})()
    for index, sampler in enumerate([Flexible(), builtin]):
        inject_observer(model, output_dir=run_dir / str(index), sampler=sampler)
        model(torch.randn(2, 8))
        model(torch.randn(2, 8))
        remove_observer(model)
        assert read_history(run_dir / str(index))["sample_id"].unique().to_list() == [0]


class Returns:
    def __init__(self, value: Any) -> None:
        self.value = value

    def should_sample(self, forward_index: int) -> Any:
        return self.value

    def __repr__(self) -> str:
        return "Returns()"


class NoModule:
    """An answer whose class has no module name (as `type()` may make one)."""

    __module__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "NoModule()"


# A 0-d bool tensor on the meta device has no value to read: it raised in the user's step.
_UNREADABLE = [torch.tensor(True, device="meta"), NoModule()]


@pytest.mark.parametrize(
    "value",
    [None, "no", math.nan, 2, 1, 0, torch.tensor([True]), 1.0, *_UNREADABLE],
    ids=repr,
)
def test_non_bool_decision_is_reported_once_and_not_sampled(run_dir: Path, value: Any) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=Returns(value))
    with pytest.warns(RuntimeWarning, match=r"sampler Returns\(\) returned .* expected a bool"):
        model(torch.randn(2, 8))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model(torch.randn(2, 8))
    assert not said, [str(w.message) for w in said]
    remove_observer(model)
    assert read_history(run_dir).height == 0


@pytest.mark.parametrize(
    ("value", "sampled"),
    [(True, True), (np.bool_(True), True), (np.bool_(False), False), (torch.tensor(True), True)],
    ids=repr,
)
def test_bool_like_decisions_are_accepted(run_dir: Path, value: Any, sampled: bool) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=Returns(value))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model(torch.randn(2, 8))
    assert not said, [str(w.message) for w in said]
    remove_observer(model)
    assert (read_history(run_dir).height > 0) == sampled


@pytest.mark.parametrize("value", _UNREADABLE, ids=repr)
def test_a_selector_answer_that_cannot_be_read_is_refused_naming_the_selector(
    run_dir: Path, value: Any
) -> None:
    model = mlp()
    with pytest.raises(TypeError, match=r"^selector returned .* for module '' \(Sequential\)"):
        inject_observer(model, output_dir=run_dir, selector=lambda name, module: value)
    assert not run_dir.exists()
