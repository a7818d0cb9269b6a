"""Bit-for-bit comparisons of the lane's results with the general path's (tests/test_lane*.py)."""

from __future__ import annotations

import dataclasses

import numpy as np

from torchinstruments.measurement import histograms
from torchinstruments.records import HistogramRecord, LayerInfo, MetricValue, TensorKey


def same_bits(a: MetricValue, b: MetricValue) -> bool:
    """Equal values (NaN never occurs: a null is None) with equal signs of zero, equal reasons."""
    if a.value is None or b.value is None:
        return a == b
    return a.reason == b.reason and np.float64(a.value).tobytes() == np.float64(b.value).tobytes()


def as_record(vector: list[float] | None) -> HistogramRecord | None:
    if vector is None:
        return None
    key = TensorKey(1, 1, LayerInfo("fc", "Linear"), 0, "output", "", "train", True)
    return histograms.record(vector, 64, key, "output")


def same_record_bits(a: HistogramRecord | None, b: HistogramRecord | None) -> bool:
    """Equal records, field by field, floats (alone or in tuples) by their bits."""
    if a is None or b is None:
        return a is b
    for field in dataclasses.fields(HistogramRecord):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, float) or (isinstance(x, tuple) and x and isinstance(x[0], float)):
            if np.array(x, dtype=np.float64).tobytes() != np.array(y, dtype=np.float64).tobytes():
                return False
        elif x != y:
            return False
    return True
