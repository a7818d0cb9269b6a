"""How often the host path reads a tensor: one pass and a sample, counted, never timed.

`numerics`' docstring states the count. A view of the tensor's memory (`Reads`) counts the
entries each operation reads from it: an operation on the whole tensor reads it all; a chunk
view is read when an operation first touches it (further operations on the same chunk find
it in the cache, which is the point of chunking); taking entries reads those entries.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from torchinstruments.measurement import numerics, order

SIZE = 3 * (1 << 16) + 5  # several moment chunks, far above order.SMALL


class Reads(np.ndarray):
    """A view that adds to `counter[0]` the entries each NumPy operation reads from it."""

    counter: list[float]
    touched: list[Any]

    def _read(self, whole: int) -> None:
        if self.size == whole:
            self.counter[0] += self.size
        elif not any(seen is self for seen in self.touched):
            self.touched.append(self)
            self.counter[0] += self.size

    def __array_finalize__(self, obj: Any) -> None:
        self.counter = getattr(obj, "counter", [0.0])
        self.touched = getattr(obj, "touched", [])

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        return getattr(ufunc, method)(*_plain(inputs), **{k: _plain(v) for k, v in kwargs.items()})

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)
        if isinstance(key, slice):
            return out  # a view: read when an operation uses it
        _plain(self)  # an entry, or a copy by a mask or indices: the view is read
        return np.asarray(out) if isinstance(out, np.ndarray) else out

    def take(self, indices: Any, *args: Any, **kwargs: Any) -> Any:
        out = np.asarray(self).take(indices, *args, **kwargs)
        if self.size == SIZE:
            self.counter[0] += out.size  # the sample: the entries taken
        else:
            _plain(self)
        return out

    def astype(self, *args: Any, **kwargs: Any) -> Any:
        return np.asarray(_plain(self)).astype(*args, **kwargs)


def _plain(value: Any) -> Any:
    """`value` with every `Reads` in it (or in a list or tuple of it) read and made plain."""
    if isinstance(value, Reads):
        value._read(SIZE)
        return value.view(np.ndarray)
    if isinstance(value, tuple | list):
        return type(value)(_plain(item) for item in value)
    return value


def passes(values: np.ndarray, bins: int | None) -> float:
    """How many times `measure_array` reads `values`, in whole tensors."""
    view = values.view(Reads)
    view.counter, view.touched = [0.0], []
    numerics.measure_array(view, bins)
    return view.counter[0] / values.size


def sample_share() -> float:
    return order.sample_positions(SIZE).size / SIZE


@pytest.mark.parametrize("kind", ["normal", "relu", "integers"])
def test_a_finite_float32_tensor_is_read_once_plus_a_sample(kind: str) -> None:
    """The moments' one pass also counts zeros, shows finiteness and feeds the selection's
    brackets and the extremes; ties at a bracket's bounds (a ReLU's zeros, integers) are
    counted in that pass, not in one of their own."""
    rng = np.random.default_rng(4)
    values = rng.standard_normal(SIZE).astype(np.float32)
    if kind == "relu":
        values = np.maximum(values, 0)
    elif kind == "integers":
        values = rng.integers(-3, 4, SIZE).astype(np.float32)
    assert passes(values, None) == pytest.approx(1 + sample_share())


def test_a_focus_tensors_histogram_is_one_more_pass() -> None:
    values = np.random.default_rng(5).standard_normal(SIZE).astype(np.float32)
    assert passes(values, 64) == pytest.approx(2 + sample_share())


def test_non_finite_entries_cost_a_pass_then_a_compacted_copy_read_in_their_place() -> None:
    """The pass that finds them, then finiteness and the copy of the finite entries read the
    tensor; the moments, zeros and the selection then read the copy (not counted here: it is
    not the tensor's memory)."""
    values = np.random.default_rng(7).standard_normal(SIZE).astype(np.float32)
    values[::1000] = np.nan
    assert passes(values, 64) == pytest.approx(3 + sample_share())


def test_the_count_is_not_blind() -> None:
    """An extra whole-tensor operation is seen: the counter counts what it claims to."""
    values = np.random.default_rng(6).standard_normal(SIZE).astype(np.float32)
    view = values.view(Reads)
    view.counter, view.touched = [0.0], []
    np.count_nonzero(view < 0)
    for start in range(0, SIZE, 1000):
        chunk = view[start : start + 1000]
        chunk.min()
        chunk.max()
    assert view.counter[0] / SIZE == 2.0
