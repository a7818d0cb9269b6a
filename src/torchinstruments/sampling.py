"""Which root forwards are sampled.

A sampler sees only the forward index and a clock, never tensors, so deciding costs one Python call
per root forward and nothing per layer. The decision is made once, when the root forward starts;
everything inside that forward (and its backward) is then measured or not as a whole, which keeps a
sample internally consistent.
"""

from __future__ import annotations

import inspect
import math
import operator
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torchinstruments.notices import repr_of, shown
from torchinstruments.reasons import cut_message, error_message, utf8_text
from torchinstruments.rundir.shell import repr_if_unclear

__all__ = [
    "Clock",
    "EveryNForwardsSampler",
    "Sampler",
    "TimeIntervalSampler",
    "as_decision",
    "ask",
    "check_sampler",
    "describe_sampler",
    "read_step",
]

Clock = Callable[[], float]

# A sampler's description, and what a warning quotes of it, its error or its answer, is cut to
# this many characters (index.md stays within 64 KiB).
DESCRIPTION_KEPT = 500


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
        """Raises ValueError where the clock gives a time that is not a finite number (NaN):
        compared with NaN, no interval ever passed, so the first sample was the last, unsaid;
        raised, each forward is left unsampled and the run warns and notes it (`ask`)."""
        now = self._clock()
        if isinstance(now, int | float) and not math.isfinite(now):
            raise ValueError(f"TimeIntervalSampler: clock() returned {now!r}, not a finite time")
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


def check_sampler(sampler: object) -> None:
    """Refuse what cannot sample: a class instead of an instance, no `should_sample`, or one that
    cannot be called with one positional argument (a builtin without a signature is accepted).

    Raises:
        TypeError: naming the argument and what to pass instead.
    """
    if isinstance(sampler, type):
        raise TypeError(
            f"sampler must be a Sampler instance, got the class {sampler.__name__}; "
            f"instantiate it, e.g. sampler={sampler.__name__}(...)"
        )
    should_sample = getattr(sampler, "should_sample", None)
    if not callable(should_sample):
        raise TypeError(
            f"sampler must have should_sample(forward_index) -> bool (a Sampler), got {sampler!r}"
        )
    try:
        signature = inspect.signature(should_sample)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    try:
        signature.bind(0)
    except TypeError:
        raise TypeError(
            f"sampler={sampler!r} has should_sample{signature}, which cannot be called as "
            "should_sample(forward_index): it must take the root forward's index as its one "
            "argument, e.g. def should_sample(self, forward_index: int) -> bool"
        ) from None


def as_decision(value: object) -> bool | None:
    """`should_sample`'s answer as a bool, or None when it is not a bool.

    Accepted: Python bool, NumPy bool, and a 0-d bool tensor whose value can be read. Anything
    else (None, 0/1, 2, NaN, strings) is refused rather than guessed with `bool(...)`: a sampler
    that returns the wrong type is a bug the user must hear about, not a silent "always" or
    "never". Never raises: a 0-d bool tensor on the meta device (whose value cannot be read), or
    an answer whose class has no module name, raised here, in the user's step (a sampler's
    answer) or at inject with torch's message (a selector's); both are refused like any other
    answer that is not a bool.
    """
    if isinstance(value, bool):
        return value
    kind = type(value)
    module = getattr(kind, "__module__", None)
    if not isinstance(module, str):
        return None
    try:
        if module == "numpy" and kind.__name__ in {"bool_", "bool"}:
            return bool(value)  # type: ignore[arg-type]
        if (
            module.startswith("torch")
            and getattr(value, "dtype", None) is not None
            and str(getattr(value, "dtype", "")) == "torch.bool"
            and getattr(value, "ndim", None) == 0
        ):
            return bool(value)  # type: ignore[arg-type]
    except Exception:  # a tensor whose value cannot be read (meta, a failing subclass)
        return None
    return None


def ask(sampler: Any, forward_index: int, warn_once: Callable[[str, str], None]) -> bool:
    """`sampler.should_sample(forward_index)` as a bool; a raising sampler, or an answer that is
    not a bool, means "not sampled" (warned once: a wrong answer is a bug to report, not a value
    to guess). The warning, which index.md keeps as a note, quotes the sampler, its error and
    its answer by `_quoted`, cut to `DESCRIPTION_KEPT` characters each: an error message or an answer of
    200,000 characters made index.md 250 KB, past its 64 KiB bound."""
    try:
        answer = sampler.should_sample(forward_index)
    except Exception as error:
        warn_once(
            "sampler",
            f"sampler {_quoted(repr_of(sampler))} raised {_quoted(shown(error))} for forward_index "
            f"{forward_index}; a forward whose sampler raises is not sampled",
        )
        return False
    decision = as_decision(answer)
    if decision is None:
        warn_once(
            "sampler-answer",
            f"sampler {_quoted(repr_of(sampler))} returned {_quoted(repr_of(answer))} "
            f"({type(answer).__name__}) for forward_index {forward_index}, expected a bool "
            "(Python, NumPy or a readable 0-d tensor); such forwards are not sampled",
        )
        return False
    return decision


def _cut(text: str) -> str:
    """`text` cut to `DESCRIPTION_KEPT` characters, saying how many more (see `ask`)."""
    return cut_message(text, DESCRIPTION_KEPT)


def _quoted(text: str) -> str:
    """A repr as `ask`'s warning and index.md's note quote it: cut (`_cut`), and as its Python
    literal where it is not printable (`repr_if_unclear`): a repr holding a line break split the
    note's paragraph, and one holding a terminal escape put it raw into index.md."""
    return repr_if_unclear(_cut(text))


def read_step(
    source: Callable[[], object] | None, step: int | None, warn_once: Callable[[str, str], None]
) -> int | None:
    """The step of a sample taken now: `source()` (a trainer's global step), else `step` (the
    step a plain loop set last).

    A source that raises or gives no integer means a null step (warned once): the sample is
    still taken, only its step is unknown.
    """
    if source is None:
        return step
    try:
        value = source()
        return None if value is None else operator.index(value)  # type: ignore[arg-type]
    except Exception as error:
        warn_once(
            "step", f"reading the step for the step column failed: {shown(error)}; it is null"
        )
        return None


def describe_sampler(sampler: object) -> str:
    """A sampler's one-line description, falling back to its repr for user samplers; as text
    the run's UTF-8 files hold (`utf8_text`: a lone surrogate in a user's text failed the
    first write of the run's state, inside inject_observer), and at most `DESCRIPTION_KEPT`
    characters, saying how many more were cut: a user's sampler whose repr printed its whole
    schedule (200,000 characters) made index.md 250 KB, past its 64 KiB bound."""
    describe = getattr(sampler, "describe", None)
    if callable(describe):
        try:
            said = str(describe())
        except Exception as error:  # a user's describe() must not stop injection
            said = f"{type(sampler).__name__} (describe() failed: {error_message(error)})"
    else:
        said = repr_of(sampler)
    return utf8_text(_cut(said))
