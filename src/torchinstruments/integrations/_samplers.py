"""The samplers of a trainer fit: each fit's fresh copies, and the evaluation forwards' sampler.

Design decision: a sampler keeps state (`TimeIntervalSampler` its last sample time), and a
callback runs one fit after another (`trainer.fit` twice, a tuner's trial fits), so each fit asks
a fresh deep copy of the sampler as it was when the callback was built, never the object the last
fit moved; `record_eval=True` samples evaluation forwards with a copy of their own, so evaluation
never moves the training schedule. A sampler that cannot be deep-copied is used as it is (its
state carries over). Kept apart from `_fit` (the fit's life) because which object is asked is
decided once per fit, from the options alone.
"""

from __future__ import annotations

import copy

from torchinstruments.notices import shown
from torchinstruments.sampling import check_sampler

__all__ = ["evaluation_sampler", "fresh_sampler", "pristine_copy"]


def evaluation_sampler(owner: str, record_eval: object, sampler: object) -> object:
    """The evaluation forwards' sampler for `record_eval` (None: not observed).

    Raises:
        TypeError: `record_eval` is neither a bool nor a Sampler, or True with a sampler that
            cannot be copied.
    """
    if record_eval is False:
        return None
    if record_eval is True:
        try:
            return copy.deepcopy(sampler)  # its own state: evaluation never moves training's
        except Exception as error:
            raise TypeError(
                f"{owner}: record_eval=True samples evaluation forwards with a copy of the "
                f"sampler, and {sampler!r} cannot be copied ({shown(error)}); pass "
                "record_eval=<a Sampler for evaluation forwards> instead"
            ) from None
    try:
        check_sampler(record_eval)
    except TypeError:
        raise TypeError(
            f"{owner}: record_eval must be False, True or a Sampler (should_sample(forward_index)"
            f" -> bool), got {record_eval!r}"
        ) from None
    return record_eval


def pristine_copy(sampler: object) -> object | None:
    """A deep copy of `sampler` as it is now, kept to hand each fit a fresh one; None when it
    cannot be deep-copied (then the object itself is used, and its state carries over)."""
    try:
        return copy.deepcopy(sampler)
    except Exception:
        return None


def fresh_sampler(pristine: object | None, sampler: object) -> object:
    """A fresh copy of `pristine` for one fit, or `sampler` itself where there is no copy.

    Why: a sampler keeps state (`TimeIntervalSampler` its last sample time), so one object asked
    by two fits would let the first fit's state decide the second's samples.
    """
    if pristine is None:
        return sampler
    try:
        return copy.deepcopy(pristine)
    except Exception:
        return sampler
