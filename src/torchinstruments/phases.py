"""Which schedule a root forward is on: a training forward, or a trainer's evaluation forward.

Design decision: in a plain loop every root forward is on one schedule, the sampler's, whatever
`model.train()` / `model.eval()` say; the `mode` column then keeps eval rows apart in every summary.
A plain loop's root forward called with grad disabled (no_grad, inference_mode: an evaluation, each
token of `generate()`, which leaves the model in train mode) is an evaluation forward: its rows
have mode `eval` whatever the modules' flags, so a generated token never joins a training series
(no backward can follow it, so it expects no gradient either). It stays on the one schedule: a
plain loop tells the library of no phases, and forward_index is what its sampler is asked with.
Under a trainer callback the trainer says which forwards are training ones (those inside Lightning's
strategy `training_step` or the Hugging Face Trainer's `training_step`) and only those are on the
sampler's schedule. Every other root forward during the fit (sanity check, validation, another
callback's forwards) is an evaluation forward: by default it passes through unobserved (it is not a
root forward of the run: forward_index does not count it and it never takes a sample; only its
number is kept, for index.md); with `record_eval` it is on a schedule of its own, an evaluation
sampler asked with the count of evaluation forwards, so evaluation never moves the training
schedule, and its rows have mode `eval` whatever the module's training flag (another callback's
forward in its batch hooks runs in train mode, and must not join the training series). Likewise a
training step's rows have mode `train` whatever a module's flag: a part the user froze in eval mode
for fine-tuning (a backbone's BatchNorm) would otherwise join, as `eval`, the evaluation samples'
series of that part. A root forward under no_grad inside a training step (each token of
`generate()`, as reinforcement-learning trainers run it before their loss) is no training forward
either: no backward can follow it, and on the sampler's count it would take the samples of the
forward that trains; it is an evaluation forward (`of_call`, one grad-mode read per root forward
under a trainer). Not so a root forward that reentrant activation checkpointing runs
(`checkpoint(model, x, use_reentrant=True)`, in a plain loop or a training step): torch disables
grad there itself, and the backward that follows flows through its recomputation, so it is a
training forward like any other, its rows of mode `train` (a plain loop: the module's flag) with
grad_enabled false and, as counting.py's note says, no output_gradient rows (`_no_grad_by_user`:
a walk of the stack, at root forwards under no_grad only). A trainer's setup forwards, at the
fit's start before its first loop (Lightning's model summary and logger graph of
`example_input_array`, an `on_fit_start` hook), are neither training nor evaluation: they pass
through unobserved whatever `record_eval` says, counted apart, so an example input never joins
the evaluation series nor is told as the user's evaluation.

Cost: two attribute reads per root forward of a plain loop; under a trainer, `of_call` (one
grad-mode read; under no_grad, a walk of the stack). A callback whose trainer tells it of no
failed end (the Hugging Face Trainer) sets `fit_over`, asked at forwards outside a training step
only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchinstruments._torch_internals import in_reentrant_checkpoint

__all__ = ["EVAL", "PASSED_THROUGH", "SETUP", "TRAIN", "UNOBSERVED", "Phases"]

TRAIN = "train"  # the sampler's schedule: every root forward of a plain loop
EVAL = "eval"  # a trainer's evaluation forwards, with record_eval: the evaluation sampler's
UNOBSERVED = "unobserved"  # a trainer's evaluation forwards by default: passed through
SETUP = "setup"  # a trainer's forwards before the fit's first loop: passed through, always
PASSED_THROUGH = (UNOBSERVED, SETUP)  # the schedules whose forwards are only counted


class Phases:
    """The schedule the next root forward is on, as a trainer callback sets it."""

    __slots__ = ("current", "eval_sampler", "fit_over", "following", "train_mode")

    def __init__(self) -> None:
        self.current = TRAIN
        self.eval_sampler: Any = None  # a Sampler; None: evaluation forwards are unobserved
        self.following = False  # True once a trainer callback says which forwards train
        # The mode of a training forward's rows: None, each layer's own flag (a plain loop);
        # "train" once a trainer says which forwards are training ones.
        self.train_mode: str | None = None
        # Whether the fit ended unseen (True once the callback that asks it finished the run).
        self.fit_over: Callable[[str], bool] | None = None

    def follow_trainer(self, eval_sampler: Any) -> None:
        """From now on only forwards inside a training step are training forwards.

        Args:
            eval_sampler: the evaluation forwards' sampler, or None to leave them unobserved.
        """
        self.eval_sampler = eval_sampler
        self.following = True
        self.train_mode = TRAIN
        self.leave_training()

    def follow_every_forward(self) -> None:
        """A trainer whose training steps cannot be told apart: every forward is on the
        sampler's schedule, and each layer's own flag gives its rows' mode (a plain loop's)."""
        self.following = False
        self.train_mode = None
        self.current = TRAIN

    def mode_of(self, schedule: str) -> str | None:
        """The mode of the rows of a sample taken on `schedule` (None: each layer's own flag).
        Asked once per sample: a plain loop's forward under no_grad is evaluation's."""
        if schedule == EVAL or (self.train_mode is None and _no_grad_by_user()):
            return EVAL
        return self.train_mode

    def of_call(self) -> str:
        """The schedule of the root forward now starting. Under a trainer, one under no_grad
        inside a training step is evaluation's: no backward follows it (`generate`, a reward
        model's forward)."""
        if self.current == TRAIN and self.following and _no_grad_by_user():
            return UNOBSERVED if self.eval_sampler is None else EVAL
        return self.current

    def enter_training(self) -> None:
        """A training step starts: its forwards are on the sampler's schedule."""
        self.current = TRAIN

    def enter_setup(self) -> None:
        """The fit's setup: forwards until `leave_setup` are neither training nor evaluation."""
        self.current = SETUP

    def leave_setup(self) -> None:
        """The fit's first loop starts (sanity check or training): evaluation from now on."""
        if self.current == SETUP:
            self.leave_training()

    def leave_training(self) -> None:
        """A training step ended: what follows is evaluation (or the trainer's own code)."""
        if self.following:
            self.current = UNOBSERVED if self.eval_sampler is None else EVAL

    def fit_ended(self, when: str = "at the model's first forward after it") -> bool:
        """Whether the trainer's fit ended without telling its callback, which then finished the
        run (a forward asking is not the run's); `when` says in index.md how that was seen."""
        return self.fit_over is not None and self.fit_over(when)


def _no_grad_by_user() -> bool:
    """Whether grad is disabled now by the caller (no_grad, inference_mode), not by reentrant
    checkpointing, whose forward on this thread's stack disabled it."""
    return not torch.is_grad_enabled() and not in_reentrant_checkpoint()
