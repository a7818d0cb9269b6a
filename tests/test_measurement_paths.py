"""Statistics and histograms of the same tensor on every reduction path, against NumPy.

Paths: the CPU as configured (`numerics.measure_on_cpu`: selection, or a sort of at most
`order.SMALL` entries), the same with tiny moment chunks (so a tensor spans many chunks), the
general path (forced on the CPU, as every non-CPU device runs it) and the general path on a tensor subclass
(`conftest.Wrapped`, which the fast paths hand over). Every metric is compared with NumPy (order
statistics and fractions exactly, moments to 1e-9) and every histogram bin with `numpy.histogram`
on the edges reported.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from torchinstruments.measurement import histograms, numerics, transfer
from torchinstruments.measurement.histograms import DEFAULT_BINS, HistogramVector
from torchinstruments.measurement.reducers import Measurer, PendingReduction
from torchinstruments.records import (
    HistogramRecord,
    LayerInfo,
    MeasurementBlock,
    MetricValue,
    TensorKey,
)
from torchinstruments.spare_core import SpareCore

from conftest import NoHostSync, Wrapped, assert_matches_numpy

PATHS = ("cpu", "cpu_chunked", "device", "subclass")
ORDER_METRICS = ("min", "max", "p25", "p50", "p75")


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Configures one reduction path for the test."""
    name = request.param
    if name.endswith("chunked"):
        monkeypatch.setattr(numerics, "CHUNK", 97)
    return name


def launch(path: str, tensor: torch.Tensor) -> tuple[PendingReduction, HistogramVector | None]:
    """Statistics and histogram of one tensor as the observer launches them (focus layer)."""
    measurer = Measurer(None, host_paths=path != "device")
    if path == "device":
        with NoHostSync() as mode:
            pending = measurer.launch_with_histogram(tensor)
        assert mode.violations == []
        return pending
    if path == "subclass":
        return measurer.launch_with_histogram(Wrapped(tensor))
    return measurer.launch_with_histogram(tensor)


def resolve(
    measurer: Measurer, reduction: PendingReduction, histogram: HistogramVector | None
) -> tuple[dict[str, MetricValue], HistogramRecord | None]:
    """Both halves, as `transfer.build_records` runs them."""
    vector = reduction.device_vector
    values = reduction.resolve([] if vector is None else vector.tolist())
    return dict(zip(measurer.metrics, values, strict=True)), as_record(histogram)


def as_record(histogram: HistogramVector | None) -> HistogramRecord | None:
    """A launched histogram vector's record, read on the host."""
    if histogram is None:
        return None
    host = histogram.tolist() if isinstance(histogram, torch.Tensor) else histogram
    key = TensorKey(0, 0, LayerInfo("fc", "Linear"), 0, "output", "", "train", True)
    return histograms.record(host, DEFAULT_BINS, key, "output")


def assert_histogram(record: HistogramRecord | None, values: np.ndarray) -> None:
    """Every bin equals numpy.histogram's on the reported edges."""
    finite = values.astype(np.float64).ravel()
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        assert record is None
        return
    assert record is not None
    assert record.num == finite.size
    assert (record.min, record.max) == (finite.min(), finite.max())
    # A float64 sum is exact only to its entries' magnitude (as the moments are in conftest's
    # assert_matches_numpy): [a, -a, 1e-266] has no more exact sum than its order of addition.
    tolerance = max(1e-300, 1e-12 * float(np.abs(finite).sum()))
    assert record.sum == pytest.approx(float(finite.sum()), rel=1e-9, abs=tolerance)
    squares = float(np.dot(finite, finite))
    assert record.sum_squares == pytest.approx(squares, rel=1e-9, abs=1e-300)
    if record.min == record.max:
        assert record.bucket_counts == (float(finite.size),)
        return
    edges = np.array([record.min, *record.bucket_limits])
    assert len(record.bucket_counts) == DEFAULT_BINS
    want, _ = np.histogram(finite, bins=edges)
    assert list(record.bucket_counts) == want.astype(float).tolist()


def reference(tensor: torch.Tensor) -> np.ndarray:
    """The values NumPy sees: half types after conversion to float32, integers as float64."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.to(torch.float32).numpy()
    if not tensor.dtype.is_floating_point:
        return tensor.to(torch.float64).numpy()
    return tensor.numpy()


def patterns(rng: np.random.Generator, n: int) -> Iterator[tuple[str, np.ndarray]]:
    """NaN/Inf mixes, subnormals, signed zeros, constants, heavy tails."""
    yield "normal", rng.standard_normal(n)
    yield "cauchy", rng.standard_cauchy(n)
    yield "relu", np.maximum(rng.standard_normal(n), 0.0)
    yield "constant", np.full(n, -3.25)
    yield "signed_zeros", rng.choice(np.array([0.0, -0.0, 1.5, -2.0]), n)
    yield "narrow", 1.0 + 1e-6 * rng.standard_normal(n)
    yield "subnormal32", rng.standard_normal(n) * 1e-41
    yield "subnormal64", rng.standard_normal(n) * 1e-310
    yield "huge64", rng.standard_normal(n) * 1e305
    mixed = rng.standard_normal(n)
    bad = rng.random(n) < 0.3
    mixed[bad] = rng.choice(np.array([np.nan, np.inf, -np.inf]), int(bad.sum()))
    yield "nonfinite_mix", mixed
    yield "all_nan", np.full(n, np.nan)


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


FLOAT64_ONLY = ("subnormal64", "huge64")
CASES = [
    (pattern, dtype)
    for pattern, _ in patterns(np.random.default_rng(0), 1)
    for dtype in DTYPES
    if pattern not in FLOAT64_ONLY or dtype == torch.float64
]


@pytest.mark.parametrize("n", [1, 3000])
@pytest.mark.parametrize(("pattern", "dtype"), CASES, ids=str)
def test_every_path_matches_numpy(path: str, dtype: torch.dtype, n: int, pattern: str) -> None:
    values = dict(patterns(np.random.default_rng(n), n))[pattern]
    tensor = torch.from_numpy(values).to(dtype)
    reduction, histogram = launch(path, tensor)
    got, record = resolve(Measurer(None), reduction, histogram)
    assert_matches_numpy(got, reference(tensor))
    with np.errstate(over="ignore"):
        if pattern != "huge64":  # sum of squares overflows float64 there, as in NumPy
            assert_histogram(record, reference(tensor))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_integers_on_every_path(path: str, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(7)
    tensor = torch.from_numpy(rng.integers(-50, 50, 4000)).to(dtype)
    reduction, histogram = launch(path, tensor)
    got, record = resolve(Measurer(None), reduction, histogram)
    assert_matches_numpy(got, reference(tensor))
    assert_histogram(record, reference(tensor))


def test_zeros_below_a_tiny_positive_edge_on_every_path(path: str) -> None:
    """A float64 inner edge between 0 and float32's smallest subnormal rounds to 0 in float32,
    yet zeros (of both signs) are below it: they belong to the bin that starts at the 0.0 edge."""
    tiny = 2.0**-149  # float32's smallest subnormal
    tensor = torch.tensor([-tiny, -0.0, 0.0, 0.0, tiny], dtype=torch.float32)
    reduction, histogram = launch(path, tensor)
    _, record = resolve(Measurer(None), reduction, histogram)
    assert record is not None
    assert 0.0 < record.bucket_limits[DEFAULT_BINS // 2] < tiny  # the tiny positive edge
    assert_histogram(record, reference(tensor))


def test_a_focus_histogram_is_counted_from_the_statistics_own_pass(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Statistics and histogram come from ONE call of the path's numerics: no path runs a
    histogram pass of its own."""
    calls: list[str] = []
    for name in ("measure_on_cpu", "raw_on_device"):

        def counted(
            *args: object, _name: str = name, _run: object = getattr(numerics, name)
        ) -> object:
            calls.append(_name)
            return _run(*args)  # type: ignore[operator]

        monkeypatch.setattr(numerics, name, counted)
    values = np.random.default_rng(5).standard_normal(3000).astype(np.float32)
    values[::7] = 0.0
    values[3] = np.nan
    reduction, histogram = launch(path, torch.from_numpy(values))
    assert len(calls) == 1, calls
    got, record = resolve(Measurer(None), reduction, histogram)
    assert_matches_numpy(got, values)
    assert_histogram(record, values)


def test_empty_tensor_on_every_path(path: str) -> None:
    reduction, histogram = launch(path, torch.zeros(0, 3))
    got, record = resolve(Measurer(None), reduction, histogram)
    assert all(metric == MetricValue(None, "empty tensor") for metric in got.values())
    assert record is None


@pytest.mark.parametrize("chunk", [numerics.CHUNK, 97], ids=["one_chunk", "segments_across_chunks"])
def test_a_samples_mixed_tensors_match_numpy_as_they_were_at_launch(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many small tensors of mixed dtypes, as one sampled forward's: each matches NumPy on its
    values at launch (also when the moments' chunks are tiny)."""
    monkeypatch.setattr(numerics, "CHUNK", chunk)
    rng = np.random.default_rng(11)
    batch: list[torch.Tensor] = []
    for index, (_, values) in enumerate(patterns(rng, 257)):
        dtype = DTYPES[index % len(DTYPES)]
        batch.append(torch.from_numpy(values).to(dtype))
    batch += [torch.zeros(0), torch.tensor([math.nan]), torch.arange(10, dtype=torch.int16)]
    measurer = Measurer(None)
    launched = [measurer.launch_with_histogram(t) for t in batch]
    before = [t.clone() for t in batch]
    for t in batch:  # later in-place changes must not reach what was measured at launch
        t.mul_(2) if t.is_floating_point() else None
    for tensor, original, (reduction, histogram) in zip(batch, before, launched, strict=True):
        got, record = resolve(measurer, reduction, histogram)
        if original.numel() == 0:
            assert record is None
            continue
        assert_matches_numpy(got, reference(original))
        if not np.isfinite(np.abs(reference(original)).astype(np.float64) ** 2).all():
            continue
        assert_histogram(record, reference(original))
        del tensor


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64, np.float16]),
        shape=st.integers(0, 400),
        elements={"allow_nan": True, "allow_infinity": True, "allow_subnormal": True},
    )
)
def test_arbitrary_arrays_on_every_path(path: str, values: np.ndarray) -> None:
    tensor = torch.from_numpy(values)
    reduction, histogram = launch(path, tensor)
    got, record = resolve(Measurer(None), reduction, histogram)
    if values.size == 0:
        assert record is None
        return
    finite = reference(tensor).astype(np.float64)
    finite = finite[np.isfinite(finite)]
    with np.errstate(over="ignore"):
        if finite.size and not np.isfinite(np.dot(finite, finite)):
            return  # NumPy's own sums overflow; the invariants are checked elsewhere
    assert_matches_numpy(got, reference(tensor))
    assert_histogram(record, reference(tensor))


@pytest.mark.parametrize("where", ["cpu", "device"])
def test_more_than_2_pow_24_entries_with_histogram(where: str) -> None:
    rng = np.random.default_rng(24)
    values = rng.standard_normal(2**24 + 5, dtype=np.float32)
    values[rng.integers(0, values.size, 1000)] = np.nan
    values[rng.integers(0, values.size, 10)] = -np.inf
    tensor = torch.from_numpy(values)
    got, record = resolve(Measurer(None), *launch(where, tensor))
    finite = values[np.isfinite(values)].astype(np.float64)
    quartiles = np.percentile(finite, [25, 50, 75])
    assert [got[name].value for name in ("p25", "p50", "p75")] == quartiles.tolist()
    assert (got["min"].value, got["max"].value) == (finite.min(), finite.max())
    assert got["nonfinite_fraction"].value == (values.size - finite.size) / values.size
    assert got["mean"].value == pytest.approx(float(finite.mean()), rel=1e-9, abs=1e-12)
    assert got["std"].value == pytest.approx(float(finite.std()), rel=1e-9)
    assert record is not None
    want, _ = np.histogram(finite, bins=np.array([record.min, *record.bucket_limits]))
    assert list(record.bucket_counts) == want.astype(float).tolist()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.int32], ids=str
)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_the_sort_path_never_writes_the_tensor(dtype: torch.dtype, layout: str) -> None:
    rng = np.random.default_rng(7)
    base = torch.from_numpy(rng.standard_normal((40, 30)) * 100).to(dtype)
    tensor = base if layout == "contiguous" else base[:, ::3]
    before = tensor.clone()
    got, record = resolve(Measurer(None), *launch("cpu", tensor))
    assert torch.equal(tensor, before)
    assert_matches_numpy(got, reference(tensor.contiguous()))
    assert_histogram(record, reference(tensor.contiguous()))


def test_the_samples_one_transfer_gives_each_tensor_its_own_values() -> None:
    """The general path's vectors of several tensors cross in one transfer
    (`transfer.build_records`, forced on the CPU as on a GPU): each row and histogram is its
    own tensor's."""
    measurer = Measurer(None, host_paths=False)
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(size).astype(np.float32) for size in (3000, 5, 700)]
    arrays[1][2] = np.nan
    items = []
    for index, array in enumerate(arrays):
        key = TensorKey(0, 0, LayerInfo(f"l{index}", "Linear"), 0, "output", "", "train", True)
        items.append(transfer.launch_tensor(measurer, key, torch.from_numpy(array), True))
    (record,) = transfer.build_records("output", items, measurer.metrics, None, SpareCore())
    block, k = record.measurements, len(measurer.metrics)
    assert isinstance(block, MeasurementBlock)
    for index, array in enumerate(arrays):
        row = zip(block.values[index * k :], block.reasons[index * k :], strict=False)
        got = {
            name: MetricValue(*value) for name, value in zip(measurer.metrics, row, strict=False)
        }
        assert_matches_numpy(got, array)
    assert [histogram.layer for histogram in record.histograms] == ["l0", "l1", "l2"]
    for histogram, array in zip(record.histograms, arrays, strict=True):
        assert_histogram(histogram, array)
