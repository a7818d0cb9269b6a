"""`HuggingFaceObserver`: a transformers `TrainerCallback` that observes `Trainer.train`.

    trainer = transformers.Trainer(..., callbacks=[HuggingFaceObserver()])

Hooks, one line each:

- `on_train_begin`: inject into the model the Trainer trains (after `accelerator.prepare`, so
  any forward wrapping of mixed precision is already in place and stays inside the proxy; with
  accelerate's regional compilation, the compiled copy the Trainer trains, and the model it was
  built from, which the Trainer evaluates, delimits root forwards too: `_trained_model`), and
  put the run directory into the TrainerState (below). With `fp16=True` on a GPU the
  Accelerator's `GradScaler` is the run's `grad_scaler` (unless the options name one): each
  sample's loss scale is recorded (`loss_scale.py`). A second `on_train_begin` inside the same
  `train()` after its training loop raised (in a training step, or outside it while that
  `train()` still runs) is the Trainer's retry of the loop (`auto_find_batch_size`): it
  continues that run as a new attempt (`_retry_note`). The callback never keeps that
  `train()` frame (nor the Trainer): it watches it (`_torch_internals.RunningFrame`), so a
  failed `train()` leaves its locals and its callers' (optimizer, batches, tensors) to be
  freed as soon as the exception is handled.
- `on_step_end`: after the first optimizer step only, warn if no training forward called the
  model.
- `on_train_end`: remove.
- `on_evaluate`, `on_predict`: an `evaluate()` or `predict()` before any `train()` with this
  callback is not observed: a warning says so, once.
- `on_prediction_step`, `on_evaluate`, `on_step_end`, `on_substep_end`: with `record_eval`,
  which evaluation dataset each evaluation sample is of (a dict `eval_dataset`: the prefix of
  the metrics of the evaluation that took it), listed in index.md where there were several
  (`_eval_sets.py`).

Training forwards are the samples: the callback marks the Trainer's `training_step` (see the
wrap below; a forward in it under no_grad, as `generate()` runs, is evaluation's), and every
other forward of the model during `train()` (evaluation every
`eval_steps`, `eval_on_start`) never takes a sample and never enters the training series; with
`record_eval=True` those are sampled on their own count and form their own series (mode
`eval`). `evaluate()` or `predict()` called after `train()` runs after the observer was
removed: neither observed nor counted. Each micro-batch of gradient accumulation is a training forward; their samples
share one `step` (`state.global_step`, history's `step`), and the Trainer's TensorBoard gets the
step's first one (one histogram per tag and step: `sinks.tensorboard` says why).

Defaults: the run directory is `args.output_dir/torchinstruments` (`-2`, `-3`, ... when taken).
A checkpoint keeps the run directory: `on_train_begin` puts it into `state.stateful_callbacks`
(a dict the Trainer saves in each checkpoint's trainer_state.json and loads back, before
`on_train_begin`, in `train(resume_from_checkpoint=...)`; transformers 4.41 and later, checked
on 5.24.0), so a resumed fit continues the run that wrote its checkpoint, not the last one
under `output_dir` (a later fresh fit's). Its key is `torchinstruments.HuggingFaceObserver`
(with `output_dir` and `module` when given, a lambda `module` named by what it reads,
`_state_key.py`: several observers each keep their own), not a
callback class name and the callback no `ExportableState`: under
`restore_callback_states_from_checkpoint=True` the Trainer rebuilds such a callback from its
saved arguments, which would drop the user's options (it only logs that the checkpoint holds
a state no callback claims). Where the run named is gone or this process cannot write it, or
a checkpoint names none (written before checkpoints kept it), the last run under `output_dir`
is continued, and a warning and index.md say so. An explicit `output_dir` always wins.
With `report_to` including `"tensorboard"`, the focus histograms also go into the Trainer's
TensorBoard writer on `state.global_step`. With `rank_policy="rank0"` only the world's main
process attaches (`state.is_world_process_zero`).

An exception: transformers has no exception event for callbacks. So at `on_train_begin` the
callback finds the running `Trainer` (the caller's frame whose `self` is one) and wraps that
instance's `training_step` (an attribute of the Trainer object, never of the model; undone at
removal): its forwards are the training forwards, and an exception raised in a training step
(forward, loss, backward) removes the observer, with a note in index.md, and propagates
unchanged. An exception elsewhere (an evaluation's `compute_metrics`, another callback, the
data collator, the optimizer step) ends `train()` without any event, so the callback watches the
frame of that Trainer's `train()` and, at the next use of the model, asks whether it still runs
(`_torch_internals.RunningFrame`): at each forward outside a training step (one walk of the stack,
for evaluation forwards only), and at the start of the next fit with this callback or with
another on the same model. Once it has left the stack, the run is finished as interrupted
(index.md and a warning: the global step reached, why, and how it was seen) and the model's
forwards are restored before that forward or fit runs, so a later `trainer.evaluate()` is
neither observed nor counted as evaluation inside the fit, and a next `train()` starts as on a
fresh callback. A `train()` resumed from a checkpoint that continues that run with another
callback (a Trainer built anew) finishes it too (`_fit.py`); otherwise the end of the process
does, with the same note (an exit handler registered at the first fit, so it runs before the
observer's finalizer would finish the run without one). The note names the exception where
Python kept it: the one that ended the script (`sys.last_value`, set before exit handlers run,
and by IPython for a cell that raised), when its traceback passes through that `train()`
frame, so an exception of other code is never blamed on the fit. The same Trainer is how the
callback finds its `TensorBoardCallback`'s writer.

Why the frames, the only way: every event (`on_train_begin` included) receives `args`, `state`,
`control` and, from `CallbackHandler.call_event`, the model, processing class, optimizer,
scheduler and dataloaders, never the Trainer (checked on transformers 5.24.0); the callback is
built before the Trainer, so it cannot be handed one either. Where no frame holds a Trainer
(another loop driving the callbacks), every forward is on the sampler's schedule, with a
warning and a note in index.md; `record_eval` then records nothing apart, and index.md gives no
count of evaluation forwards, which no one kept.

Imports `transformers` when this module is imported.
"""

from __future__ import annotations

import atexit
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from accelerate.utils.memory import should_reduce_batch_size
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import TensorBoardCallback

from torchinstruments import notices
from torchinstruments._torch_internals import RunningFrame
from torchinstruments.api import has_observer
from torchinstruments.integrations._eval_sets import metrics_prefix
from torchinstruments.integrations._fit import LOGGER, FitObservation
from torchinstruments.integrations._state_key import state_key
from torchinstruments.integrations._step_mark import TrainingStepMark
from torchinstruments.loss_scale import trainer_scaler
from torchinstruments.registry import add_run_note, also_root
from torchinstruments.rundir.shell import error_said, literal_if_unclear
from torchinstruments.sampling import Sampler
from torchinstruments.sinks.protocol import Sink
from torchinstruments.sinks.tensorboard import TensorBoardSink

__all__ = ["HuggingFaceObserver"]


class HuggingFaceObserver(TrainerCallback):
    """Observe a Hugging Face Trainer run: inject at its start, remove at its end or on an error
    in a training step (an error elsewhere: at the next use of the model, see the module
    docstring).

    Args:
        output_dir: the run directory; default `args.output_dir/torchinstruments`.
        module: what to observe: None (the Trainer's model), an attribute path of it such as
            `"model.encoder"`, or a callable `model -> nn.Module`.
        **options: any other `inject_observer` option (the fields of `ObserverConfig`), checked
            here: the `ObserverConfig` built from them now is the one every fit's run uses.
        record_eval: False (default): forwards outside `training_step` are not observed.
            True: they are sampled by a copy of the sampler, on the count of evaluation
            forwards, as their own series (mode `eval`). A `Sampler`: that one samples them.

    Every fit gets fresh samplers: a deep copy of `sampler` (and of the evaluation sampler) as
    it was when the callback was built, so a second fit with this callback samples like the
    first (a `TimeIntervalSampler` takes its first forward again). A sampler that cannot be
    deep-copied is used as it is: its state then carries over from one fit to the next.

    Raises:
        TypeError, ValueError: an option is invalid (the message names it).

    Example:
        >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[HuggingFaceObserver()])  # doctest: +SKIP
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        module: str | Callable[[nn.Module], nn.Module] | None = None,
        record_eval: bool | Sampler = False,
        **options: Any,
    ) -> None:
        self._fit = FitObservation(
            "HuggingFaceObserver",
            output_dir,
            module,
            options,
            record_eval,
            after_fit="trainer.evaluate() and trainer.predict() calls",
            directory_name="args.output_dir",
            evaluations="the evaluation the Trainer runs during training: eval_strategy, "
            "eval_on_start",
            no_steps="max_steps or num_train_epochs was reached already: a train() resumed "
            "from the checkpoint of its last step",
            dataset_metrics="a dict eval_dataset: the Trainer logs each dataset's metrics under "
            "the prefix named here, as `eval_<name>_loss`, where the evaluation query below reads "
            "`eval_loss`",
        )
        self._step_guard: TrainingStepMark | None = None
        # The running fit's `train()` frame (`_running_trainer`), watched on its thread but
        # never kept (its locals and its callers' would outlive an exception), and its global
        # step: where the fit ended, once that frame has left the stack.
        self._loop: RunningFrame | None = None
        self._step: Callable[[], int] = lambda: 0
        self._exit_handler = False  # registered (once, at the first fit that watches its frame)
        # A fit whose training loop raised: its train() frame (watched), its run and the
        # exception's name (None: outside the training step), which a retry of the loop inside
        # that very train() continues.
        self._failed: tuple[RunningFrame, Path, str | None] | None = None
        # Not the class name: a key that names a callback class is rebuilt from its saved
        # arguments by restore_callback_states_from_checkpoint, dropping the user's options.
        self._key = f"torchinstruments.{state_key(type(self).__qualname__, output_dir, module)}"

    @property
    def directory(self) -> Path | None:
        """The run directory of the current (or last) run; None before one, or where not attached."""
        return self._fit.directory

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Inject into the model; histograms also into the Trainer's TensorBoard writer."""
        if model is None:
            raise TypeError("HuggingFaceObserver: on_train_begin was called without the model")
        trainer, loop = _running_trainer()
        self._loop_retried(loop)
        self._fit_ended("when its callback's next train() started")
        self._undo_guard()  # a guard left by a train() that ended without on_train_end
        failed, self._failed = self._failed, None
        retry = (
            failed if failed is not None and loop is not None and failed[0].is_frame(loop) else None
        )
        # train(resume_from_checkpoint=...) loaded the state before on_train_begin
        resuming = state.global_step > 0
        saved = _saved_run(state, self._key) if resuming else None
        trained = _trained_model(trainer, model)
        directory = self._fit.start(
            trained,
            Path(args.output_dir or "."),
            main_process=state.is_world_process_zero,
            logger_sink=lambda: _writer_sink(trainer, state),
            global_step=lambda: state.global_step,
            resuming=resuming,
            checkpoint_run=saved,
            checkpoint=f"of global step {state.global_step}",
            resume_step=state.global_step,
            grad_scaler=trainer_scaler(getattr(trainer, "accelerator", None)),  # fp16=True
            retry=None if retry is None else retry[1],
            steps_told=trainer is not None,  # the step's mark needs the Trainer
        )
        if directory is not None and retry is not None:
            said = _retry_note(retry[2], state.train_batch_size)
            add_run_note(self._fit.observed or model, said)
            notices.warn(f"torchinstruments: HuggingFaceObserver: {said}")
        if directory is not None and trained is not model:  # evaluation calls `model`
            also_root(trained, model)
        if directory is not None:
            _keep_run(state, self._key, self._fit.run_directory)
        if directory is not None and trainer is not None:
            self._step_guard = TrainingStepMark(
                trainer,
                self._fit,
                lambda error: self._on_step_exception(
                    error, state.global_step, _retried(args, state.train_batch_size, error)
                ),
            )
            if self._fit.phases is not None and loop is not None:
                self._loop = RunningFrame(loop, threading.get_ident())
                self._step = lambda: state.global_step
                self._fit.phases.fit_over = self._fit_ended
                if not self._exit_handler:  # after inject's finalizer: runs before it at exit
                    self._exit_handler = True
                    atexit.register(_finish_at_exit, weakref.ref(self))
        elif directory is not None:  # training steps cannot be told apart: every forward trains
            notices.warn(
                "torchinstruments: HuggingFaceObserver: the running Trainer was not found, so "
                "training and evaluation forwards cannot be told apart: every forward is on the "
                "sampler's schedule (the mode column still keeps eval rows apart)"
            )
            add_run_note(
                self._fit.observed or model,
                "the running Trainer was not found: evaluation forwards were not told apart "
                "from training forwards (both on the sampler's schedule; mode keeps rows apart)",
            )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """After the first step: warn if no training forward called the model."""
        self._fit.check_first_step()
        if self._fit.eval_sets is not None:  # its no_grad forwards are of no eval dataset
            self._fit.eval_sets.step_ended()

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A micro-batch of gradient accumulation ended: its samples are of no eval dataset."""
        if self._fit.eval_sets is not None:
            self._fit.eval_sets.step_ended()

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An evaluation batch ended: its samples wait for their dataset (`on_evaluate`)."""
        if self._fit.eval_sets is not None:
            self._fit.eval_sets.batch_ended()

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Any = None,
        **kwargs: Any,
    ) -> None:
        """A dataset's evaluation ended: its samples are its metrics' prefix's. Before any
        train(): warn once that `trainer.evaluate()` ran unobserved."""
        if self._fit.eval_sets is not None:
            self._fit.eval_sets.evaluated(metrics_prefix(metrics))
        self._fit.ran_outside_a_fit(
            "trainer.evaluate()", "trainer.train()", state.is_world_process_zero
        )

    def on_predict(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Any = None,
        **kwargs: Any,
    ) -> None:
        """Before any train(): warn once that `trainer.predict()` ran unobserved. Inside one
        (another callback's), its samples are of no evaluation dataset."""
        if self._fit.eval_sets is not None:
            self._fit.eval_sets.evaluated(None)
        self._fit.ran_outside_a_fit(
            "trainer.predict()", "trainer.train()", state.is_world_process_zero
        )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Remove: restores every forward, writes history.parquet, result.json, index.md."""
        self._loop = None
        self._undo_guard()
        self._fit.finish(completed=True)

    def _fit_ended(self, when: str) -> bool:
        """Whether the last train() ended without on_train_end (its training loop left the
        stack: an exception outside the training step); if so, its run is finished now as
        interrupted, and index.md and a warning say where it stopped, why, and `when` seen."""
        loop = self._loop
        if loop is None or loop.on_stack():
            return False
        self._loop = None
        self._undo_guard()
        observed = self._fit.observed
        if observed is None or not has_observer(observed):
            return True
        error = _escaped(loop)
        what = "" if error is None else f": {error_said(error)}"
        said = (
            f"the fit ended at global step {self._step()} without on_train_end: train() raised "
            "outside the training step (in an evaluation, another callback, the data collator "
            "or the optimizer step, of which transformers tells callbacks nothing)"
            f"{what}; HuggingFaceObserver saw it {when} and finished the run then. The run "
            "holds this attempt's samples up to then."
        )
        add_run_note(observed, said)
        notices.warn(
            "torchinstruments: HuggingFaceObserver: "
            f"{literal_if_unclear(str(self._fit.directory))}: {said}"
        )
        self._fit.finish()
        return True

    def _loop_retried(self, loop: FrameType | None) -> None:
        """The training loop starts again inside the `train()` (frame `loop`) whose fit is still
        observed: the Trainer caught an exception outside the training step, of which callbacks
        hear nothing, and retries (auto_find_batch_size). That fit's run is finished as ended
        there, and the retry continues it (`_failed`)."""
        kept = self._loop
        if kept is None or loop is None or not kept.is_frame(loop):
            return
        self._loop = None
        self._undo_guard()
        observed, run = self._fit.observed, self._fit.run_directory
        if observed is None or not has_observer(observed) or run is None:
            return
        add_run_note(
            observed,
            f"the fit's training loop ended at global step {self._step()} without "
            "on_train_end, and the Trainer ran it again inside the same train() call "
            "(auto_find_batch_size): an exception outside the training step (the optimizer "
            "step, an evaluation, another callback; transformers tells callbacks nothing of it) "
            "that the Trainer took for running out of memory. The run holds this attempt's "
            "samples up to then.",
        )
        self._fit.finish()
        self._failed = (kept, run, None)

    def _on_step_exception(self, error: BaseException, step: int, retried: bool) -> None:
        """A training step raised `error` at global `step`: finish the run. The fit's `train()`
        frame is remembered (watched, not kept) where the Trainer runs its loop again
        (`retried`), whose `on_train_begin` continues the run."""
        loop, run = self._loop, self._fit.run_directory
        self._loop = None
        if retried and loop is not None and run is not None:  # the Trainer runs its loop again
            self._failed = (loop, run, type(error).__name__)
        self._undo_guard()
        self._fit.finish(error, step)

    def _undo_guard(self) -> None:
        guard, self._step_guard = self._step_guard, None
        if guard is not None:
            guard.undo()


def _retried(args: TrainingArguments, batch_size: int | None, error: BaseException) -> bool:
    """Whether the Trainer runs its training loop again after a training step raised `error`
    with batches of `batch_size`: under `auto_find_batch_size` only, where accelerate takes the
    error for running out of memory and nine tenths of the batch size is still a batch (checked
    on transformers 5.24.0 and accelerate 1.15.0; at zero it raises instead)."""
    if not args.auto_find_batch_size or not isinstance(error, Exception):
        return False
    return should_reduce_batch_size(error) and (batch_size is None or int(batch_size * 0.9) > 0)


def _retry_note(error: str | None, batch_size: int | None) -> str:
    """index.md's note (and the warning) on an attempt that is the Trainer's retry of its
    training loop inside one `train()` call.

    With `auto_find_batch_size=True`, `train()` runs its training loop under accelerate's
    `find_executable_batch_size`: an exception it takes for running out of memory (checked on
    transformers 5.24.0: a RuntimeError naming CUDA, cuDNN or the CPU allocator running out) ends
    the loop, and the loop runs again with a smaller batch (nine tenths of it), with a fresh
    TrainerState from global step 0 and `on_train_begin` again. The callback finished the run at
    the exception where its training step raised (one outside it, when the retry began: the
    fit's `train()` frame still runs); the retry continues that run as a new attempt,
    rather than a run of its own beside it, or, with an explicit output_dir, refusing the
    directory that run holds (which raised out of the user's train())."""
    size = "" if batch_size is None else f", with a train batch size of {batch_size}"
    raised = (
        "raised outside its training step" if error is None else f"training step raised {error}"
    )
    return (
        "this attempt is the Trainer's retry of its training loop inside the same train() call"
        f"{size} (auto_find_batch_size: the previous attempt's {raised}, which the Trainer "
        "took for running out of memory): its global steps start again from 0"
    )


def _trained_model(trainer: Trainer | None, model: nn.Module) -> nn.Module:
    """The module the Trainer's training steps call: `model`, or accelerate's regionally
    compiled copy of it.

    With regional compilation (`ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1`, or
    `TorchDynamoPlugin(use_regional_compilation=True)`), accelerate's `compile_regions` builds a
    new module of the model's class that shares its blocks, each wrapped in torch.compile, and
    keeps the model it was built from in its `__dict__` as `_orig_mod`. The Trainer trains that
    copy (`model_wrapped`) and hands callbacks the model: observing the model would see no
    training forward. It evaluates through the model (`trainer.model`), though: the callback
    makes the model's calls root forwards of the same run (`also_root`; its layers are the
    copy's), so evaluation inside the fit is counted, and recorded with `record_eval`, as in an
    uncompiled fit. A `torch.compile(model)` wrapper (`_orig_mod` a submodule) calls the
    model, which is observed as it is.
    """
    wrapped = getattr(trainer, "model_wrapped", None)
    if isinstance(wrapped, nn.Module) and wrapped.__dict__.get("_orig_mod") is model:
        return wrapped
    return model


def _running_trainer() -> tuple[Trainer | None, FrameType | None]:
    """The Trainer whose training loop is calling this callback (the innermost of the caller's
    frames whose `self` is a Trainer), and the frame of its `train()`, which holds the whole fit
    (that innermost frame where `train` is overridden without calling `Trainer.train`);
    (None, None) where no frame holds a Trainer."""
    frame = inspect.currentframe()
    trainer, loop = None, None
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if trainer is None and isinstance(candidate, Trainer):
                trainer, loop = candidate, frame
            if trainer is not None and candidate is trainer and frame.f_code is _TRAIN:
                loop = frame
                break
            frame = frame.f_back
        return trainer, loop
    finally:
        del frame  # no reference cycle through the frames


_TRAIN = Trainer.train.__code__


def _finish_at_exit(callback: weakref.ref[HuggingFaceObserver]) -> None:
    """At the process's exit: finish the last fit's run with its note if train() ended unseen."""
    observer = callback()
    if observer is not None:
        observer._fit_ended("at the process's exit")


def _escaped(loop: RunningFrame) -> BaseException | None:
    """The exception Python kept as the last uncaught one (`sys.last_value`: the one that ended
    the script, or IPython's cell), when it came out of the fit's `train()` frame `loop`; None
    where none did (a caught exception, `SystemExit`, or another's)."""
    error = getattr(sys, "last_value", None)
    trace = error.__traceback__ if isinstance(error, BaseException) else None
    while trace is not None and not loop.is_frame(trace.tb_frame):
        trace = trace.tb_next
    return error if trace is not None else None


def _saved_run(state: TrainerState, key: str) -> Path | None:
    """The run directory a resumed checkpoint's TrainerState keeps under `key`, else None."""
    kept = getattr(state, "stateful_callbacks", None)
    entry = kept.get(key) if isinstance(kept, dict) else None
    run = entry.get("run_directory") if isinstance(entry, dict) else None
    return Path(run) if isinstance(run, str) else None


def _keep_run(state: TrainerState, key: str, run: Path | None) -> None:
    """Put the run directory into the TrainerState, which every checkpoint of this fit saves
    (trainer_state.json's `stateful_callbacks`), so a fit resumed from it continues this run."""
    kept = getattr(state, "stateful_callbacks", None)
    if isinstance(kept, dict) and run is not None:
        kept[key] = {"run_directory": str(run)}


def _writer_sink(trainer: Trainer | None, state: TrainerState) -> Sink | None:
    """The Trainer's TensorBoardCallback writer as a sink on `state.global_step`, else None."""
    if trainer is None:
        return None
    for callback in trainer.callback_handler.callbacks:
        writer = getattr(callback, "tb_writer", None)
        if isinstance(callback, TensorBoardCallback) and writer is not None:
            return TensorBoardSink(
                writer,
                step=lambda: state.global_step,
                step_name="the Trainer's state.global_step (optimizer steps so far)",
                logger_name=LOGGER,
            )
    return None
