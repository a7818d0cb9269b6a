"""Custom reducers: validation at construction, and null + reason instead of exceptions."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from fractions import Fraction

import numpy as np
import pytest
import torch

from torchinstruments.measurement import custom as ready
from torchinstruments.measurement.custom import Reducer
from torchinstruments.measurement.reducers import DEFAULT_METRICS, DefaultStatistics, Measurer
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
    measurer = Measurer([AbsMax(), Numel()], host_paths=reduction_path == "host")
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


def test_device_scalars_travel_in_the_device_vector() -> None:
    measurer = Measurer([DefaultStatistics(()), AbsMax(), Numel()], host_paths=False)
    pending = measurer.launch(torch.tensor([2.0, -4.0]))
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
    [AbsMax(), "mean", {"a": 3}, [object()], [lambda t: {}], [AbsMax, 3], [{1: abs}]],
    ids=["single", "str", "mapping_of_int", "not_callable", "lambda", "class_and_int", "int_key"],
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
    measurer = Measurer(
        [AbsMax(), DefaultStatistics(("max", "mean"))], host_paths=reduction_path == "host"
    )
    assert measurer.metrics == ("abs_max", "max", "mean")
    got = measure(torch.tensor([1.0, -3.0]), measurer)
    assert got == {"abs_max": MetricValue(3.0), "max": MetricValue(1.0), "mean": MetricValue(-1.0)}


def test_empty_default_statistics_leaves_custom_metrics_only(reduction_path: str) -> None:
    measurer = Measurer([DefaultStatistics(()), AbsMax()], host_paths=reduction_path == "host")
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
    measurer = Measurer([Failing(), AbsMax()], host_paths=reduction_path == "host")
    got = measure(torch.tensor([1.0, -2.0]), measurer)
    reason = "reducer error: ValueError: bad input"
    assert got["broken"] == MetricValue(None, reason)
    assert got["also_broken"] == MetricValue(None, reason)
    assert got["abs_max"] == MetricValue(2.0)
    assert got["max"] == MetricValue(1.0)


def test_a_metric_the_reducer_left_out_is_null_with_a_reason_naming_the_reducers_failure(
    reduction_path: str,
) -> None:
    # It was "reducer returned no value", the reason AbsMax gives an empty tensor: the failure
    # check could not tell the reducer's failure from the tensor's, and said nothing.
    class Partial:
        metrics = ("here", "gone")

        def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
            return {"here": 1.0}

    got = measure(torch.ones(2), Measurer([Partial()], host_paths=reduction_path == "host"))
    assert got["here"] == MetricValue(1.0)
    assert got["gone"] == MetricValue(
        None, "reducer left out 'gone', which its metrics name: its mapping had no entry for it"
    )


def test_keys_beyond_the_metrics_are_not_recorded_and_warned_about_once_per_reducer(
    reduction_path: str,
) -> None:
    # They were dropped without a word.
    class Chatty:
        metrics = ("kept",)

        def __call__(self, tensor: torch.Tensor) -> dict[object, float]:
            return {"kept": 1.0, "extra": 2.0, 3: 4.0}

    measurer = Measurer([Chatty()], host_paths=reduction_path == "host")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        first = measure(torch.ones(2), measurer)
        measure(torch.ones(3), measurer)
    assert first["kept"] == MetricValue(1.0)
    assert "extra" not in measurer.metrics
    messages = [str(w.message) for w in said]
    assert messages == [
        "torchinstruments: reducer Chatty returned 'extra', 3 beyond its metrics ('kept',); "
        "those are not recorded (name them in its `metrics` to record them; warned once per "
        "reducer, and index.md says so)"
    ]
    assert measurer.extra_keys == {"Chatty": (("kept",), ("'extra'", "3"))}


class LazyMapping(Mapping[str, float]):
    """A mapping whose lookup runs code that raises (a lazily computed result)."""

    def __init__(self, on: str) -> None:
        self.on = on

    def __getitem__(self, key: str) -> float:
        if self.on == "getitem":
            raise RuntimeError("lazy value failed")
        return 1.0

    def __contains__(self, key: object) -> bool:
        if self.on == "contains":
            raise RuntimeError("lazy lookup failed")
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(["lazy"])

    def __len__(self) -> int:
        return 1


@pytest.mark.parametrize("on", ["contains", "getitem"])
def test_a_mapping_whose_lookup_raises_is_that_reducers_error_not_the_statistics(
    on: str,
) -> None:
    # `name in result` raising blamed the default statistics ("statistics error: ...").
    class Lazy:
        metrics = ("lazy",)

        def __call__(self, tensor: torch.Tensor) -> Mapping[str, float]:
            return LazyMapping(on)

    got = measure(torch.ones(2), Measurer([Lazy()]))
    failed = "reducer error: RuntimeError: lazy lookup failed"
    if on == "getitem":
        failed = "reducer error: RuntimeError: lazy value failed"
    assert got["lazy"] == MetricValue(None, failed)
    assert got["max"] == MetricValue(1.0)


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
    got = measure(torch.ones(3), Measurer(odd, host_paths=reduction_path == "host"))
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
    got = measure(torch.ones(2), Measurer(listy, host_paths=reduction_path == "host"))
    assert got["a"].value is None
    assert "list" in str(got["a"].reason)


def test_reducers_get_a_detached_tensor_without_grad(reduction_path: str) -> None:
    seen: list[tuple[bool, bool]] = []

    class Spy:
        metrics = ("spy",)

        def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
            seen.append((tensor.requires_grad, torch.is_grad_enabled()))
            return {"spy": 0.0}

    measure(
        torch.ones(3, requires_grad=True) * 2,
        Measurer([Spy()], host_paths=reduction_path == "host"),
    )
    assert seen == [(False, False)]


# -- functions and mappings as reducers, and the ready reducers --------------------------------


def peak_to_peak(tensor: torch.Tensor) -> torch.Tensor:
    """A plain named function: its metric is called `peak_to_peak`."""
    return tensor.amax() - tensor.amin()


def test_named_function_and_mapping_are_reducers(reduction_path: str) -> None:
    measurer = Measurer(
        [peak_to_peak, {"numel": lambda t: t.numel(), "first": lambda t: t.flatten()[0]}],
        host_paths=reduction_path == "host",
    )
    assert measurer.metrics == (*DEFAULT_METRICS, "peak_to_peak", "numel", "first")
    values = [1.0, -7.5, 3.0, 0.25]
    got = measure(torch.tensor(values), measurer)
    assert got["peak_to_peak"] == MetricValue(float(np.ptp(values)))
    assert got["numel"] == MetricValue(4.0)
    assert got["first"] == MetricValue(1.0)


def test_a_mapping_alone_is_accepted() -> None:
    assert Measurer({"numel": lambda t: t.numel()}).metrics == (*DEFAULT_METRICS, "numel")


def test_a_failing_function_nulls_only_its_own_metric(reduction_path: str) -> None:
    def broken(tensor: torch.Tensor) -> float:
        raise ValueError("bad input")

    got = measure(
        torch.tensor([2.0]),
        Measurer([{"ok": lambda t: 1.0}, broken], host_paths=reduction_path == "host"),
    )
    assert got["ok"] == MetricValue(1.0)
    assert got["broken"] == MetricValue(None, "reducer error: ValueError: bad input")


class Growing:
    """A reducer whose `metrics` its owner extends after the observer was injected."""

    def __init__(self) -> None:
        self.metrics = ["first_metric"]

    def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
        return dict.fromkeys(self.metrics, 1.0)


def test_metrics_are_read_once_so_a_later_change_never_shifts_values_to_other_names(
    reduction_path: str,
) -> None:
    def seven(tensor: torch.Tensor) -> float:
        return 7.0

    growing = Growing()
    measurer = Measurer([growing, seven], host_paths=reduction_path == "host")
    growing.metrics.append("added_later")
    assert measurer.metrics == (*DEFAULT_METRICS, "first_metric", "seven")
    with pytest.warns(RuntimeWarning, match=r"returned 'added_later' beyond its metrics"):
        got = measure(torch.tensor([2.0, -1.0]), measurer)
    assert got["first_metric"] == MetricValue(1.0)
    assert got["seven"] == MetricValue(7.0)


def test_a_lambda_without_a_name_is_refused_with_a_way_out() -> None:
    with pytest.raises(TypeError, match=r"reducers\[1\] is a lambda.*\{\"my_metric\": lambda"):
        Measurer([peak_to_peak, lambda t: t.mean()])


def test_a_function_named_like_a_default_metric_clashes() -> None:
    def mean(tensor: torch.Tensor) -> float:
        return 0.0

    with pytest.raises(ValueError, match="'mean' from DefaultStatistics"):
        Measurer([mean])


@pytest.mark.parametrize(
    "values",
    [
        [1.0, -7.5, 3.0],
        [0.5, float("nan"), -2.0, float("inf")],
        [3, -4, 0],
    ],
    ids=["floats", "nonfinite_skipped", "ints"],
)
def test_ready_reducers_match_numpy_on_finite_entries(
    reduction_path: str, values: list[float]
) -> None:
    finite = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    dtype = torch.int64 if all(isinstance(v, int) for v in values) else torch.float32
    got = measure(
        torch.tensor(values, dtype=dtype),
        Measurer([ready.AbsMax(), ready.L2Norm()], host_paths=reduction_path == "host"),
    )
    assert got["abs_max"] == MetricValue(float(np.abs(finite).max()))
    assert got["l2_norm"].value == pytest.approx(float(np.linalg.norm(finite)), rel=1e-7)


@pytest.mark.parametrize("magnitude", [1e-170, 1e-310, 1e200, 1e308])
def test_l2_norm_of_float64_entries_whose_squares_leave_float64_is_their_exact_norm(
    reduction_path: str, magnitude: float
) -> None:
    values = [3 * magnitude, -4 * magnitude, 0.0, float("nan")] if magnitude < 1e300 else []
    values = values or [0.5 * magnitude, -0.5 * magnitude, 0.25 * magnitude]
    finite = [Fraction(v) for v in values if math.isfinite(v)]
    squares = sum(v * v for v in finite)  # exact; NumPy's own norm over- or underflows here
    shift = -1200 if magnitude < 1 else 1200  # into float64's range, by an even power of two
    exact = math.sqrt(float(squares / Fraction(2) ** shift)) * 2.0 ** (shift // 2)
    got = measure(
        torch.tensor(values, dtype=torch.float64),
        Measurer([ready.L2Norm()], host_paths=reduction_path == "host"),
    )
    assert got["l2_norm"].value == pytest.approx(exact, rel=1e-15, abs=2.0**-1074)


def test_ready_reducers_give_null_with_a_reason_without_finite_entries(
    reduction_path: str,
) -> None:
    measurer = Measurer([ready.AbsMax(), ready.L2Norm()], host_paths=reduction_path == "host")
    nothing_finite = measure(torch.tensor([float("nan"), float("inf")]), measurer)
    assert nothing_finite["abs_max"] == MetricValue(None, "non-finite result")
    assert nothing_finite["l2_norm"] == MetricValue(None, "non-finite result")
    empty = measure(torch.zeros(0), measurer)
    assert empty["abs_max"] == MetricValue(None, "reducer returned no value")


def test_ready_reducers_are_exported() -> None:
    import torchinstruments

    assert torchinstruments.AbsMax is ready.AbsMax
    assert torchinstruments.L2Norm is ready.L2Norm


def test_ready_reducers_of_a_complex_tensor_are_null_with_the_unsupported_dtype_reason(
    reduction_path: str,
) -> None:
    # |3 + 4j| = 5: a modulus no real part gives, so a number here describes no part of it
    values = torch.tensor([3 + 4j, -1 + 0j], dtype=torch.complex64)
    measurer = Measurer([ready.AbsMax(), ready.L2Norm()], host_paths=reduction_path == "host")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's complex-to-real cast warning is no note of ours
        got = measure(values, measurer)
    assert got["abs_max"] == MetricValue(None, "unsupported dtype complex64")
    assert got["l2_norm"] == MetricValue(None, "unsupported dtype complex64")


def test_ready_reducers_of_a_tensor_made_under_inference_mode_equal_numpy(
    reduction_path: str,
) -> None:
    measurer = Measurer([ready.AbsMax(), ready.L2Norm()], host_paths=reduction_path == "host")
    with torch.inference_mode():  # an evaluation forward under inference_mode measures here
        values = torch.tensor([1.0, -7.5, 3.0])
        got = measure(values, measurer)
    assert got["abs_max"] == MetricValue(7.5)
    assert got["l2_norm"].value == pytest.approx(float(np.linalg.norm([1.0, -7.5, 3.0])), rel=1e-7)
