"""The small-tensor lane: the same numbers as the general path, bit for bit, in fewer objects.

The lane (`measurement/lane.py`) measures a sample's small float32 CPU tensors together as
arrays (`numerics.sorted_profiles`, the host path's arithmetic) and records them as a
`MeasurementBlock`. These tests hold it to the general path's values (the NumPy path followed by
`numerics.derived`, itself held to NumPy elsewhere), sorting its copies or, where the CPU sorts
slowly (`select`), selecting their order statistics as the host path then does; to the rows the
general path writes for a whole run, and to its reason for existing: few objects for the garbage
collector per measured tensor.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from torchinstruments.measurement import histograms, lane, numerics, order
from torchinstruments.measurement.reducers import DEFAULT_METRICS
from torchinstruments.records import (
    MetricValue,
)

from _lane_bits import as_record, same_bits, same_record_bits
from conftest import numpy_profile
from hook_reference import run_both

SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0]


def general_path(copies: list[np.ndarray], select: bool = False) -> list[dict[str, MetricValue]]:
    """The default profiles of the copies as the NumPy path and its deriver give them, one
    tensor at a time (each within one moments chunk, as the lane's batch is)."""
    return [
        numerics.derived(
            numerics.measure_on_cpu(torch.from_numpy(copy), None, select).raw,
            copy.size,
            DEFAULT_METRICS,
        )
        for copy in copies
    ]


def lane_rows(
    copies: list[np.ndarray], metrics: tuple[str, ...], select: bool = False
) -> list[dict[str, MetricValue]]:
    values, why, _ = lane.measure(copies, metrics, [False] * len(copies), 64, None, select)
    k = len(metrics)
    return [
        {m: MetricValue(values[i * k + j], why[i * k + j]) for j, m in enumerate(metrics)}
        for i in range(len(copies))
    ]


segments = st.lists(
    st.lists(
        st.one_of(st.sampled_from(SPECIAL), st.floats(width=32, allow_nan=True)),
        min_size=1,
        max_size=80,
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segments)
def test_the_lane_gives_the_general_paths_values_bit_for_bit(data: list[list[float]]) -> None:
    copies = [np.array(segment, dtype=np.float32) for segment in data]
    expected = general_path(copies)
    for copy, got, want in zip(copies, lane_rows(copies, DEFAULT_METRICS), expected, strict=True):
        for metric in DEFAULT_METRICS:
            assert same_bits(got[metric], want[metric]), (metric, copy, got[metric], want[metric])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segments, st.data())
@example([[2.5] * 5, [math.nan, math.inf, -math.inf], [0.0, -0.0, 0.0], [-0.0]], None)
@example([[7.0], [math.nan, -3.0, math.inf, -3.0], [math.inf], [1e-45, -1e-45]], None)
def test_a_focus_copys_histogram_is_the_host_paths_bit_for_bit(
    data: list[list[float]], draw: st.DataObject | None
) -> None:
    """The focus copies' histograms from the lane's sorted segments: the records the one-tensor
    host path (`numerics.measure_on_cpu`, what a focus layer's small tensor took before) gives;
    no histogram where there is no finite entry; none for the other copies."""
    copies = [np.array(segment, dtype=np.float32) for segment in data]
    focus = (
        [True] * len(copies)
        if draw is None
        else draw.draw(st.lists(st.booleans(), min_size=len(copies), max_size=len(copies)))
    )
    values, why, vectors = lane.measure(copies, DEFAULT_METRICS, focus, 64)
    assert (values, why) == lane.measure(copies, DEFAULT_METRICS, [False] * len(copies), 64)[:2]
    for copy, chosen, vector in zip(copies, focus, vectors, strict=True):
        if not chosen:
            assert vector is None
            continue
        host = numerics.measure_on_cpu(torch.from_numpy(copy), 64).histogram
        assert (vector is None) == (not np.isfinite(copy).any()), copy
        if vector is not None:
            assert np.array(vector).tobytes() == np.array(host).tobytes(), copy
        assert same_record_bits(as_record(vector), as_record(host)), copy


def long_copy(size: int, seed: int, kind: str) -> np.ndarray:
    """A copy of `size` entries: normal, a ReLU's (half of it zeros, some -0.0), few distinct
    values, or normal with special values mixed in."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(size).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 4))
    if kind == "relu":
        values = np.maximum(values, np.float32(0))
        values[rng.integers(0, size, size // 50)] = -0.0
    elif kind == "ties":
        values = rng.integers(-3, 4, size).astype(np.float32)
    elif kind == "special":
        values[rng.integers(0, size, 1 + size // 20)] = rng.choice(np.array(SPECIAL, np.float32))
    return values


long_copies = st.lists(
    st.tuples(  # sorted and, with `select`, selected ones (above `order.SORTED_UP_TO`)
        st.integers(order.SORTED_UP_TO // 2, 3 * order.SORTED_UP_TO),
        st.integers(0, 2**32 - 1),
        st.sampled_from(["normal", "relu", "ties", "special"]),
    ),
    min_size=1,
    max_size=5,
)


@pytest.mark.parametrize("select", [False, True], ids=["sorted", "selected"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(long_copies, st.data())
@example([(order.SORTED_UP_TO, 1, "special"), (order.SORTED_UP_TO + 1, 2, "relu")], None)
@example([(order.SORTED_UP_TO + 1, 3, "ties"), (2 * order.SORTED_UP_TO, 4, "special")], None)
def test_long_copies_measured_together_give_the_host_paths_bits(
    select: bool, specs: list[tuple[int, int, str]], data: st.DataObject | None
) -> None:
    """Copies sorted one by one, or with `select` those above `order.SORTED_UP_TO` entries
    selected (a batch of their own), measured in one vectorised pass: the host path's values,
    reasons and histograms, bit for bit, alone and among others; a selected copy is left as it
    was given."""
    copies = [long_copy(*spec) for spec in specs]
    focus = [data is None or data.draw(st.booleans()) for _ in copies]
    expected = general_path(copies, select)
    hosts = [numerics.measure_on_cpu(torch.from_numpy(c), 64, select) for c in copies]
    k = len(DEFAULT_METRICS)
    given = [copy.copy() for copy in copies]
    measured = lane.measure(given, DEFAULT_METRICS, focus, 64, None, select)
    for index, copy in enumerate(copies):
        one = focus[index : index + 1]
        alone = lane.measure([copy.copy()], DEFAULT_METRICS, one, 64, None, select)
        together = [part[index * k : (index + 1) * k] for part in measured[:2]]
        assert np.array(alone[0], np.float64).tobytes() == np.array(together[0]).tobytes()
        assert alone[1] == together[1]
        assert alone[2][0] == measured[2][index]
        selected = select and copy.size > order.SORTED_UP_TO
        assert np.array_equal(given[index], copy if selected else np.sort(copy), equal_nan=True)
    values, why, vectors = measured
    for index, want in enumerate(expected):
        for j, metric in enumerate(DEFAULT_METRICS):
            got = MetricValue(values[index * k + j], why[index * k + j])
            assert same_bits(got, want[metric]), (metric, specs[index], got, want[metric])
        host = hosts[index].histogram if focus[index] and hosts[index].raw["finite"] else None
        assert (vectors[index] is None) == (host is None)
        if host is not None:
            assert np.array(vectors[index]).tobytes() == np.array(host).tobytes()


def test_a_tensors_moments_are_the_same_bits_alone_and_within_a_batch() -> None:
    """`segment_sums` cuts a batch into chunks only where it would cut each tensor alone, also
    for tensors longer than a chunk and chunks holding several tensors."""
    rng = np.random.default_rng(5)
    sizes = [3, numerics.CHUNK + 17, 5, 2 * numerics.CHUNK, 20_000, 40_000, 1, numerics.CHUNK]
    parts = [rng.standard_normal(size).astype(np.float32) * 100 for size in sizes]
    shifts = np.array([float(part[part.size // 2]) for part in parts])
    counts = np.array(sizes)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    batch = numerics.segment_sums(np.concatenate(parts), starts, counts, shifts)
    for index, part in enumerate(parts):
        alone = numerics.segment_sums(
            part, np.array([0]), counts[index : index + 1], shifts[index : index + 1]
        )
        for got, want in zip(batch[1:3], alone[1:3], strict=True):
            assert got[index].tobytes() == want[0].tobytes(), sizes[index]


def test_a_histogram_that_fails_is_none_and_the_values_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object) -> object:
        raise RuntimeError("histogram broke")

    copies = [np.array([1.0, 2.0], dtype=np.float32), np.array([3.0], dtype=np.float32)]
    expected = lane.measure(copies, ("mean",), [True, False], 64)[:2]
    monkeypatch.setattr(histograms, "histogram_vector", broken)
    assert lane.measure(copies, ("mean",), [True, False], 64) == (*expected, [None, None])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segments, st.data())
def test_a_copy_gives_the_same_bits_alone_and_among_others(
    data: list[list[float]], draw: st.DataObject
) -> None:
    """Many short copies are read by masks over them all, one alone by bisection, and the
    moments' chunks cut a batch where they would cut each copy alone: the values, reasons and
    histogram vectors of a copy are the same bits either way."""
    copies = [np.array(segment, dtype=np.float32) for segment in data]
    focus = draw.draw(st.lists(st.booleans(), min_size=len(copies), max_size=len(copies)))
    batch = lane.measure([copy.copy() for copy in copies], DEFAULT_METRICS, focus, 64)
    k = len(DEFAULT_METRICS)
    for index, (copy, one) in enumerate(zip(copies, focus, strict=True)):
        values, why, (vector,) = lane.measure([copy.copy()], DEFAULT_METRICS, [one], 64)
        together = batch[0][index * k : (index + 1) * k]
        assert np.array(values, np.float64).tobytes() == np.array(together, np.float64).tobytes()
        assert why == batch[1][index * k : (index + 1) * k]
        got, want = (
            None if v is None else np.array(v).tobytes() for v in (vector, batch[2][index])
        )
        assert got == want


@pytest.mark.parametrize("select", [False, True], ids=["sorted", "selected"])
def test_the_lane_matches_numpy_on_tensors_of_every_size_up_to_the_batch_limit(
    select: bool,
) -> None:
    rng = np.random.default_rng(0)
    copies = [
        (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
        for size in (1, 2, 3, 7, 64, 513, lane.BATCH_MAX)
    ]
    copies[3][[0, 4]] = 0.0
    for copy, got in zip(copies, lane_rows(copies, DEFAULT_METRICS, select), strict=True):
        want = numpy_profile(copy)
        for metric in DEFAULT_METRICS:
            assert got[metric].value == pytest.approx(want[metric], rel=1e-6, abs=1e-7), metric


def test_where_this_cpu_sorts_slowly_a_run_selects_and_matches_plain_hooks(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With selection quicker than the sort (as on a CPU without a fast SIMD sort), an MLP's
    lane copies of 64 x 256 entries are never sorted whole (a spy on NumPy's sort sees at most
    `order.SORTED_UP_TO` entries at a time), and the rows are plain hooks' values."""
    monkeypatch.setattr(order, "selection_is_quicker", lambda: True)
    sorted_sizes: list[int] = []
    original = np.sort

    def spy(values: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        sorted_sizes.append(np.size(values))
        return original(values, *args, **kwargs)

    monkeypatch.setattr(np, "sort", spy)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh())

    def step(observed: nn.Module, _: int) -> torch.Tensor:
        output = observed(torch.randn(64, 256))
        output.square().mean().backward()
        return output

    conformance = run_both(model, step, run_dir, steps=2)
    conformance.assert_conforms()
    assert sorted_sizes, "the spy sees the buckets' sorts"
    assert max(sorted_sizes) <= order.SORTED_UP_TO


def test_a_subset_of_metrics_comes_in_the_order_asked() -> None:
    copies = [np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)]
    (got,) = lane_rows(copies, ("p75", "zero_fraction", "mean"))
    assert list(got) == ["p75", "zero_fraction", "mean"]
    assert [v.value for v in got.values()] == [3.25, 0.0, 2.5]


def test_no_finite_entry_and_overflow_are_nulls_with_their_reasons() -> None:
    copies = [
        np.array([math.nan, math.inf], dtype=np.float32),
        np.array([3e38, -3e38, 3e38, -3e38], dtype=np.float32),
    ]
    nothing, huge = lane_rows(copies, DEFAULT_METRICS)
    assert nothing["mean"] == MetricValue(None, "no finite entries")
    assert nothing["p50"] == MetricValue(None, "no finite entries")
    assert nothing["nonfinite_fraction"] == MetricValue(1.0)
    assert nothing["zero_fraction"] == MetricValue(0.0)
    assert huge == general_path(copies)[1]  # float64 holds float32 squares: no overflow here


def test_a_failing_batch_measures_each_copy_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    original = numerics.sorted_profiles

    def breaks_on_the_marked_copy(copies: list[np.ndarray], *args: Any) -> object:
        if any(copy[0] == 12345.0 for copy in copies):
            raise RuntimeError("this tensor broke")
        return original(copies, *args)

    monkeypatch.setattr(numerics, "sorted_profiles", breaks_on_the_marked_copy)
    copies = [np.array([1.0, 2.0], dtype=np.float32), np.array([12345.0], dtype=np.float32)]
    good, bad = lane_rows(copies, ("mean", "max"))
    assert good == {"mean": MetricValue(1.5), "max": MetricValue(2.0)}
    assert {v.reason for v in bad.values()} == {"statistics error: RuntimeError: this tensor broke"}


def test_the_lane_takes_only_small_plain_float32_cpu_tensors() -> None:
    assert lane.takes(torch.randn(4, 8))
    assert lane.takes(torch.randn(8, 4, requires_grad=True).t())  # any strides
    assert not lane.takes(torch.randn(lane.BATCH_MAX + 1))  # selected, not sorted
    assert not lane.takes(torch.empty(0))
    assert not lane.takes(torch.randn(4, dtype=torch.float64))
    assert not lane.takes(torch.randn(4).to(torch.bfloat16))
    assert not lane.takes(torch.randn(4).to_sparse())
    assert not lane.takes(torch.randn(4).as_subclass(_Marked))


class _Marked(torch.Tensor):
    """A tensor subclass: measured through its own dispatch, by the general path."""


def test_the_copy_keeps_the_values_as_they_were() -> None:
    tensor = torch.arange(6.0).reshape(2, 3).t()
    copy = lane.copy_values(tensor)
    tensor.mul_(0)
    assert copy.shape == (3, 2)
    assert copy.ravel().tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
