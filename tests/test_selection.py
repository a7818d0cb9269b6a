"""Order statistics by selection: exact quartiles at every size, and no full sort of a tensor.

The quartiles are pinned against `numpy.percentile` (linear interpolation) at 1e4 and 2e7
entries and on ties, NaN and ±inf mixes, on the host path and on the sync-free general path
(`Measurer(..., host_paths=False)`, what a GPU runs). A spy on every sort and partition of NumPy
and torch, and on `torch.quantile`, records the sizes of what they are given while tensors of
more than 1e5 entries are measured on every path: nothing larger than a bracket's few entries is
ever sorted, whatever the path (methods such as `ndarray.sort` are seen by a profile hook).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchinstruments.measurement import numerics, order
from torchinstruments.measurement.reducers import DefaultStatistics, Measurer

from conftest import measure


def selected(
    values: np.ndarray, ranks: list[int], chunk: int = 1 << 16, select: bool = False
) -> list[float]:
    """`order.HostSelection`'s entries of `values` at `ranks`, read in chunks as the moments'
    pass reads a tensor (`select`: as where this CPU sorts slowly, nothing sorted)."""
    selection = order.HostSelection(values, select)
    selection.want(ranks)
    for start in range(0, values.size, chunk):
        selection.visit(values[start : start + chunk])
    return selection.selected()


def quartiles(values: np.ndarray, host_paths: bool) -> list[float | None]:
    got = measure(torch.from_numpy(values), host_paths=host_paths)
    return [got[name].value for name in ("p25", "p50", "p75")]


def numpy_quartiles(values: np.ndarray) -> list[float]:
    finite = values[np.isfinite(values)].astype(np.float64)
    return (np.percentile(finite, [25, 50, 75], method="linear") + 0.0).tolist()


def mixes(rng: np.random.Generator) -> Iterator[tuple[str, np.ndarray]]:
    """Ties, NaN and ±inf mixed into values of both working dtypes."""
    for dtype in (np.float32, np.float64):
        ties = rng.integers(-3, 4, 10_001).astype(dtype)
        yield "ties", ties
        mixed = rng.standard_normal(10_000).astype(dtype)
        mixed[rng.integers(0, mixed.size, 700)] = np.nan
        mixed[rng.integers(0, mixed.size, 300)] = np.inf
        mixed[rng.integers(0, mixed.size, 300)] = -np.inf
        mixed[rng.integers(0, mixed.size, 500)] = 0.0
        mixed[rng.integers(0, mixed.size, 500)] = -0.0
        yield "nan_inf_zeros", mixed
        few = np.array([np.nan, 2.0, -np.inf, 2.0, np.inf, -1.0, np.nan], dtype=dtype)
        yield "few_finite", few
        extremes = rng.choice(
            np.array([np.finfo(dtype).max, -np.finfo(dtype).max, np.finfo(dtype).tiny, 0.0]),
            3_001,
        ).astype(dtype)
        yield "extremes", extremes


@pytest.mark.parametrize("host_paths", [True, False], ids=["host", "device"])
def test_quartiles_equal_numpy_percentile_at_1e4_and_on_mixes(host_paths: bool) -> None:
    rng = np.random.default_rng(27)
    cases = [("randn_1e4", rng.standard_normal(10_000).astype(np.float32)), *mixes(rng)]
    for name, values in cases:
        assert quartiles(values, host_paths) == numpy_quartiles(values), name


def test_quartiles_selected_where_the_cpu_sorts_slowly_equal_numpy_percentile() -> None:
    """The host path's `select` (what a CPU whose sort is slow runs up to `order.SMALL`
    entries): the same quartiles at 1e4 and on the mixes."""
    rng = np.random.default_rng(28)
    cases = [("randn_1e4", rng.standard_normal(10_000).astype(np.float32)), *mixes(rng)]
    for name, values in cases:
        raw = numerics.measure_array(values, None, select=True).raw
        assert [raw[p] + 0.0 for p in ("p25", "p50", "p75")] == numpy_quartiles(values), name


SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1.0, -1.0, 2.0, 3.4e38, -3.4e38, 1.2e-38, -1.2e-38]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([np.float32, np.float64]),
    st.lists(
        st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=False, allow_infinity=False)),
        min_size=1,
        max_size=60,
    ),
    st.integers(1, 4_000),
    st.integers(0, 2**32 - 1),
)
def test_select_gives_the_sorted_entries_at_any_ranks(
    dtype: type, pool: list[float], size: int, seed: int
) -> None:
    """`order.select` of finite values drawn from a pool (ties, signed zeros, subnormals,
    extremes; a few distinct values or many) at random ranks: `np.sort`'s entries."""
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        values = rng.choice(np.array(pool), size).astype(dtype)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return
    noise = rng.standard_normal(values.size).astype(dtype) * dtype(rng.choice([0.0, 1e-3, 1e3]))
    for drawn in (values, values + noise):
        ranks = rng.integers(0, drawn.size, 9)
        ranks[:2] = 0, drawn.size - 1
        got = order.select(drawn, ranks) + 0.0
        assert got.tobytes() == (np.sort(drawn)[ranks].astype(np.float64) + 0.0).tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [7, order._NARROW_UP_TO, order._NARROW_UP_TO + 1])
def test_the_device_selection_gives_the_sorted_entries_with_either_digit_width(
    dtype: torch.dtype, size: int
) -> None:
    """`order.on_device` counts 8 bits a pass on a CPU tensor of at most `_NARROW_UP_TO` entries
    and 16 above: both give `np.sort`'s entries, on ties, signed zeros, subnormals, extremes and
    non-finite entries left out by the mask."""
    rng = np.random.default_rng(size)
    pool = np.array([0.0, -0.0, 1e-45, -1e-45, 1.5, -2.5, 3.4e38, -3.4e38, np.nan, np.inf])
    values = torch.from_numpy(rng.choice(pool, size)).to(dtype)
    values[: size // 2] += torch.randn(size // 2, dtype=dtype)
    finite = torch.isfinite(values)
    kept = np.sort(values[finite].numpy()).astype(np.float64) + 0.0
    ranks = torch.from_numpy(rng.integers(0, kept.size, 9))
    ranks[:2] = torch.tensor([0, kept.size - 1])
    got = order.on_device(values, finite, ranks).double().numpy() + 0.0
    assert got.tobytes() == kept[ranks.numpy()].tobytes()
    assert order._digit_bits(values) == (8 if size <= order._NARROW_UP_TO else 16)


def test_quartiles_equal_numpy_percentile_at_2e7() -> None:
    rng = np.random.default_rng(7)
    values = rng.standard_normal(20_000_000, dtype=np.float32)
    values[rng.integers(0, values.size, 1000)] = np.nan
    values[rng.integers(0, values.size, 100)] = -np.inf
    assert quartiles(values, True) == numpy_quartiles(values)


@pytest.mark.parametrize("size", [300_000, 1_000_003])
def test_quartiles_equal_numpy_percentile_whatever_share_of_a_chunk_the_brackets_keep(
    size: int,
) -> None:
    """A tensor's brackets keep about 6.5% of each chunk here at 3e5 entries (a mask NumPy's
    nonzero would branch on: padded) and 5.5% at 1e6 (read as it is): both exact, with ties."""
    rng = np.random.default_rng(size)
    values = rng.standard_normal(size, dtype=np.float32)
    values[rng.integers(0, size, size // 10)] = 0.0
    values[rng.integers(0, size, size // 10)] = np.float32(0.5)
    assert quartiles(values, True) == numpy_quartiles(values)
    ranks = [0, size // 3, size // 2, size - 1]
    assert selected(values, ranks) == np.sort(values)[ranks].tolist()


@pytest.mark.parametrize("select", [False, True], ids=["sorted", "selected"])
def test_selection_brackets_that_miss_fall_back_exactly(select: bool) -> None:
    """Every sampled entry an outlier: each bracket misses its ranks, which are still exact."""
    pattern = np.tile(np.array([0.0, 1.0, 2.0, 3.0, 1e6], dtype=np.float32), 40_000)
    values = np.sort(pattern)[::-1].copy()
    values[order.sample_positions(values.size)] = -1e9
    ranks = [0, 50_000, 100_000, 100_001, 150_000, values.size - 1]
    assert selected(values, ranks, select=select) == np.sort(values)[ranks].tolist()


@pytest.mark.parametrize("select", [False, True], ids=["sorted", "selected"])
def test_overlapping_brackets_read_their_ranks_from_the_entries_they_share(select: bool) -> None:
    """Groups of ranks 2% of the size apart get brackets that overlap (each about 3% wide on a
    side here): the entries inside both are kept once, and every rank is still the sorted
    array's, read from the kept entries by its place among them."""
    rng = np.random.default_rng(5)
    size = order.SMALL + 1_001
    values = rng.standard_normal(size).astype(np.float32)
    step = size // 50
    ranks = [0, size // 4, size // 4 + step, size // 2, size // 2 + step, size // 2 + 2 * step]
    ranks += [size - 1]
    assert selected(values, ranks, select=select) == np.sort(values)[ranks].tolist()


def tied(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Values whose ties sit where the brackets' bounds fall."""
    normal = rng.standard_normal(size)
    return {
        "relu": np.maximum(normal, 0),
        "relu6": np.clip(normal * 4, 0, 6),
        "integers": rng.integers(-3, 4, size).astype(float),
        "two_values": rng.integers(0, 2, size).astype(float),
        "constant": np.full(size, 2.5),
        "a_third_ones": np.where(rng.random(size) < 0.3, 1.0, normal),
        "ascending": np.sort(normal),
        "millis": rng.integers(0, 1000, size) * 1e-3,
    }[kind]


@pytest.mark.parametrize(
    "kind",
    ["relu", "relu6", "integers", "two_values", "constant", "a_third_ones", "ascending", "millis"],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("select", [False, True], ids=["sorted", "selected"])
def test_brackets_are_exact_on_ties_at_their_bounds(kind: str, dtype: type, select: bool) -> None:
    """Above `order.SMALL` entries, ties at a bracket's bounds are counted, not copied: the
    ranks they hold, and every other, are still the sorted array's (kept entries sorted, or
    selected as where this CPU sorts slowly)."""
    rng = np.random.default_rng(len(kind))
    size = 3 * order.SMALL + 7
    values = tied(kind, size, rng).astype(dtype)
    ranks = [0, 1, size // 4, size // 4 + 1, size // 2, size // 2 + 1, 3 * size // 4]
    ranks += [3 * size // 4 + 1, size - 2, size - 1, *rng.integers(0, size, 4).tolist()]
    assert selected(values, ranks, select=select) == np.sort(values)[ranks].tolist()


@pytest.fixture
def sorted_sizes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Sizes of every input given to a sort, partition or torch.quantile while the test runs."""
    seen: list[int] = []

    def spy(original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(array: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(int(np.size(array)) if isinstance(array, np.ndarray) else array.numel())
            return original(array, *args, **kwargs)

        return recorded

    for name in ("sort", "argsort", "partition", "argpartition"):
        monkeypatch.setattr(np, name, spy(getattr(np, name)))
    for name in ("sort", "argsort", "msort", "quantile", "nanquantile", "kthvalue", "topk"):
        monkeypatch.setattr(torch, name, spy(getattr(torch, name)))
    for name in ("sort", "argsort", "msort", "quantile", "kthvalue", "topk"):
        monkeypatch.setattr(torch.Tensor, name, spy(getattr(torch.Tensor, name)))

    def methods(frame: object, event: str, arg: Any) -> None:  # ndarray.sort() and the like
        owner = getattr(arg, "__self__", None)
        if event == "c_call" and getattr(arg, "__name__", "") in _SORTS:
            if isinstance(owner, np.ndarray):
                seen.append(owner.size)
            elif isinstance(owner, torch.Tensor):
                seen.append(owner.numel())

    sys.setprofile(methods)
    yield seen
    sys.setprofile(None)


_SORTS = frozenset({"sort", "argsort", "partition", "argpartition", "msort", "kthvalue", "topk"})


@pytest.mark.parametrize("size", [100_001, 1_000_000])
def test_no_path_sorts_a_whole_tensor(sorted_sizes: list[int], size: int) -> None:
    values = torch.randn(size)
    values[::997] = float("nan")
    for host_paths in (True, False):
        measurer = Measurer(None, host_paths=host_paths)
        reduction, histogram = measurer.launch_with_histogram(values)
        assert histogram is not None
        vector = reduction.device_vector
        got = reduction.resolve([] if vector is None else vector.tolist())
        assert all(metric.value is not None for metric in got)
        alone = Measurer([DefaultStatistics(())], host_paths=host_paths)
        alone.launch_with_histogram(values)  # a histogram without the metrics
    assert sorted_sizes  # the spy sees the brackets' small selections
    assert max(sorted_sizes) < size // 3  # the brackets' kept entries at most, a few percent


@pytest.mark.parametrize("size", [order.SORTED_UP_TO + 1, 20_000, 100_001, 1_000_000])
def test_where_this_cpu_sorts_slowly_nothing_larger_than_a_bucket_is_sorted(
    sorted_sizes: list[int], size: int
) -> None:
    """With `select` (a CPU without a fast SIMD sort), neither a small tensor, nor a large one's
    sample and brackets, is sorted: at most `order.SORTED_UP_TO` entries at a time (once a
    size's sample positions are drawn: `order.sample_positions`, cached), and the statistics
    are the sorting path's (the quartiles exact, the moments within rounding)."""
    rng = np.random.default_rng(size)
    values = np.maximum(rng.standard_normal(size), -0.5).astype(np.float32)  # ties at -0.5
    values[::997] = np.nan
    numerics.measure_array(values, 64, select=True)
    sorted_sizes.clear()
    slow = numerics.measure_array(values, 64, select=True)
    assert max(sorted_sizes) <= order.SORTED_UP_TO
    sorted_sizes.clear()
    quick = numerics.measure_array(values, 64, select=False)
    for name in ("min", "max", "p25", "p50", "p75", "zeros", "finite"):
        assert slow.raw[name] == quick.raw[name], name
    for name in ("mean", "std"):
        assert slow.raw[name] == pytest.approx(quick.raw[name], rel=1e-12), name
    assert slow.histogram is not None
    assert quick.histogram is not None
    assert slow.histogram[5:] == quick.histogram[5:]  # the same edges and counts
