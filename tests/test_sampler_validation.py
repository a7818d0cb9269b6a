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


class Returns:
    def __init__(self, value: Any) -> None:
        self.value = value

    def should_sample(self, forward_index: int) -> Any:
        return self.value

    def __repr__(self) -> str:
        return "Returns()"


@pytest.mark.parametrize(
    "value", [None, "no", math.nan, 2, 1, 0, torch.tensor([True]), 1.0], ids=repr
)
def test_non_bool_decision_is_reported_once_and_not_sampled(run_dir: Path, value: Any) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=Returns(value))
    with pytest.warns(RuntimeWarning, match=r"sampler Returns\(\) returned .* expected a bool"):
        model(torch.randn(2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 8))
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
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 8))
    remove_observer(model)
    assert (read_history(run_dir).height > 0) == sampled
