"""A trainer's training step, marked: the forwards inside it are the fit's training forwards.

Both trainer callbacks wrap the object whose `training_step` their trainer calls for each step
(Lightning's strategy, the Hugging Face Trainer), so that a forward inside a step is told from
every other forward of the fit (phases.py); the fit's other work is in `_fit.py`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["TrainingStepMark"]


class MarkedPhases(Protocol):
    """What a mark tells of a step: its start and its end (`_fit.FitObservation`)."""

    def enter_training(self) -> None: ...

    def leave_training(self) -> None: ...


class TrainingStepMark:
    """Wraps one object's `training_step` for one fit: the forwards inside it are training
    forwards, and only those (another callback's forwards around it are evaluation forwards).

    The wrapper is an instance attribute of `owner` (the Hugging Face Trainer, Lightning's
    strategy), never of the model, and `undo` puts back what the instance had. Several marks
    (several observers in one fit) wrap one another and are undone in callback order, the
    inner one first: an inner mark undone while wrapped calls straight through from then on,
    and the outer one's `undo` puts back what was under both, so nothing of ours is left.

    Args:
        owner: the object whose `training_step` the trainer calls for every training step.
        fit: the fit whose phases the wrapper marks.
        on_exception: called with an exception raised in the step, before it propagates.
    """

    def __init__(
        self,
        owner: object,
        fit: MarkedPhases,
        on_exception: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.undone = False
        original = owner.training_step  # type: ignore[attr-defined]

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if self.undone:  # undone while another mark wrapped it: passes through
                return original(*args, **kwargs)
            fit.enter_training()
            try:
                return original(*args, **kwargs)
            except BaseException as error:
                if on_exception is not None:
                    on_exception(error)
                raise
            finally:
                fit.leave_training()

        training_step.mark = self  # type: ignore[attr-defined]
        # What `undo` puts back, kept by the wrapper (so by the owner), never by the mark.
        training_step.put_back = (  # type: ignore[attr-defined]
            "training_step" in vars(owner),
            vars(owner).get("training_step"),
        )
        # Weakly: a fit that ended unseen (an exception outside the step) leaves the mark with
        # its callback until the next use of the model; held, it kept the trainer (its model,
        # optimizer, dataloaders) alive until then. The owner holds the wrapper, the wrapper
        # the owner's own method: a cycle of theirs alone.
        self._owner = _weak(owner)
        self._wrapper = weakref.ref(training_step)
        owner.training_step = training_step  # type: ignore[attr-defined]

    def undo(self) -> None:
        """Put back what the instance had (nothing, or its own attribute), unless replaced since;
        marks undone before under this one go too. Nothing to do once the owner is gone."""
        self.undone = True
        owner, wrapper = self._owner(), self._wrapper()
        if owner is None or wrapper is None or vars(owner).get("training_step") is not wrapper:
            return  # gone, or wrapped since: the outer mark puts back what is under it
        had_own, own = wrapper.put_back  # type: ignore[attr-defined]
        inner = getattr(own, "mark", None)
        while had_own and isinstance(inner, TrainingStepMark) and inner.undone:
            had_own, own = own.put_back  # type: ignore[union-attr]
            inner = getattr(own, "mark", None)
        if had_own:
            owner.training_step = own  # type: ignore[attr-defined]
        else:
            del owner.training_step  # type: ignore[attr-defined]


def _weak(owner: object) -> Callable[[], object | None]:
    """A weak reference to `owner`, or a strong one where it takes none (`__slots__`)."""
    try:
        return weakref.ref(owner)
    except TypeError:
        return lambda: owner
