"""The one derivation of the default metrics from a raw profile (`numerics.profile_metrics`).

Every path (the lane, the host path, the general path after its transfer, the global statistics)
hands its raw profile, `numerics.RAW` (seven statistics of the finite entries, then the counts of
zeros and of finite entries), to this one function. These tests hold it to values worked out by
hand: the fractions from the counts, nulls and their reasons, -0.0, the order of a subset.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from torchinstruments import reasons
from torchinstruments.measurement import numerics
from torchinstruments.measurement.reducers import DEFAULT_METRICS


def row(*values: float) -> list[float]:
    """One raw profile, checked to have a value per `numerics.RAW` column."""
    assert len(values) == len(numerics.RAW)
    return list(values)


def test_the_raw_columns_are_the_seven_finite_statistics_then_zeros_and_finite_counts() -> None:
    assert numerics.RAW == ("mean", "std", "min", "max", "p25", "p50", "p75", "zeros", "finite")
    assert DEFAULT_METRICS[:7] == numerics.RAW[:7]


def test_fractions_come_from_the_counts_and_the_statistics_pass_through() -> None:
    # 8 entries: 2 zeros, 6 finite (so 2 are NaN or inf).
    raw = np.array([row(0.5, 2.0, -1.0, 3.0, -0.25, 0.5, 1.5, 2.0, 6.0)])
    values, why = numerics.profile_metrics(raw, np.array([8]), DEFAULT_METRICS)
    assert values == [0.5, 2.0, -1.0, 3.0, -0.25, 0.5, 1.5, 2 / 8, (8 - 6) / 8]
    assert why == [None] * 9


def test_without_finite_entries_the_statistics_are_null_whatever_the_raw_values() -> None:
    # The general path's raw values of an all-NaN tensor are not NaN themselves (its order
    # statistics read the +inf it put in their place): the count decides, not the values.
    raw = np.array([row(0.0, 0.0, math.inf, math.inf, math.inf, math.inf, math.inf, 0.0, 0.0)])
    values, why = numerics.profile_metrics(raw, np.array([4]), DEFAULT_METRICS)
    assert values == [None] * 7 + [0.0, 1.0]
    assert why == [reasons.NO_FINITE] * 7 + [None, None]


def test_a_statistic_that_overflowed_is_null_as_a_non_finite_result() -> None:
    raw = np.array([row(math.inf, 1.0, -1e308, 1e308, 0.0, 1e308, 1e308, 1.0, 3.0)])
    values, why = numerics.profile_metrics(raw, np.array([3]), ("mean", "std", "p25"))
    assert values == [None, 1.0, 0.0]
    assert why == [reasons.NON_FINITE_RESULT, None, None]


def test_a_std_rounded_past_the_largest_magnitude_is_that_magnitude() -> None:
    """A population std never exceeds the largest magnitude of the entries (it is at most half
    their range): a std that rounding took past it (to inf, at +-float64 max) is capped there."""
    raw = np.array([row(0.0, math.inf, -1e308, 1e307, 0.0, 0.0, 0.0, 1.0, 3.0)])
    values, why = numerics.profile_metrics(raw, np.array([3]), ("std",))
    assert values == [1e308]
    assert why == [None]


def test_negative_zero_is_reported_as_zero() -> None:
    raw = np.array([row(-0.0, 0.0, -0.0, -0.0, -0.0, -0.0, -0.0, 1.0, 1.0)])
    values, _ = numerics.profile_metrics(raw, np.array([1]), DEFAULT_METRICS)
    assert all(math.copysign(1.0, value) == 1.0 for value in values if value is not None)


def test_a_subset_comes_in_the_order_asked_for_row_by_row() -> None:
    raw = np.array(
        [
            row(1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 2.0),
            row(math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, 0.0, 0.0),
        ]
    )
    values, why = numerics.profile_metrics(raw, np.array([2, 5]), ("nonfinite_fraction", "max"))
    assert values == [0.0, 1.0, 1.0, None]
    assert why == [None, None, None, reasons.NO_FINITE]


@pytest.mark.parametrize("metrics", [DEFAULT_METRICS, ("p50",), ("zero_fraction", "min")])
def test_one_tensor_by_name_is_the_same_derivation(metrics: tuple[str, ...]) -> None:
    values = row(math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, 3.0, 0.0)
    by_name = numerics.derived(dict(zip(numerics.RAW, values, strict=True)), 3, metrics)
    flat, why = numerics.profile_metrics(np.array([values]), np.array([3]), metrics)
    assert list(by_name) == list(metrics)
    assert [(m.value, m.reason) for m in by_name.values()] == list(zip(flat, why, strict=True))
