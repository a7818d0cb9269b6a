"""Histogram counts and edges against numpy.histogram on the same edges."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from torchinstruments.measurement import histograms
from torchinstruments.measurement.histograms import DEFAULT_BINS, HistogramVector
from torchinstruments.measurement.reducers import DefaultStatistics, Measurer
from torchinstruments.records import HistogramRecord, LayerInfo, TensorKey

from conftest import NoHostSync, measure

# Whether the NumPy path may count (the CPU's host path) or the sync-free general path counts.
HOST_PATHS = {"host": True, "sync_free": False}


@pytest.fixture(params=list(HOST_PATHS))
def counting_path(request: pytest.FixtureRequest) -> str:
    """Runs a test on the CPU's host path and on the sync-free (CUDA) path."""
    return request.param


def launch(tensor: torch.Tensor, path: str, bins: int) -> HistogramVector | None:
    """A histogram alone (no metrics), as a focus layer's is launched, on `path`."""
    measurer = Measurer([DefaultStatistics(())], host_paths=HOST_PATHS[path])
    return measurer.launch_with_histogram(tensor, bins)[1]


def histogram(tensor: torch.Tensor, path: str, bins: int = DEFAULT_BINS) -> HistogramRecord | None:
    """Both halves, as the engine runs them, on `path` (a `HOST_PATHS` key)."""
    vector = launch(tensor, path, bins)
    if vector is None:
        return None
    host = vector.tolist() if isinstance(vector, torch.Tensor) else vector
    key = TensorKey(3, 3, LayerInfo("fc", "Linear"), 1, "output", "[0]", "train", True)
    return histograms.record(host, bins, key, "output")


def assert_consistent(record: HistogramRecord, values: np.ndarray) -> None:
    """Counts equal numpy.histogram's on our edges; edges and totals describe the finite values."""
    finite = values.astype(np.float64).ravel()
    finite = finite[np.isfinite(finite)]
    assert record.num == finite.size
    assert sum(record.bucket_counts) == finite.size
    assert record.min == finite.min()
    assert record.max == finite.max()
    assert record.sum == pytest.approx(float(finite.sum()), rel=1e-9, abs=1e-300)
    assert record.sum_squares == pytest.approx(float(np.dot(finite, finite)), rel=1e-9, abs=1e-300)
    if record.min == record.max:
        return
    edges = np.array([record.min, *record.bucket_limits])
    assert edges[-1] == record.max
    assert np.all(np.diff(edges) >= 0)
    want, _ = np.histogram(finite, bins=edges)
    assert list(record.bucket_counts) == want.astype(float).tolist()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str
)
def test_counts_match_numpy(counting_path: str, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(10_000)
    values[:50] = np.nan
    values[50:60] = np.inf
    tensor = torch.from_numpy(values).to(dtype)
    record = histogram(tensor, counting_path)
    assert record is not None
    assert len(record.bucket_limits) == len(record.bucket_counts) == DEFAULT_BINS
    assert_consistent(record, tensor.to(torch.float64).numpy())
    assert (record.sample_id, record.layer, record.call_index) == (3, "fc", 1)
    assert (record.signal, record.tensor_path) == ("output", "[0]")


def test_edges_are_equally_spaced_and_max_falls_in_the_last_bin(counting_path: str) -> None:
    record = histogram(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]), counting_path, bins=4)
    assert record is not None
    assert record.bucket_limits == (1.0, 2.0, 3.0, 4.0)
    assert record.bucket_counts == (1.0, 1.0, 1.0, 2.0)


def test_constant_tensor_has_one_narrow_bin(counting_path: str) -> None:
    record = histogram(torch.full((7,), -2.5), counting_path)
    assert record is not None
    assert record.bucket_counts == (7.0,)
    assert record.min == record.max == -2.5
    assert len(record.bucket_limits) == 1
    assert -2.5 < record.bucket_limits[0] < -2.5 + 1e-3


@pytest.mark.parametrize("values", [[math.nan, math.inf], [-math.inf], [math.nan]])
def test_no_finite_entries_gives_none(counting_path: str, values: list[float]) -> None:
    assert histogram(torch.tensor(values), counting_path) is None


@pytest.mark.parametrize(
    "tensor",
    [torch.zeros(0), torch.ones(3, dtype=torch.complex64), torch.eye(3).to_sparse()],
    ids=["empty", "complex", "sparse"],
)
def test_unsupported_or_empty_gives_none(counting_path: str, tensor: torch.Tensor) -> None:
    assert histogram(tensor, counting_path) is None


def test_integers_and_bools(counting_path: str) -> None:
    ints = torch.tensor([1, 5, 5, -3, 9])
    record = histogram(ints, counting_path, bins=3)
    assert record is not None
    assert_consistent(record, ints.numpy())
    flags = histogram(torch.tensor([True, False, True]), counting_path, bins=2)
    assert flags is not None
    assert flags.bucket_counts == (1.0, 2.0)


def test_extreme_float64_range_stays_consistent(counting_path: str) -> None:
    values = np.array([-1.7e308, 1.7e308, 0.0, 1e308, -5.0])
    record = histogram(torch.from_numpy(values), counting_path, bins=8)
    assert record is not None
    finite = values
    edges = np.array([record.min, *record.bucket_limits])
    assert np.all(np.isfinite(edges))
    want, _ = np.histogram(finite, bins=edges)
    assert list(record.bucket_counts) == want.astype(float).tolist()


def test_bins_a_few_ulps_wide_stay_consistent(counting_path: str) -> None:
    start = 1e6
    values = np.array([start + k * np.spacing(start) for k in range(5)] * 3)
    record = histogram(torch.from_numpy(values), counting_path, bins=64)
    assert record is not None
    assert_consistent(record, values)


def test_counting_never_syncs(counting_path: str) -> None:
    if counting_path == "host":
        pytest.skip("the host path runs only where host syncs are free (the CPU)")
    tensor = torch.tensor([1.0, math.nan, -2.0, 0.0, math.inf, 5.0])
    with NoHostSync() as mode:
        pending = launch(tensor, counting_path, 4)
    assert mode.violations == []
    assert isinstance(pending, torch.Tensor)  # on the device until the sample's transfer
    record = histogram(tensor, counting_path, 4)
    assert record is not None
    assert record.num == 4.0


# 40 drawn arrays a path (each costs the sync-free path tens of ms on the CPU), with the edges
# hypothesis shrinks to given outright; test_measurement_paths draws 60 more a path, with
# histograms, against numpy.histogram on every reduction path.
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64]),
        shape=st.integers(1, 200),
        elements={"allow_nan": True, "allow_infinity": True},
    ),
    bins=st.integers(1, 70),
)
@example(values=np.array([np.nan, np.inf, -np.inf]), bins=3)  # no finite entry: no record
@example(values=np.array([0.0], dtype=np.float32), bins=1)  # one entry, one bin
@example(values=np.array([-0.0, 0.0, 5e-324, np.nan]), bins=70)  # signed zeros, a subnormal
@example(values=np.array([1e308, -1e308, 1.0]), bins=2)  # sums that overflow float64
def test_arbitrary_arrays_match_numpy(counting_path: str, values: np.ndarray, bins: int) -> None:
    record = histogram(torch.from_numpy(values), counting_path, bins)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        assert record is None
        return
    assert record is not None
    if record.min != record.max:
        assert len(record.bucket_counts) == bins
    with np.errstate(over="ignore"):
        if not np.isfinite(np.dot(finite.astype(np.float64), finite.astype(np.float64))):
            return  # sums overflow float64; the counts are what this test is about
    assert_consistent(record, values)


def test_entries_near_the_float32_limits_that_cancel_give_numpys_sum_and_mean(
    counting_path: str,
) -> None:
    """-3.4028222e38 and 3.4028229e38 among zeros sum to about 6.08e31: each entry's deviation
    from the mean rounds to the entry's precision (about 4e22), so a sum of the deviations was
    off by 1.7e-9 of the sum on the general path (found by the test above); the histogram's sum
    and the mean are NumPy's float64 ones."""
    values = np.zeros(13, dtype=np.float32)
    values[:2] = np.float32(-3.4028222e38), np.float32(3.4028229e38)
    wide = values.astype(np.float64)
    record = histogram(torch.from_numpy(values), counting_path, 1)
    assert record is not None
    assert record.sum == pytest.approx(float(wide.sum()), rel=1e-12)
    got = measure(torch.from_numpy(values), host_paths=counting_path == "host")
    assert got["mean"].value == pytest.approx(float(wide.mean()), rel=1e-12)


def test_host_edges_equal_the_device_edges_bit_for_bit() -> None:
    """The CPU paths and the general path report the same float64 edges (`histograms.edges` runs
    the same IEEE operations on floats in NumPy and on tensors in torch)."""
    import random
    import struct

    rng = random.Random(5)
    pairs = [(-1.0, 1.0), (0.0, 0.0), (-0.0, 0.0), (1e-300, 1e300), (-3.5, -3.5 + 1e-12)]
    pairs += [tuple(sorted((rng.uniform(-1e6, 1e6), rng.uniform(-1e6, 1e6)))) for _ in range(200)]
    for low, high in pairs:
        for bins in (1, 7, 64):
            host = histograms.edges(low, high, bins).tolist()
            low_t = torch.tensor(low, dtype=torch.float64)
            device = histograms.edges(low_t, torch.tensor(high, dtype=torch.float64), bins).tolist()
            pack = [struct.pack("<d", v) for v in host]
            assert pack == [struct.pack("<d", v) for v in device], (low, high, bins)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64]),
        shape=st.integers(1, 40),
        elements={"allow_nan": True, "allow_infinity": True},
    ),
    bins=st.integers(1, 70),
)
def test_arrays_above_the_sort_limit_match_numpy(values: np.ndarray, bins: int) -> None:
    """Above `order.SMALL` entries the host path bins by an arithmetic guess (checked on the
    limits, corrected where it misses one): the counts are still numpy.histogram's."""
    from torchinstruments.measurement import order

    big = np.resize(values, order.SMALL + 1 + values.size)
    record = histogram(torch.from_numpy(big), "host", bins)
    if not np.isfinite(values).any():
        assert record is None
        return
    assert record is not None
    counts = np.array(record.bucket_counts)
    if record.min != record.max:
        edges = np.array([record.min, *record.bucket_limits])
        finite = big[np.isfinite(big)].astype(np.float64)
        assert counts.tolist() == np.histogram(finite, bins=edges)[0].astype(float).tolist()


@pytest.mark.parametrize("scale", [1.0, 0.1, 1 / 3, 1e-30])
def test_values_on_the_edges_are_binned_as_numpy_bins_them(scale: float) -> None:
    """Integers (times `scale`) put many values exactly on an edge, where the guess can miss."""
    rng = np.random.default_rng(3)
    values = (rng.integers(-1000, 1001, 100_000) * scale).astype(np.float32)
    for bins in (7, 64, 2000):
        record = histogram(torch.from_numpy(values), "host", bins)
        assert record is not None
        assert_consistent(record, values)


@pytest.mark.parametrize("bins", [1, 7, 64])
def test_a_range_wider_than_float64_is_still_counted(bins: int) -> None:
    """max - min overflows float64 (here by rounding: -DBL_MAX to 2**970), so the host path's
    arithmetic guess has no scale: it bisects instead of dropping the histogram."""
    from torchinstruments.measurement import order

    pair = np.array([-np.finfo(np.float64).max, 2.0**970])
    values = np.resize(pair, order.SMALL + 3)
    record = histogram(torch.from_numpy(values), "host", bins)
    assert record is not None
    assert_consistent(record, values)


@pytest.mark.parametrize("bins", [3, 64, 300])
@pytest.mark.parametrize("size", [65_536 + 1, 2 * 65_536 + 7, 40_001])
def test_entries_counted_in_pairs_match_numpy_with_an_odd_last_chunk(bins: int, size: int) -> None:
    """The host path counts unsorted entries two at a time (one counter per pair of bins, up to
    a bound on the bins: 300 are counted one at a time); a chunk of odd size has its last entry
    counted alone. Runs of one bin (a ReLU's zeros) and the max (the last bin's) included."""
    rng = np.random.default_rng(size + bins)
    values = np.maximum(rng.standard_normal(size), 0.0).astype(np.float32)
    values[-1] = values.max() + 1.0
    record = histogram(torch.from_numpy(values), "host", bins)
    assert record is not None
    edges = np.array([record.min, *record.bucket_limits])
    want = np.histogram(values.astype(np.float64), bins=edges)[0].astype(float).tolist()
    assert list(record.bucket_counts) == want
    assert sum(record.bucket_counts) == size


@pytest.mark.parametrize(
    "kind", ["normal", "relu", "uniform", "offset", "tiny", "normal float64", "offset float64"]
)
def test_the_bin_guess_misses_no_float32_limit_and_a_float64_one_by_a_bin(kind: str) -> None:
    """The unsorted host path guesses each entry's bin arithmetically and reads, on every limit,
    how far the guess can miss, then moves every entry one bin nearer its own that many times.
    With the scale rounded to nearest, 6 to 25% of float32 tensors missed by one (every entry
    checked twice); rounded up, none of 300 per kind. float64 ones can miss by one (the value
    below a limit is closer than the guess resolves): one check. Counts: the tests above."""
    rng = np.random.default_rng(11)
    draws = {
        "normal": lambda: rng.standard_normal(4096) * rng.uniform(0.01, 100),
        "relu": lambda: np.maximum(rng.standard_normal(4096), 0.0),
        "uniform": lambda: rng.uniform(-1.0, 1.0, 4096),
        "offset": lambda: 1000.0 + rng.standard_normal(4096),
        "tiny": lambda: rng.standard_normal(4096) * 1e-30,
    }
    name, _, wide = kind.partition(" ")
    dtype = np.float64 if wide else np.float32
    for _ in range(300):
        values = draws[name]().astype(dtype)
        low, high = float(values.min()), float(values.max())
        limits = histograms.thresholds(histograms.edges(low, high, DEFAULT_BINS), dtype)
        _, off = histograms.guess_scale(limits, low, high - low, DEFAULT_BINS)
        assert off <= (1 if wide else 0), (kind, low, high, off)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bins", [1, 2, 64, 300])
def test_a_guess_that_misses_is_moved_onto_numpys_bins(dtype: type, bins: int) -> None:
    """Entries on and one value below every edge (where a guess misses, if anywhere), counted by
    the unsorted host path, fall in numpy.histogram's bins on the same edges."""
    rng = np.random.default_rng(bins)
    values = (rng.standard_normal(20_000) * 3.0 + 0.5).astype(dtype)
    low, high = float(values.min()), float(values.max())
    limits = histograms.thresholds(histograms.edges(low, high, bins), dtype)
    beside = np.nextafter(limits, np.array(-np.inf, dtype=dtype))
    values = np.concatenate([values, np.repeat(limits, 3), np.repeat(beside, 3)]).astype(dtype)
    rng.shuffle(values)
    bounds = histograms.edges(low, high, bins)
    counts = histograms.bin_counts(values, bounds, bins)
    want = np.histogram(values.astype(np.float64), bins=bounds)[0]
    assert counts.tolist() == want.astype(float).tolist()
