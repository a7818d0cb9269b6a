"""Custom reducers: validation at construction, and null + reason instead of exceptions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchinstruments.measurement import tensors
from torchinstruments.measurement.reducers import (
    DEFAULT_METRICS,
    DefaultStatistics,
    Measurer,
    Reducer,
)
from torchinstruments.records import MetricValue

from conftest import measure


class AbsMax:
    """Returns a 0-d tensor."""

    metrics = ("abs_max",)

    def __call__(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"abs_max": tensor.abs().amax()}


class Numel:
    """Returns a Python number."""

    metrics = ("numel", "half_numel")

    def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
        return {"numel": tensor.numel(), "half_numel": tensor.numel() / 2}


class Failing:
    """Raises."""

    metrics = ("broken", "also_broken")

    def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
        raise ValueError("bad input")


def test_custom_metrics_follow_the_default_profile(reduction_path: str) -> None:
    measurer = Measurer([AbsMax(), Numel()])
    assert measurer.metrics == (*DEFAULT_METRICS, "abs_max", "numel", "half_numel")
    tensor = torch.tensor([1.0, -7.5, 3.0])
    got = measure(tensor, measurer)
    assert got["abs_max"] == MetricValue(7.5)
    assert got["numel"] == MetricValue(3.0)
    assert got["half_numel"] == MetricValue(1.5)
    assert got["mean"].value == pytest.approx(float(np.mean([1.0, -7.5, 3.0])), rel=1e-12)


def test_reducers_satisfy_the_protocol() -> None:
    assert isinstance(AbsMax(), Reducer)
    assert isinstance(DefaultStatistics(), Reducer)


def test_device_scalars_travel_in_the_device_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensors, "SYNC_FREE_DEVICE_TYPES", frozenset())
    pending = Measurer([DefaultStatistics(()), AbsMax(), Numel()]).launch(torch.tensor([2.0, -4.0]))
    assert pending.device_vector is not None
    assert pending.device_vector.tolist() == [4.0]  # Python numbers stay on the host
    assert pending.resolve([4.0]) == (MetricValue(4.0), MetricValue(2.0), MetricValue(1.0))


def test_clash_with_the_default_profile_raises_at_construction() -> None:
    class Mean:
        metrics = ("mean",)

        def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
            return {"mean": 0.0}

    with pytest.raises(ValueError, match=r"'mean' from DefaultStatistics.*and .*Mean"):
        Measurer([Mean()])


def test_clash_between_reducers_raises() -> None:
    with pytest.raises(ValueError, match="'abs_max'"):
        Measurer([AbsMax(), AbsMax()])


def test_repeated_name_within_a_reducer_raises() -> None:
    class Twice:
        metrics = ("a", "a")

        def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
            return {"a": 1.0}

    with pytest.raises(ValueError, match="repeats"):
        Measurer([Twice()])


@pytest.mark.parametrize(
    "reducers",
    [AbsMax(), "mean", {"a": AbsMax()}, [object()], [lambda t: {}], [AbsMax, 3]],
    ids=["single", "str", "mapping", "not_callable", "no_metrics", "class_and_int"],
)
def test_wrong_types_raise_type_error_naming_reducers(reducers: object) -> None:
    with pytest.raises(TypeError, match="reducers"):
        Measurer(reducers)  # type: ignore[arg-type]


def test_metric_names_must_be_non_empty_strings() -> None:
    class Bad:
        metrics = ("ok", "")

        def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
            return {}

    with pytest.raises(TypeError, match=r"reducers\[0\].*non-empty str"):
        Measurer([Bad()])


def test_default_statistics_subset_replaces_the_default(reduction_path: str) -> None:
    measurer = Measurer([AbsMax(), DefaultStatistics(("max", "mean"))])
    assert measurer.metrics == ("abs_max", "max", "mean")
    got = measure(torch.tensor([1.0, -3.0]), measurer)
    assert got == {"abs_max": MetricValue(3.0), "max": MetricValue(1.0), "mean": MetricValue(-1.0)}


def test_empty_default_statistics_leaves_custom_metrics_only(reduction_path: str) -> None:
    measurer = Measurer([DefaultStatistics(()), AbsMax()])
    assert measurer.metrics == ("abs_max",)
    assert measure(torch.tensor([-2.0]), measurer) == {"abs_max": MetricValue(2.0)}


def test_subset_can_redefine_a_default_name_elsewhere() -> None:
    class Mean:
        metrics = ("mean",)

        def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
            return {"mean": 1.0}

    assert Measurer([DefaultStatistics(("std",)), Mean()]).metrics == ("std", "mean")


@pytest.mark.parametrize("metrics", [("median",), ("mean", "mean"), "mean"])
def test_default_statistics_validates_its_metrics(metrics: object) -> None:
    with pytest.raises((ValueError, TypeError), match="metrics") as info:
        DefaultStatistics(metrics)  # type: ignore[arg-type]
    if metrics == ("median",):
        assert "'median'" in str(info.value)
        assert "nonfinite_fraction" in str(info.value)  # lists the allowed values


def test_raising_reducer_gives_null_with_reason_and_others_survive(reduction_path: str) -> None:
    measurer = Measurer([Failing(), AbsMax()])
    got = measure(torch.tensor([1.0, -2.0]), measurer)
    reason = "reducer error: ValueError: bad input"
    assert got["broken"] == MetricValue(None, reason)
    assert got["also_broken"] == MetricValue(None, reason)
    assert got["abs_max"] == MetricValue(2.0)
    assert got["max"] == MetricValue(1.0)


def test_missing_metric_gives_null_with_reason(reduction_path: str) -> None:
    class Partial:
        metrics = ("here", "gone")

        def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
            return {"here": 1.0}

    got = measure(torch.ones(2), Measurer([Partial()]))
    assert got["here"] == MetricValue(1.0)
    assert got["gone"] == MetricValue(None, "reducer returned no value")


def test_invalid_values_give_null_with_reason(reduction_path: str) -> None:
    class Odd:
        metrics = ("vector", "text", "complex", "nan", "one_element", "flag")

        def __call__(self, tensor: torch.Tensor) -> dict[str, object]:
            return {
                "vector": tensor.abs(),
                "text": "high",
                "complex": torch.tensor(1 + 2j),
                "nan": torch.tensor(math.nan),
                "one_element": torch.tensor([4], dtype=torch.int32),
                "flag": torch.tensor(True),
            }

    odd: list[Reducer] = [DefaultStatistics(()), Odd()]  # pyrefly: ignore[bad-assignment]
    got = measure(torch.ones(3), Measurer(odd))
    assert got["vector"].value is None
    assert "shape (3,)" in str(got["vector"].reason)
    assert got["text"].value is None
    assert "str" in str(got["text"].reason)
    assert got["complex"] == MetricValue(
        None, "reducer returned a tensor of unsupported dtype complex64"
    )
    assert got["nan"] == MetricValue(None, "non-finite result")
    assert got["one_element"] == MetricValue(4.0)
    assert got["flag"] == MetricValue(1.0)


def test_non_mapping_result_gives_null_with_reason(reduction_path: str) -> None:
    class Listy:
        metrics = ("a",)

        def __call__(self, tensor: torch.Tensor) -> list[float]:
            return [1.0]

    listy: list[Reducer] = [Listy()]  # pyrefly: ignore[bad-assignment]
    got = measure(torch.ones(2), Measurer(listy))
    assert got["a"].value is None
    assert "list" in str(got["a"].reason)


def test_reducers_get_a_detached_tensor_without_grad(reduction_path: str) -> None:
    seen: list[tuple[bool, bool]] = []

    class Spy:
        metrics = ("spy",)

        def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
            seen.append((tensor.requires_grad, torch.is_grad_enabled()))
            return {"spy": 0.0}

    measure(torch.ones(3, requires_grad=True) * 2, Measurer([Spy()]))
    assert seen == [(False, False)]
