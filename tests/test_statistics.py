"""The default statistics profile against NumPy on the same values, on both reduction paths.

Every case runs twice: on the CPU selection path (the default on CPU) and on the sync-free device
path (the one CUDA uses), forced on the CPU by `Measurer(..., host_paths=False)` (the `reduction_path` fixture).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from torchinstruments.measurement.reducers import DEFAULT_METRICS, DefaultStatistics, Measurer
from torchinstruments.records import MetricValue

from conftest import NoHostSync, assert_matches_numpy, measure, numpy_profile

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
ORDER_METRICS = ("min", "max", "p25", "p50", "p75")


def check_invariants(got: dict[str, MetricValue]) -> None:
    """Every null has a reason, every value is finite and has none."""
    for name, metric in got.items():
        if metric.value is None:
            assert metric.reason, name
        else:
            assert metric.reason is None, name
            assert math.isfinite(metric.value), name


def assert_matches(got: dict[str, MetricValue], values: np.ndarray) -> None:
    """Compares with NumPy: order statistics exactly, moments tightly."""
    check_invariants(got)
    assert_matches_numpy(got, values)


def as_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor under test, in `dtype`."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def as_reference(tensor: torch.Tensor) -> np.ndarray:
    """The values NumPy sees: half types after conversion to float32, others as they are."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.to(torch.float32).numpy()
    return tensor.numpy()


def distributions(rng: np.random.Generator, n: int) -> Iterator[tuple[str, np.ndarray]]:
    """The value patterns every dtype is checked on."""
    yield "normal", rng.standard_normal(n)
    yield "cauchy", rng.standard_cauchy(n)
    yield "constant", np.full(n, 3.25)
    yield "relu", np.maximum(rng.standard_normal(n), 0.0)
    yield "signed_zeros", rng.choice(np.array([0.0, -0.0, 1.5, -2.0]), n)
    for ratio in (0.1, 0.5, 0.99):
        mixed = rng.standard_normal(n)
        bad = rng.random(n) < ratio
        mixed[bad] = rng.choice(np.array([np.nan, np.inf, -np.inf]), int(bad.sum()))
        yield f"nonfinite_{ratio}", mixed
    yield "all_nan", np.full(n, np.nan)
    yield "all_inf", rng.choice(np.array([np.inf, -np.inf]), n)


CASES = [
    (name, n) for n in (1001, 40_000) for name, _ in distributions(np.random.default_rng(0), 1)
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("name", "n"), CASES)
def test_matches_numpy(reduction_path: str, dtype: torch.dtype, name: str, n: int) -> None:
    values = dict(distributions(np.random.default_rng(n), n))[name]
    tensor = as_tensor(values, dtype)
    assert_matches(measure(tensor, host_paths=reduction_path == "host"), as_reference(tensor))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_one_element(reduction_path: str, dtype: torch.dtype) -> None:
    got = measure(torch.tensor([-1.5], dtype=dtype), host_paths=reduction_path == "host")
    assert {name: got[name].value for name in DEFAULT_METRICS} == {
        "mean": -1.5,
        "std": 0.0,
        "min": -1.5,
        "max": -1.5,
        "p25": -1.5,
        "p50": -1.5,
        "p75": -1.5,
        "zero_fraction": 0.0,
        "nonfinite_fraction": 0.0,
    }


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_no_finite_entries(reduction_path: str, dtype: torch.dtype) -> None:
    got = measure(
        torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype),
        host_paths=reduction_path == "host",
    )
    assert got["nonfinite_fraction"] == MetricValue(1.0)
    assert got["zero_fraction"] == MetricValue(0.0)
    for name in ("mean", "std", "min", "max", "p25", "p50", "p75"):
        assert got[name] == MetricValue(None, "no finite entries")


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.int64, torch.bool], ids=str)
def test_empty_tensor(reduction_path: str, dtype: torch.dtype) -> None:
    got = measure(torch.zeros(0, 3, dtype=dtype), host_paths=reduction_path == "host")
    assert all(metric == MetricValue(None, "empty tensor") for metric in got.values())


def test_signed_zeros_count_as_zero_and_report_positive_zero(reduction_path: str) -> None:
    got = measure(torch.tensor([-0.0, -0.0, 0.0, -0.0]), host_paths=reduction_path == "host")
    assert got["zero_fraction"] == MetricValue(1.0)
    for name in ORDER_METRICS:
        value = got[name].value
        assert value == 0.0
        assert value is not None
        assert math.copysign(1.0, value) == 1.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8], ids=str)
def test_integers_are_measured_as_float64(reduction_path: str, dtype: torch.dtype) -> None:
    low = 0 if dtype == torch.uint8 else -100
    tensor = torch.randint(
        low, 100, (5001,), dtype=dtype, generator=torch.Generator().manual_seed(1)
    )
    assert_matches(
        measure(tensor, host_paths=reduction_path == "host"), tensor.numpy().astype(np.float64)
    )


def test_large_int64_values(reduction_path: str) -> None:
    tensor = torch.tensor([2**62, -(2**62), 7, 0], dtype=torch.int64)
    assert_matches(
        measure(tensor, host_paths=reduction_path == "host"), tensor.numpy().astype(np.float64)
    )


def test_bool_is_measured_as_zero_one(reduction_path: str) -> None:
    tensor = torch.tensor([True, False, True, True])
    got = measure(tensor, host_paths=reduction_path == "host")
    assert_matches(got, np.array([1.0, 0.0, 1.0, 1.0]))
    assert got["mean"].value == 0.75
    assert got["zero_fraction"].value == 0.25


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_is_unsupported(reduction_path: str, dtype: torch.dtype) -> None:
    got = measure(torch.ones(4, dtype=dtype), host_paths=reduction_path == "host")
    name = str(dtype).removeprefix("torch.")
    assert all(metric == MetricValue(None, f"unsupported dtype {name}") for metric in got.values())


def test_sparse_is_unsupported(reduction_path: str) -> None:
    sparse = torch.eye(3).to_sparse()
    got = measure(sparse, host_paths=reduction_path == "host")
    assert all(
        metric == MetricValue(None, "unsupported layout torch.sparse_coo")
        for metric in got.values()
    )


def test_float32_variance_beyond_float32_range_is_not_null(reduction_path: str) -> None:
    values = np.array([3e38, -3e38, 3e38, -3e38], dtype=np.float32)
    got = measure(torch.from_numpy(values), host_paths=reduction_path == "host")
    assert got["std"].value == pytest.approx(float(np.float32(3e38)), rel=1e-12)
    assert got["mean"].value == 0.0


def test_float64_near_overflow_has_mean_and_std(reduction_path: str) -> None:
    values = np.array([1.5e308, -1.5e308, 1.5e308, 1.0])
    got = measure(torch.from_numpy(values), host_paths=reduction_path == "host")
    scaled = values / 2.0**1000  # exact; NumPy itself would overflow on the unscaled values
    assert got["mean"].value == pytest.approx(float(np.mean(scaled)) * 2.0**1000, rel=1e-12)
    assert got["std"].value == pytest.approx(float(np.std(scaled)) * 2.0**1000, rel=1e-12)
    assert got["p50"].value == pytest.approx(float(np.percentile(values, 50)), rel=1e-12)


@pytest.mark.parametrize("repeats", [1, 5000])  # 8 and 40,000 entries: sorted and selected
def test_std_of_entries_at_the_float64_limits_is_the_largest_float_not_a_null(
    reduction_path: str, repeats: int
) -> None:
    top = np.finfo(np.float64).max
    below = np.nextafter(top, 0.0)
    values = np.tile([-below, -top, -top, top, top, top, top, -below], repeats)
    got = measure(torch.from_numpy(values), host_paths=reduction_path == "host")
    # In exact arithmetic (NumPy overflows) the std is within half an ulp of float64 max.
    entries = [Fraction(float(v)) for v in values[:8]]
    mean = sum(entries) / 8
    variance = sum((entry - mean) ** 2 for entry in entries) / 8
    half_ulp = (Fraction(float(top)) - Fraction(float(below))) / 2
    assert (
        (Fraction(float(top)) - half_ulp) ** 2 < variance < (Fraction(float(top)) + half_ulp) ** 2
    )
    assert got["std"] == MetricValue(top)
    assert got["mean"].value == pytest.approx(float(mean), rel=0, abs=1e-15 * top)


def test_subnormal_float64_values_keep_their_std(reduction_path: str) -> None:
    values = np.array([1e-310, 3e-310, 2e-310, 5e-310])
    got = measure(torch.from_numpy(values), host_paths=reduction_path == "host")
    scaled = values * 2.0**1000  # exact; NumPy's own std underflows to 0 on the unscaled values
    assert got["std"].value == pytest.approx(float(np.std(scaled)) / 2.0**1000, rel=1e-12)
    assert got["mean"].value == pytest.approx(float(np.mean(scaled)) / 2.0**1000, rel=1e-12)
    assert got["p25"].value == float(np.percentile(values, 25))


def test_non_contiguous_inputs(reduction_path: str) -> None:
    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(2))
    for view in (base.t(), base[::3, 1::2], base.expand(2, 64, 48)):
        assert_matches(
            measure(view, host_paths=reduction_path == "host"), view.contiguous().numpy()
        )


def test_leaves_the_tensor_and_autograd_alone(reduction_path: str) -> None:
    leaf = torch.randn(100, requires_grad=True)
    out = leaf * 2
    before = out.detach().clone()
    measure(out, host_paths=reduction_path == "host")
    assert torch.equal(out.detach(), before)
    out.sum().backward()
    assert leaf.grad is not None
    assert torch.equal(leaf.grad, torch.full((100,), 2.0))


def test_more_than_2_pow_24_elements_has_exact_quartiles(reduction_path: str) -> None:
    if reduction_path == "device":
        pytest.skip("the device path at this size: test_measurement_paths (with its histogram)")
    rng = np.random.default_rng(24)
    values = rng.standard_normal(2**24 + 3, dtype=np.float32)
    values[rng.integers(0, values.size, 1000)] = np.nan
    got = measure(torch.from_numpy(values), host_paths=reduction_path == "host")
    finite = values[np.isfinite(values)].astype(np.float64)
    quartiles = np.percentile(finite, [25, 50, 75])  # one partition for all three
    assert [got[name].value for name in ("p25", "p50", "p75")] == quartiles.tolist()
    assert got["min"].value == float(finite.min())
    assert got["max"].value == float(finite.max())
    assert got["nonfinite_fraction"].value == float(values.size - finite.size) / values.size


def test_subset_reports_only_its_metrics(reduction_path: str) -> None:
    measurer = Measurer(
        [DefaultStatistics(("p75", "nonfinite_fraction", "mean"))],
        host_paths=reduction_path == "host",
    )
    tensor = torch.tensor([1.0, 2.0, math.nan, 4.0])
    got = measure(tensor, measurer)
    assert list(got) == ["p75", "nonfinite_fraction", "mean"]
    want = numpy_profile(tensor.numpy())
    assert {name: metric.value for name, metric in got.items()} == {
        name: want[name] for name in got
    }


def test_empty_profile_transfers_nothing(reduction_path: str) -> None:
    pending = Measurer([DefaultStatistics(())], host_paths=reduction_path == "host").launch(
        torch.randn(10)
    )
    assert pending.device_vector is None
    assert pending.resolve([]) == ()


def test_resolve_with_wrong_host_values_gives_reasons(reduction_path: str) -> None:
    measurer = Measurer(None, host_paths=reduction_path == "host")
    pending = measurer.launch(torch.randn(10))
    got = pending.resolve([1.0] * 1000)
    assert len(got) == len(measurer.metrics)
    assert all(metric.value is None and metric.reason for metric in got)


def test_default_statistics_is_callable_on_its_own() -> None:
    values = DefaultStatistics(("mean", "p50", "min"))(torch.tensor([1.0, 3.0, math.nan]))
    assert values == {"mean": 2.0, "p50": 2.0, "min": 1.0}


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.int32, torch.bool], ids=str)
def test_device_path_never_syncs(dtype: torch.dtype) -> None:
    tensor = torch.tensor([1.0, math.nan, -2.0, 0.0, math.inf, 5.0]).to(dtype)

    class OnDevice:
        metrics = ("abs_max",)

        def __call__(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"abs_max": tensor.float().abs().amax()}

    measurer = Measurer([OnDevice()], host_paths=False)
    with NoHostSync() as mode:
        pending = measurer.launch(tensor)
    assert mode.violations == []
    assert pending.device_vector is not None
    got = pending.resolve(pending.device_vector.tolist())
    assert all(metric.reason is None or "error" not in metric.reason for metric in got), [
        metric.reason for metric in got
    ]


float_arrays = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9),
    elements={"allow_nan": True, "allow_infinity": True, "allow_subnormal": True},
)


# 60 drawn arrays a path (each costs the sync-free path tens of ms on the CPU), with the edges
# hypothesis shrinks to given outright; test_measurement_paths draws 60 more a path.
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=float_arrays)
@example(values=np.zeros((0, 3), dtype=np.float32))  # empty
@example(values=np.array(np.nan, dtype=np.float16))  # 0-d, not finite
@example(values=np.array([-0.0, 0.0, 5e-324, np.inf]))  # signed zeros, a subnormal, inf
@example(values=np.array([1.7e308, -1.7e308, 1.7e308]))  # NumPy's std overflows
@example(values=np.full((2, 2), 65504.0, dtype=np.float16))  # float16's largest, constant
def test_arbitrary_arrays_match_numpy(reduction_path: str, values: np.ndarray) -> None:
    tensor = torch.from_numpy(np.array(values))
    got = measure(tensor, host_paths=reduction_path == "host")
    if values.size == 0:
        assert all(metric == MetricValue(None, "empty tensor") for metric in got.values())
        return
    reference_values = as_reference(tensor).astype(np.float64)
    finite = reference_values[np.isfinite(reference_values)]
    with np.errstate(over="ignore"):
        overflowing = finite.size and not np.isfinite(np.std(finite))
    if overflowing:  # NumPy itself overflows here; ours stays finite or null with a reason
        check_invariants(got)
        return
    assert_matches(got, reference_values)
