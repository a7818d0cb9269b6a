"""Small helpers shared by the benchmarks.

The standard library's `statistics` module cannot be imported from here: running
`uv run bench/statistics.py` puts this folder first on `sys.path`, where our own
`statistics.py` shadows it. So the median lives here.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_steps(step: Callable[[], None], steps: int) -> float:
    """Mean seconds per call of `step` over `steps` calls."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps
