"""`LightningObserver`: a Lightning `Callback` that observes `trainer.fit`.

    trainer = lightning.Trainer(..., callbacks=[LightningObserver()])

Hooks, one line each:

- `on_fit_start`: inject into the LightningModule (or `module=` a part of it), and mark the
  strategy's `training_step` (below). Runs after the strategy moved the model to its device and
  before the sanity check and the first step. With `precision="16-mixed"` the precision
  plugin's `GradScaler` is the run's `grad_scaler` (unless the options name one): each
  sample's loss scale is recorded (`loss_scale.py`). The fit's setup starts here. A tuner callback
  (`LearningRateFinder`, `BatchSizeFinder`) has run its trials by then, unobserved: index.md
  and a warning say so.
- `on_sanity_check_start`, `on_train_start`: the fit's setup ends at the first of them.
- `on_sanity_check_end`: with `record_eval`, say in index.md which evaluation samples are the
  sanity check's (`_sanity_note`): the model before training, a validation of a few batches.
- `on_train_batch_end`: after the first batch only, warn if no training forward called the
  observed module (whatever the sanity check called); in manual optimization, say once (a
  warning, index.md) when a batch moved the global step by other than one (several
  optimizers, or a step skipped): `step` then is off the axis of the logger's scalars (below).
- `on_train_batch_start`: the global step the batch starts at, for that comparison.
- `on_train_batch_end`, too: in automatic optimization, an empty `outputs` means the batch's
  `training_step` returned None and Lightning ran no backward for it: its training samples have
  no gradient rows, which a warning (the first time) and index.md say, the run state keeping
  the note from that first batch on, so a fit killed later keeps it (`_skipped_backwards.py`).
- `on_train_epoch_start`: say in index.md when the epoch is `StochasticWeightAveraging`'s
  batch-norm update, whose training samples have no gradients and share one step (`_swa_note`).
- `on_validation_start`: with `record_eval`, say once (a warning, index.md) when a validation
  of the fit runs between the micro-batches of an accumulated step (`_mid_step_note`).
- `on_validation_start`, `on_test_start`, `on_predict_start`: a `trainer.validate()`, `test()`
  or `predict()` before any fit with this callback is not observed: a warning says so, once.
- `on_validation_batch_start`, `on_validation_batch_end`: with `record_eval`, which validation
  dataloader each evaluation sample is of, listed in index.md where there were several
  (`_eval_sets.py`).
- `on_fit_end`: unmark and remove; histograms are in the logger before Lightning finalizes it.
- `on_exception`: unmark and remove, with a note in index.md that the fit raised and at which
  global step.
- `state_dict` / `load_state_dict`: a checkpoint keeps the run directory, and a fit resumed from
  it (`fit(ckpt_path=...)`) continues that run (Lightning 2.6 restores callback state before
  `on_fit_start`, except for a strategy that restores after setup: then index.md says so).
- `state_key`: the class name, with `output_dir` and `module` when given (a lambda `module`
  named by what it reads: `_state_key.py`), so several observers (of several parts of the
  model, a GAN's generator and discriminator) share one Trainer.
- `on_load_checkpoint`: the checkpoint's global step; a fit resumed behind the last step its
  run recorded (preempted after its last checkpoint) says in index.md which steps repeat.

Training forwards are the samples, and they are exactly the forwards inside the training step
(those with grad enabled: one under no_grad, which no backward follows, is evaluation's, but
not one reentrant checkpointing runs so, `phases.py`):
for the fit, the callback wraps `trainer.strategy.training_step` (an instance attribute of the
strategy, set at fit start and removed at its end or on an exception), which Lightning calls for
every training step, in automatic and manual optimization alike, through
`getattr(trainer.strategy, "training_step")` (`lightning.pytorch.trainer.call.
_call_strategy_hook`, checked on Lightning 2.6.6). Every other forward of the observed module
during the fit (the sanity check, validation, and another callback's forwards in its own batch
hooks) is an evaluation forward: it never takes a training sample and never enters the training
series; with `record_eval=True` it is sampled on its own count and forms its own series (mode
`eval`). The forwards of the fit's setup, from `on_fit_start` to the sanity check or the
first training step (the model summary's and the TensorBoard graph's forward of
`example_input_array`, the LightningModule's own `on_fit_start`; checked on Lightning 2.6.6),
are neither training nor evaluation: they pass through unobserved, also under `record_eval`,
and index.md counts them apart. `trainer.validate()`, `trainer.test()` and `trainer.predict()`
run after the fit, after the observer was removed: neither observed nor counted.
With `accumulate_grad_batches=k`, each of the k batches of an optimizer step is a training
forward, and their samples share one `step` (the trainer's global step, history's `step`); the
`TensorBoardLogger` gets the step's first one (one histogram per tag and step:
`sinks.tensorboard` says why). In manual optimization `trainer.global_step` counts every
optimizer's `step()` call (a GAN's two optimizers: two per batch), while Lightning logs the
scalars of `self.log` once per training batch; the `step` column stays the global step (the
design's), and the first batch that moves it by other than one is said in index.md and a
warning, since a join of `step` with the trainer's log then pairs other batches' values.

Defaults: the run directory is `trainer.log_dir/torchinstruments` (the logger's version
directory, e.g. `lightning_logs/version_0/torchinstruments`; `-2`, `-3`, ... when taken). A fit
resumed from a checkpoint continues the run the checkpoint names, even where the logger moved
on to a new version directory; where that run is gone or this process cannot write it, or the
checkpoint names none (saved without this callback), the last run under `trainer.log_dir` is
continued (or one started there), and index.md and a warning name the checkpoint and its run.
An explicit `output_dir` always wins. Under `fast_dev_run`, which suppresses Lightning's logging
and checkpoints (`trainer.log_dir` is None), the fit is observed as any other, but its run is a
fresh one in a temporary directory (`torchinstruments-fast_dev_run-*`), never a checkpoint's
continued, and a warning and index.md say where (`_dev_run_note`). With a `TensorBoardLogger`,
the focus histograms also go into it on `trainer.global_step`. With `rank_policy="rank0"` only
the global-zero process attaches (`trainer.is_global_zero`).

What is observed: the LightningModule's calls are the root forwards, so `training_step` must
call `self(x)`; a step that calls `self.net(x)` bypasses it. Pass `module="net"` to observe that
submodule instead (the callback warns after the first step when no training forward called it).

Imports `lightning.pytorch` (or, without it, `pytorch_lightning`) when this module is imported.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from torchinstruments.integrations._fit import LOGGER, FitObservation
from torchinstruments.integrations._fit_notes import path_span
from torchinstruments.integrations._skipped_backwards import SkippedBackwards
from torchinstruments.integrations._state_key import state_key
from torchinstruments.integrations._step_mark import TrainingStepMark
from torchinstruments.loss_scale import trainer_scaler
from torchinstruments.notices import warn
from torchinstruments.records import RunCounts
from torchinstruments.registry import add_run_note, observed_counts, save_run_now
from torchinstruments.rundir.ranges import plural
from torchinstruments.sampling import Sampler
from torchinstruments.sinks.protocol import Sink
from torchinstruments.sinks.tensorboard import TensorBoardSink

if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import (
        BatchSizeFinder,
        LearningRateFinder,
        StochasticWeightAveraging,
    )
    from lightning.pytorch.loggers import TensorBoardLogger
else:
    try:
        from lightning.pytorch import Callback, LightningModule, Trainer
        from lightning.pytorch.callbacks import (
            BatchSizeFinder,
            LearningRateFinder,
            StochasticWeightAveraging,
        )
        from lightning.pytorch.loggers import TensorBoardLogger
    except ImportError:  # the standalone package of older releases
        from pytorch_lightning import Callback, LightningModule, Trainer
        from pytorch_lightning.callbacks import (
            BatchSizeFinder,
            LearningRateFinder,
            StochasticWeightAveraging,
        )
        from pytorch_lightning.loggers import TensorBoardLogger

__all__ = ["LightningObserver"]


class LightningObserver(Callback):
    """Observe a Lightning fit: inject at its start, remove at its end or when it raises.

    Args:
        output_dir: the run directory; default `trainer.log_dir/torchinstruments`.
        module: what to observe: None (the LightningModule), an attribute path of it such as
            `"net"`, or a callable `pl_module -> nn.Module`.
        **options: any other `inject_observer` option (the fields of `ObserverConfig`), checked
            here: the `ObserverConfig` built from them now is the one every fit's run uses.
        record_eval: False (default): forwards outside training batches are not observed.
            True: they are sampled by a copy of the sampler, on the count of evaluation
            forwards, as their own series (mode `eval`). A `Sampler`: that one samples them.

    Every fit gets fresh samplers: a deep copy of `sampler` (and of the evaluation sampler) as
    it was when the callback was built, so a second fit with this callback samples like the
    first (a `TimeIntervalSampler` takes its first forward again). A sampler that cannot be
    deep-copied is used as it is: its state then carries over from one fit to the next.

    Raises:
        TypeError, ValueError: an option is invalid (the message names it).

    Example:
        >>> trainer = lightning.Trainer(callbacks=[LightningObserver()])  # doctest: +SKIP
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        module: str | Callable[[nn.Module], nn.Module] | None = None,
        record_eval: bool | Sampler = False,
        **options: Any,
    ) -> None:
        super().__init__()
        self._fit = FitObservation(
            "LightningObserver",
            output_dir,
            module,
            options,
            record_eval,
            after_fit="trainer.validate(), trainer.test() and trainer.predict() calls",
            directory_name="trainer.log_dir",
            no_steps="max_steps or max_epochs was reached already: a second trainer.fit() of "
            "a trainer that had finished, or a fit resumed from a checkpoint saved at the end "
            "of training; or limit_train_batches=0, or an empty training dataloader",
            dataset_metrics="several validation dataloaders: Lightning logs each one's metrics "
            "as `<name>/dataloader_idx_<i>`, named here by its dataloader_idx",
        )
        self._step_mark: TrainingStepMark | None = None
        self._checkpoint_run: Path | None = None  # the run a restored checkpoint names
        self._checkpoint_step: int | None = None  # and its global step
        self._key = state_key(LightningObserver.__qualname__, output_dir, module)
        self._batch_step = 0  # the global step the current training batch started at
        self._batch_stepped = True  # whether the last training batch stepped the global step
        self._axes_said = False
        self._mid_step_said = False
        self._before_sanity: RunCounts | None = None  # the counts as the sanity check began
        self._skipped: SkippedBackwards | None = None  # batches whose backward was skipped

    @property
    def state_key(self) -> str:
        """This callback's key in a checkpoint: the class name for the default callback, and
        with `output_dir` and `module` otherwise, so that several observers (of several parts
        of the model) share one Trainer, which refuses two stateful callbacks with one key."""
        return self._key

    @property
    def directory(self) -> Path | None:
        """The run directory of the current (or last) fit; None before one, or where not attached."""
        return self._fit.directory

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Inject into the LightningModule (or `module`), histograms into a TensorBoardLogger;
        mark the strategy's training step."""
        self._unmark()  # a mark left by a fit that ended without on_fit_end or on_exception
        self._say_skipped()  # that fit's, into its run (finished by `start` below)
        # trainer.log_dir broadcasts from rank 0 under DDP: every rank reads it, attached or not.
        log_dir = trainer.log_dir or trainer.default_root_dir
        # fast_dev_run suppresses Lightning's logging and checkpoints: a run of its own elsewhere.
        dev_run = None
        # Trainer.fast_dev_run is set by Lightning's debugging flags, undeclared on the class.
        if getattr(trainer, "fast_dev_run", False) and not self._fit.explicit_dir:
            dev_run = log_dir = _dev_run_directory(trainer)
        resuming = trainer.ckpt_path is not None and dev_run is None
        # Only automatic optimization skips a backward for a step that returned None.
        self._skipped = SkippedBackwards() if pl_module.automatic_optimization else None
        directory = self._fit.start(
            pl_module,
            Path(log_dir),
            main_process=trainer.is_global_zero,
            logger_sink=lambda: _logger_sink(trainer),
            global_step=lambda: trainer.global_step,
            resuming=resuming,  # fit(ckpt_path=...): continue the run
            checkpoint_run=self._checkpoint_run if resuming else None,
            checkpoint=None if trainer.ckpt_path is None else path_span(trainer.ckpt_path),
            # trainer.global_step is restored from a checkpoint only after this hook
            resume_step=trainer.global_step if trainer.ckpt_path is None else self._checkpoint_step,
            grad_scaler=trainer_scaler(trainer.precision_plugin),  # precision="16-mixed"
            sinks=() if self._skipped is None else (self._skipped,),
        )
        self._checkpoint_run = self._checkpoint_step = None  # a later fit reads its own
        self._axes_said = False  # each fit says once that its steps are off the logger's
        self._mid_step_said, self._batch_stepped = False, True
        if directory is not None:
            self._step_mark = TrainingStepMark(trainer.strategy, self._fit)
            self._fit.enter_setup()  # the model summary's example input is not an evaluation
            if (said := _tuner_note(trainer)) is not None and self._fit.observed is not None:
                add_run_note(self._fit.observed, said)
                warn(f"torchinstruments: LightningObserver: {said}")
            if dev_run is not None and self._fit.observed is not None:
                said = _dev_run_note(directory)
                add_run_note(self._fit.observed, said)
                warn(f"torchinstruments: LightningObserver: {said}")

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The fit's setup ends: the sanity check's forwards are evaluation forwards."""
        self._fit.leave_setup()
        observed = self._fit.observed
        self._before_sanity = None if observed is None else observed_counts(observed)

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """With record_eval, index.md says which evaluation samples the sanity check took."""
        observed, before = self._fit.observed, self._before_sanity
        after = None if observed is None else observed_counts(observed)
        if observed is None or before is None or after is None or self._fit.eval_sampler is None:
            return
        forwards = (after.eval_forwards or 0) - (before.eval_forwards or 0)
        samples = after.samples - before.samples
        if samples:
            add_run_note(observed, _sanity_note(forwards, samples, trainer.global_step))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The fit's setup ends (without a sanity check): the training loop starts."""
        self._fit.leave_setup()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Say in index.md when the epoch is StochasticWeightAveraging's batch-norm update."""
        observed = self._fit.observed
        if observed is None:
            return
        # Trainer.callbacks is set by Lightning's callback connector, undeclared on the class.
        for callback in getattr(trainer, "callbacks", ()):
            if (
                isinstance(callback, StochasticWeightAveraging)
                and trainer.current_epoch == callback.swa_end + 1
            ):
                add_run_note(observed, _swa_note(trainer.current_epoch, trainer.global_step))

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """The global step a training batch starts at (its optimizer steps are told at its end)."""
        self._batch_step = trainer.global_step
        if self._skipped is not None:
            self._skipped.batch_start()

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """After the first batch: warn if no training forward called the observed module; in
        manual optimization, say once when a batch did not step the global step by exactly one;
        in automatic optimization, tell a batch whose training_step returned None."""
        self._fit.check_first_step()
        # Automatic optimization's outputs: {"loss": ...}, or {} when training_step returned None.
        if self._skipped is not None and (outputs is None or outputs == {}):
            said = self._skipped.skipped(batch_idx, self._batch_step)
            if said is not None:
                warn(f"torchinstruments: LightningObserver: {said}")
                if self._fit.observed is not None:  # the note on disk now: a kill keeps it
                    save_run_now(self._fit.observed)
        advance = trainer.global_step - self._batch_step
        self._batch_stepped = advance != 0
        if advance != 1 and not pl_module.automatic_optimization and not self._axes_said:
            self._axes_said = True
            if self._fit.observed is not None:
                said = _step_axes_note(batch_idx, advance)
                add_run_note(self._fit.observed, said)
                warn(f"torchinstruments: LightningObserver: {said}")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """With record_eval, say once when a validation of the fit starts between the
        micro-batches of an accumulated step: Lightning logs it under its samples' own step."""
        self._outside_fit(trainer)
        observed = self._fit.observed
        if (
            observed is None
            or self._fit.eval_sampler is None
            or self._mid_step_said
            or self._batch_stepped
            or trainer.sanity_checking
            or not pl_module.automatic_optimization
        ):
            return
        self._mid_step_said = True
        said = _mid_step_note(trainer.global_step)
        add_run_note(observed, said)
        warn(f"torchinstruments: LightningObserver: {said}")

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """With record_eval: the batch's evaluation samples are its dataloader's."""
        if self._fit.eval_sets is not None:
            self._fit.eval_sets.running(f"dataloader_idx_{dataloader_idx}")

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """With record_eval: forwards after the batch are of no dataloader."""
        if self._fit.eval_sets is not None:
            self._fit.eval_sets.running(None)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Before any fit: warn once that `trainer.test()` runs unobserved."""
        self._outside_fit(trainer)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Before any fit: warn once that `trainer.predict()` runs unobserved."""
        self._outside_fit(trainer)

    def _outside_fit(self, trainer: Trainer) -> None:
        """`trainer.validate()`, `test()` or `predict()` before any fit: said once."""
        call = trainer.state.fn
        if call is not None and call != "fit":
            self._fit.ran_outside_a_fit(
                f"trainer.{call.value}()", "trainer.fit()", trainer.is_global_zero
            )

    def state_dict(self) -> dict[str, Any]:
        """Saved in a checkpoint: the run directory, which a fit resumed from it continues."""
        run = self._fit.run_directory
        return {} if run is None else {"run_directory": str(run)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint's run directory, for the fit resuming from it (restored before
        `on_fit_start`, or after it by a strategy that restores after setup: then noted)."""
        saved = state_dict.get("run_directory")
        self._checkpoint_run = Path(saved) if isinstance(saved, str) else None
        if self._checkpoint_run is not None and self._fit.observed is not None:
            self._fit.checkpoint_restored_late(self._checkpoint_run)
            self._checkpoint_run = None

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The checkpoint's global step, where the resumed fit starts (Lightning restores
        `trainer.global_step` only after `on_fit_start`)."""
        step = checkpoint.get("global_step")
        self._checkpoint_step = step if isinstance(step, int) else None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Unmark and remove: restores every forward, writes history.parquet, result.json,
        index.md."""
        self._unmark()
        self._say_skipped()
        self._fit.finish(completed=True)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        """Unmark and remove, with a note in index.md that the fit raised, and at which step."""
        self._unmark()
        self._say_skipped()
        self._fit.finish(exception, trainer.global_step)

    def _say_skipped(self) -> None:
        """index.md: the fit's training samples whose backward Lightning skipped."""
        skipped, self._skipped = self._skipped, None
        said = None if skipped is None else skipped.final_note()
        if said is not None and self._fit.observed is not None:
            add_run_note(self._fit.observed, said)

    def _unmark(self) -> None:
        """Put back the strategy's own `training_step`."""
        mark, self._step_mark = self._step_mark, None
        if mark is not None:
            mark.undo()


def _dev_run_directory(trainer: Trainer) -> Path:
    """A fresh temporary directory for a `fast_dev_run` fit's run, made by the global-zero
    process and broadcast, so that every rank writing its own run (`rank_policy="all"`) writes
    into the same one, as it would under `trainer.log_dir` (itself broadcast from rank 0)."""
    made = ""  # another rank's: replaced by rank 0's
    if trainer.is_global_zero:
        made = tempfile.mkdtemp(prefix="torchinstruments-fast_dev_run-")
    return Path(trainer.strategy.broadcast(made))


def _dev_run_note(directory: Path) -> str:
    """index.md's note (and the warning) on a fit under `fast_dev_run`.

    Lightning's `fast_dev_run` is a smoke test of the loops (a batch or a few of each, checked
    on Lightning 2.6.6): it replaces the loggers with a `DummyLogger`, so `trainer.log_dir` is
    None, and saves no checkpoint. Observing it still runs everything the callback does (a
    misconfigured `module=` is warned after the first step), but writing the run into the
    working directory, which the default otherwise falls back to, would leave one more
    `torchinstruments-N` there at every smoke test, and continuing a checkpoint's run would add
    the smoke test to the real run as an attempt; so it is a fresh run in a temporary
    directory, said where, and `output_dir=` (which always wins) keeps it where the user wants.
    """
    return (
        "this fit ran under Lightning's fast_dev_run, which suppresses the trainer's logging "
        f"and checkpointing, so LightningObserver writes its run to a temporary directory, "
        f"{path_span(directory)}, not under the trainer's log directory or the working directory, as a "
        "fresh run (a checkpoint's run is not continued, and the trainer's TensorBoard logger "
        "gets no histograms); pass LightningObserver(output_dir=...) to write it elsewhere"
    )


def _tuner_note(trainer: Trainer) -> str | None:
    """index.md's note on the trials the fit's tuner callbacks ran at its start, before this
    callback attached (None: none ran).

    Lightning puts tuner callbacks first, so a `LearningRateFinder` or `BatchSizeFinder` whose
    `on_fit_start` is the tuner's own has run its trials when `on_fit_start` reaches this
    callback, each a short run of the training loop (its validation too, where the fit
    validates), after which the trainer restores the model's weights and its global step
    (checked on Lightning 2.6.6). A subclass that tunes in another hook is not told here.
    """
    tuners = []
    # Trainer.callbacks is set by Lightning's callback connector, undeclared on the class.
    for callback in getattr(trainer, "callbacks", ()):
        hook = type(callback).on_fit_start
        if isinstance(callback, LearningRateFinder) and hook is LearningRateFinder.on_fit_start:
            found = callback.optimal_lr
            steps = len(found.results.get("lr", ())) if found is not None else 0
            tuners.append(f"LearningRateFinder ({plural(steps, 'training step')})")
        elif isinstance(callback, BatchSizeFinder) and hook is BatchSizeFinder.on_fit_start:
            chosen = callback.optimal_batch_size
            tuners.append(f"BatchSizeFinder (trials per batch size tried; it chose {chosen})")
    if not tuners:
        return None
    return (
        "the fit's tuner callbacks ran their trials (short runs of the training loop) at its "
        f"start, before LightningObserver attached: {', '.join(tuners)}. Their forwards were "
        "not observed and no count here includes them (forward_index, the evaluation and "
        "setup forwards); the trainer then put back the model's weights and its global step, "
        "so `step` counts the fit's own training steps"
    )


def _swa_note(epoch: int, step: int) -> str:
    """index.md's note on StochasticWeightAveraging's batch-norm update: with batch norm in the
    model, it adds an epoch after the last (`swa_end + 1`) that copies the averaged weights into
    the model and runs every training batch through `training_step` with the backward skipped
    and one optimizer step at its end (checked on Lightning 2.6.6), to recompute the running
    statistics. Its forwards are training forwards, sampled as such, but no gradient reaches
    them and they share one step: without a word they read as accumulation's micro-batches."""
    return (
        f"epoch {epoch} is StochasticWeightAveraging's batch-norm update (an epoch it adds "
        "after the last): the model holds the averaged weights and each training batch runs "
        "forward only, with no backward, to recompute the batch-norm running statistics. Its "
        f"training samples (step {step}, from here to the fit's end) have output rows and no "
        "output_gradient rows, and share that step: they describe the averaged model, not a "
        "training step"
    )


def _sanity_note(forwards: int, samples: int, step: int) -> str:
    """index.md's note on the sanity check's evaluation samples under `record_eval`: they are
    in the evaluation series as a validation's are, but of the model before training (the
    checkpoint's, in a resumed fit) over `num_sanity_val_steps` batches, which a reader of the
    validations may want to leave out; history has no column that marks them, so say where
    they are: the attempt's evaluation samples before its first training sample."""
    one = samples == 1
    return (
        f"the sanity check ran {plural(forwards, 'evaluation forward')} before the first "
        f"training step (num_sanity_val_steps), and record_eval took "
        f"{plural(samples, 'sample')} of them into the evaluation series, as a validation's: "
        f"{'it is' if one else 'they are'} this attempt's first evaluation "
        f"{'sample' if one else 'samples'} (step {step}, before its first training sample), "
        "a check of the model before training, not a validation of the fit's: leave "
        f"{'it' if one else 'them'} out to read the validations alone"
    )


def _step_axes_note(batch_idx: int, advance: int) -> str:
    """index.md's note when a manual optimization batch stepped the global step by `advance`,
    not one: Lightning counts every optimizer's `step()` in `trainer.global_step` (the `step`
    column, the histograms' step in its logger), but logs `self.log` scalars once per training
    batch (its loops' count of batches, checked on Lightning 2.6.6), so the axes part."""
    return (
        f"manual optimization: training batch {batch_idx} advanced trainer.global_step by "
        f"{advance} (it counts every optimizer's step() call), while Lightning logs the "
        "scalars of self.log once per training batch: the `step` column and the histograms "
        "in the trainer's TensorBoard logger (on trainer.global_step) are not on the step axis "
        "of the logger's scalars, so a join of `step` with the trainer's log pairs other "
        "batches' values (it holds only where every batch takes one optimizer step)"
    )


def _mid_step_note(step: int) -> str:
    """index.md's note when a validation ran between the micro-batches of an accumulated step.

    Lightning logs a validation's metrics under its count of batches that stepped the optimizer
    (checked on Lightning 2.6.6), which it raises only after the validation that follows such a
    batch: one less than `trainer.global_step` after a batch that stepped, equal to it after
    one that did not (`val_check_interval` not a multiple of `accumulate_grad_batches`). Such a
    validation's metrics are then on its samples' own step, not on the step below."""
    return (
        f"the validation at global step {step} ran between the micro-batches of an "
        "accumulated step (a training batch that did not step the optimizer came before it: "
        "val_check_interval is not a multiple of accumulate_grad_batches), and so may others "
        "of the fit: Lightning logs such a validation's metrics under the step its evaluation "
        "samples carry, not one lower as after a batch that stepped, so the `+ 1` of the "
        "evaluation query below pairs these samples with another validation's metrics, or "
        "none; the eval/ histograms in its TensorBoardLogger are on that same step as its "
        "scalars"
    )


def _logger_sink(trainer: Trainer) -> Sink | None:
    """The trainer's first TensorBoardLogger as a sink on `trainer.global_step`, else None."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return TensorBoardSink(
                logger,
                step=lambda: trainer.global_step,
                step_name="the trainer's global_step (optimizer steps so far)",
                logger_name=LOGGER,
            )
    return None
