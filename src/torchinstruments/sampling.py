"""Which root forwards are sampled.

A sampler sees only the forward index and a clock, never tensors, so deciding costs one Python call
per root forward and nothing per layer. The decision is made once, when the root forward starts;
everything inside that forward (and its backward) is then measured or not as a whole, which keeps a
sample internally consistent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

Clock = Callable[[], float]


@runtime_checkable
class Sampler(Protocol):
    """Decides, once per root forward, whether that forward is sampled."""

    def should_sample(self, forward_index: int) -> bool:
        """Return True to measure the root forward numbered `forward_index` (0-based).

        A sampler may also define `describe() -> str`, one line for index.md.
        """
        ...


class TimeIntervalSampler:
    """Samples the first root forward, then the first one once `seconds` have passed since the last sample.

    The default sampler: its cost per hour of training is bounded whatever the step rate. Time comes
    from `clock` (monotonic by default) so tests can drive it.

    Args:
        seconds: minimum time between two samples; a positive finite number.
        clock: a function returning seconds as a float, monotonic non-decreasing.

    Raises:
        ValueError: if `seconds` is not positive and finite.
        TypeError: if `clock` is not callable.
    """

    def __init__(self, seconds: float = 60.0, *, clock: Clock = time.monotonic) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise TypeError(f"seconds must be a number, got {seconds!r}")
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"seconds must be a positive finite number, got {seconds!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self.seconds = float(seconds)
        self._clock = clock
        self._last: float | None = None

    def should_sample(self, forward_index: int) -> bool:
        now = self._clock()
        if self._last is None or now - self._last >= self.seconds:
            self._last = now
            return True
        return False

    def describe(self) -> str:
        return (
            f"TimeIntervalSampler(seconds={self.seconds:g}): the first root forward, then the "
            f"first root forward once {self.seconds:g} s have passed since the last sample"
        )


class EveryNForwardsSampler:
    """Samples root forwards with forward_index 0, n, 2n, ...

    Deterministic in the number of forwards, so matched runs sample the same steps.

    Args:
        n: sampling period in root forwards; a positive int (1 samples every forward).

    Raises:
        ValueError: if `n` is not a positive int.
    """

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        self.n = n

    def should_sample(self, forward_index: int) -> bool:
        return forward_index % self.n == 0

    def describe(self) -> str:
        return f"EveryNForwardsSampler(n={self.n}): forward_index 0, {self.n}, {2 * self.n}, ..."


def describe_sampler(sampler: object) -> str:
    """A sampler's one-line description, falling back to its repr for user samplers."""
    describe = getattr(sampler, "describe", None)
    if callable(describe):
        try:
            return str(describe())
        except Exception as error:  # a user's describe() must not stop injection
            return f"{type(sampler).__name__} (describe() failed: {error})"
    return repr(sampler)
