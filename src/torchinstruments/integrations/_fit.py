"""One trainer fit observed from a callback: what the Lightning and Hugging Face callbacks share.

Design decision: a callback holds a `FitObservation`, built with the callback, which builds the
run's `ObserverConfig` then (so every `inject_observer` option is validated in the user's own line,
not at the start of a fit) and hands that very object to `api.start_run` at each fit; the trainer-
specific module only says which module to observe, where the trainer writes, whether this process is
the trainer's main one, and which TensorBoard logger and step it has. A fit that raised is removed
like a finished one, with a note in index.md saying so and where it stopped, so its run directory is
complete and never reads like an ordinary fit.

Training forwards are the samples (phases.py): the callback marks the trainer's training steps, and
every other forward of the observed module during the fit (sanity check, validation, the evaluation
the trainer runs during training, another callback's forwards) is an evaluation forward, unobserved
unless `record_eval` asks for it; then it is sampled on a schedule of its own and its rows (mode
`eval`) form their own series. The forwards of the fit's setup, before its first loop (Lightning's
model summary and logger graph of `example_input_array`), are neither: passed through, counted apart
and named in index.md, whatever `record_eval` says. The step column is the trainer's global step,
read at each sample. The run is the fit's: the trainer's evaluation, test or predict calls after the
fit (each callback names its trainer's) run after the observer was removed, so they are neither
observed nor counted (a run that went on past the fit would have no end a callback is told of).
The words of each note are `_fit_notes`'; this module decides when each is said.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from torchinstruments.api import has_observer, remove_observer, start_run
from torchinstruments.config import ObserverConfig, check_option_names
from torchinstruments.distributed import place_rank
from torchinstruments.global_option import check_same_on_every_rank
from torchinstruments.integrations._eval_sets import EvaluationSets
from torchinstruments.integrations._fit_notes import (
    after_the_fit,
    bypassed_note,
    exception_note,
    left_attached_note,
    no_training_step_note,
    not_continued_note,
    note_evaluation,
    outside_a_fit_warning,
    record_eval_note,
    sampler_line,
    setup_note,
    stale_note,
    unnamed_run_note,
)
from torchinstruments.integrations._repeats import (
    EarlierSteps,
    EvaluationSteps,
    earlier_steps,
    logger_repeats,
    repeated_evaluations,
)
from torchinstruments.integrations._run_dirs import (
    fresh_run_directory,
    last_run_directory,
    why_not_continued,
)
from torchinstruments.integrations._samplers import (
    evaluation_sampler,
    fresh_sampler,
    pristine_copy,
)
from torchinstruments.notices import warn
from torchinstruments.phases import SETUP, Phases
from torchinstruments.registry import (
    add_run_note,
    follow_step,
    observed_counts,
    observer_writing,
    removed_after_exception,
    trainer_phases,
)
from torchinstruments.rundir.attempt_states import BY_CHECKPOINT, BY_RETRY
from torchinstruments.rundir.layout import HISTORY_FILE
from torchinstruments.rundir.output_dir import resolve_output_dir
from torchinstruments.rundir.repeats import resumed_training_note
from torchinstruments.rundir.shell import literal_if_unclear
from torchinstruments.sinks.protocol import Sink

__all__ = ["FitObservation"]

LOGGER = "the trainer's TensorBoard logger"


class FitObservation:
    """Injects at the start of a fit, removes at its end or when it raised.

    Args:
        owner: the callback's name, for messages.
        output_dir: the run directory, or None for `fresh_run_directory(trainer's directory)`.
        module: which module to observe: None (the trainer's model), an attribute path of it
            (`"net"`, `"model.encoder"`), or a callable `model -> nn.Module`.
        options: any other `inject_observer` keywords (sampler, selector, reducers, sinks, ...).
        record_eval: False (evaluation forwards are not observed), True (they are sampled by
            a copy of the sampler, on the count of evaluation forwards), or a `Sampler` for them.
        after_fit: the trainer's calls that run the model after the fit, unobserved, as
            index.md names them (Lightning's `trainer.validate()`, `test()`, `predict()`).
        directory_name: the trainer's directory, as index.md names it (`trainer.log_dir`).
        evaluations: the trainer's evaluations inside a fit, as index.md names them.
        no_steps: why a fit of this trainer may end before its first training step, as
            index.md says it when one did.
        dataset_metrics: how the trainer names the metrics of each of several evaluation
            datasets, as index.md says it where a fit evaluated several (`_eval_sets`).

    Each fit's run is sampled by a fresh deep copy of the sampler (and of the evaluation
    sampler) as it was when the callback was built, so every fit starts its schedule afresh;
    a sampler that cannot be deep-copied is used as it is, and its state carries over.

    Raises:
        TypeError, ValueError: an option is invalid (the message names it).
    """

    def __init__(
        self,
        owner: str,
        output_dir: str | os.PathLike[str] | None,
        module: str | Callable[[nn.Module], nn.Module] | None,
        options: Mapping[str, Any],
        record_eval: object = False,
        *,
        after_fit: str = "evaluation, test or predict calls",
        directory_name: str = "the trainer's directory",
        evaluations: str = "sanity check, validation, evaluation the trainer runs during training",
        no_steps: str = "its step limit was reached already",
        dataset_metrics: str = "the trainer logs each one's metrics under its own name",
    ) -> None:
        if "model" in options:
            raise TypeError(
                f"{owner}: model is not an option: the trainer's model is observed (choose a part "
                "of it with module='attribute.path' or module=callable)"
            )
        if module is not None and not isinstance(module, str) and not callable(module):
            raise TypeError(
                f"{owner}: module must be None, an attribute path such as 'net', or a callable "
                f"model -> nn.Module, got {module!r}"
            )
        self.owner = owner
        self.after_fit = after_fit
        self.directory_name = directory_name
        self.evaluations = evaluations
        self.no_steps = no_steps
        self.dataset_metrics = dataset_metrics
        # Under record_eval: which evaluation dataset each evaluation sample is of (the
        # callback says which runs), said in index.md where the fit evaluated several.
        self.eval_sets: EvaluationSets | None = None
        self.module = module
        self.explicit_dir = output_dir is not None
        check_option_names(owner, options)
        # Built once, now, so a bad option fails in the user's own line; this very object is the
        # run's (`start_run`). Without output_dir the run's directory is chosen at each fit.
        self.config = ObserverConfig(output_dir=output_dir or ".", **options)
        self.eval_sampler = evaluation_sampler(owner, record_eval, self.config.sampler)
        if self.config.global_option is not None and self.eval_sampler is not None:
            try:  # its samples take the collectives too: the same rule as the sampler's
                check_same_on_every_rank(self.eval_sampler, "record_eval")
            except ValueError as refused:
                raise ValueError(f"{owner}: {refused}") from None
        # Copies as built, before any fit asks them: each fit gets a fresh copy of these.
        self._pristine_sampler = pristine_copy(self.config.sampler)
        self._pristine_eval = pristine_copy(self.eval_sampler)
        self.phases: Phases | None = None
        self.observed: nn.Module | None = None
        self.directory: Path | None = None
        # The run directory (before a rank's `rank-NNN/`) of the current or last fit, which a
        # trainer's checkpoint keeps so that a fit resumed from it continues that run.
        self.run_directory: Path | None = None
        self.logger_sink: Sink | None = None  # the trainer's TensorBoard logger, as a sink
        # A resumed fit's evaluation samples at steps earlier attempts evaluated at (record_eval),
        # what those attempts recorded, and the step it resumed at: said at its end.
        self._evaluations: EvaluationSteps | None = None
        self._earlier = EarlierSteps()
        self._resume_step = 0
        self._retried = False  # whether this fit is the trainer's retry of its loop (`start`)
        self._recording = False  # whether this fit records evaluation forwards (`start`)
        self._checked_first_step = False
        self._fits_started = 0  # fits this callback was told of (attached or not)
        # The fit's training steps so far (None: they cannot be told apart), and its step.
        self._training_steps: int | None = 0
        self._global_step: Callable[[], int] = lambda: 0
        self._outside_said = False

    def observed_module(self, model: nn.Module) -> nn.Module:
        """The module to inject into: the trainer's model, or the part `module` names."""
        if self.module is None:
            return model
        if isinstance(self.module, str):
            try:
                return model.get_submodule(self.module)
            except AttributeError as error:
                raise ValueError(
                    f"{self.owner}: module={self.module!r} names no submodule of "
                    f"{type(model).__name__} ({error}): pass the attribute path your training "
                    "step calls, such as module='net'"
                ) from None
        chosen = self.module(model)
        if not isinstance(chosen, nn.Module):
            raise TypeError(
                f"{self.owner}: module must return an nn.Module of the model, but module(model) "
                f"returned {chosen!r}: e.g. module=lambda model: model.net"
            )
        return chosen

    def start(
        self,
        model: nn.Module,
        trainer_directory: Path,
        *,
        main_process: bool,
        logger_sink: Callable[[], Sink | None],
        global_step: Callable[[], int],
        resuming: bool = False,
        checkpoint_run: Path | None = None,
        checkpoint: str | None = None,
        resume_step: int | None = None,
        grad_scaler: Any = None,
        sinks: tuple[Sink, ...] = (),
        retry: Path | None = None,
        steps_told: bool = True,
    ) -> Path | None:
        """Inject into the observed module; returns the run directory (None where not attached).

        Args:
            model: the trainer's model.
            trainer_directory: the trainer's log or output directory (the default's parent).
            main_process: whether the trainer calls this process its main (global zero) one;
                with `rank_policy="rank0"` only that process attaches.
            logger_sink: the trainer's TensorBoard logger as a sink, or None without one.
            global_step: the trainer's global step, read at each sample (history's `step`).
            resuming: the fit resumes from a checkpoint: continue the run (`resume=True`) in
                the output_dir given, else in `checkpoint_run`, else in the last run under the
                trainer's directory.
            checkpoint_run: the run directory the checkpoint names (None: it names none); a
                run there that this process cannot continue, or none named, is stated in
                index.md and a warning, and the last run under the trainer's directory is
                continued instead (or a new one started there).
            checkpoint: the checkpoint's name, for that note.
            resume_step: the global step the resumed fit starts at (the checkpoint's), to say
                in index.md which steps earlier attempts had recorded and this one trains again.
            grad_scaler: the trainer's loss scaler, if it scales the loss (float16 mixed
                precision): its scale of each sample is recorded unless the options name one.
            sinks: the callback's own sinks for this fit (what it learns from the samples).
            retry: the trainer runs its training loop again inside the same call (after the
                last loop's training step raised: auto_find_batch_size): continue that loop's
                run, `retry` (or the output_dir given), as a new attempt.
            steps_told: whether the callback can tell the trainer's training steps (False:
                every forward is on the sampler's schedule, and `record_eval` records none
                apart, so nothing of it is said: no count of evaluation forwards was kept).
        """
        if self.observed is not None and has_observer(self.observed):
            self._finish_stale()
        self._fits_started += 1
        config = self.config
        if config.rank_policy == "rank0" and not main_process:
            return None
        resume = resuming or config.resume or retry is not None
        directory, not_continued = None if self.explicit_dir else retry, None
        if resuming and checkpoint_run is not None and not self.explicit_dir:
            not_continued = why_not_continued(checkpoint_run, config.rank_policy)
            directory = checkpoint_run if not_continued is None else None
        if directory is None and not self.explicit_dir:
            pick = last_run_directory if resume else fresh_run_directory
            directory = pick(trainer_directory, config.rank_policy)
        # A checkpoint that names no run: the last run is continued, or a new one started.
        unnamed = resuming and checkpoint_run is None and not self.explicit_dir
        held = unnamed and directory is not None
        held = held and why_not_continued(directory, config.rank_policy) is None
        if resume:
            self._finish_left_attached(config.directory if directory is None else directory)
        sink = self.logger_sink = logger_sink()
        target = self.observed_module(model)
        if (left := trainer_phases(target)) is not None:  # another callback's fit, ended unseen
            left.fit_ended("when a fit with another callback started")
        eval_sampler = fresh_sampler(self._pristine_eval, self.eval_sampler)
        recording = self._recording = self.eval_sampler is not None and steps_told
        repeats = resume and resume_step is not None and recording
        self._evaluations = EvaluationSteps() if repeats else None
        self._retried = retry is not None
        self.eval_sets = EvaluationSets() if recording else None
        self.directory = start_run(
            target,
            config,
            directory=directory,
            resume=resume,
            continued_by=BY_CHECKPOINT if resuming else BY_RETRY if retry else None,
            extra_sinks=(
                *(s for s in (sink, self._evaluations, self.eval_sets) if s is not None),
                *sinks,
            ),
            sampler=fresh_sampler(self._pristine_sampler, config.sampler),
            sampler_line=self._sampler_line() if recording else None,
            grad_scaler=grad_scaler,
        )
        self.observed = target if self.directory is not None else None
        if self.observed is not None:
            self.run_directory = (
                config.directory if directory is None else resolve_output_dir(directory)
            )
            if not_continued is not None:
                self._note_not_continued(checkpoint_run, checkpoint, not_continued)
            if unnamed:
                self._note_unnamed_run(checkpoint, resume_step, held)
            if resume and resume_step is not None:
                self._note_repeats(resume_step)
            follow_step(self.observed, global_step)
            self.phases = trainer_phases(self.observed)
            if self.phases is not None and steps_told:
                self.phases.follow_trainer(eval_sampler)
            elif self.phases is not None:  # every forward trains
                self.phases.follow_every_forward()
            if recording:
                add_run_note(
                    self.observed,
                    record_eval_note(
                        self.owner, self.evaluations, self.eval_sampler, self._after_the_fit()
                    ),
                )
        self._checked_first_step = False
        self._training_steps = 0 if steps_told else None  # None: they cannot be told apart
        self._global_step = global_step
        return self.directory

    def _note_not_continued(self, run: Path | None, checkpoint: str | None, why: str) -> None:
        """index.md and a warning: the checkpoint's run could not be continued, this one was."""
        assert self.observed is not None
        said = not_continued_note(self.owner, checkpoint, run, why, self.run_directory)
        add_run_note(self.observed, said)
        warn(f"torchinstruments: {self.owner}: {said}")

    def _note_repeats(self, step: int) -> None:
        """index.md and a warning when this fit resumed behind the last step earlier attempts
        recorded (preempted after its last checkpoint; or the trainer's retry of its loop, from
        step 0 again, worded as such: `resumed_at`): those steps have samples in more than
        one attempt, which a join of `step` with the trainer's log would pair with one value.
        The evaluations it repeats are said when it ends (`_repeats`)."""
        assert self.observed is not None
        assert self.directory is not None
        earlier = self._earlier = earlier_steps(self.directory / HISTORY_FILE)
        self._resume_step = step
        if self._evaluations is not None:
            self._evaluations.watch(frozenset(s for _, s in earlier.evaluated))
        if (said := logger_repeats(self.logger_sink, step, LOGGER, self._retried)) is not None:
            add_run_note(self.observed, said)
        reached = earlier.trained
        if reached is None or reached < step:
            return
        said = resumed_training_note(step, reached, self._retried)
        add_run_note(self.observed, said)
        warn(f"torchinstruments: {self.owner}: {said}")

    def _note_unnamed_run(self, checkpoint: str | None, step: int | None, held: bool) -> None:
        """index.md and a warning: the checkpoint names no run, so the last run under the
        trainer's directory was continued (`held`) or a new one started (`unnamed_run_note`)."""
        assert self.observed is not None
        said = unnamed_run_note(
            self.owner, checkpoint, self.run_directory, self.directory_name, held, step
        )
        add_run_note(self.observed, said)
        warn(f"torchinstruments: {self.owner}: {said}")

    def checkpoint_restored_late(self, run: Path) -> None:
        """A checkpoint's run arrived after the fit started (a strategy that restores callback
        state after setup): say in index.md when this fit writes another run."""
        if self.observed is None or self.explicit_dir or self.run_directory == run:
            return
        self._note_not_continued(
            run, None, "the trainer restored the callback's state after the fit had started"
        )

    def _sampler_line(self) -> str | None:
        """index.md's sampler line under `record_eval` (None: the sampler's own line)."""
        if self.eval_sampler is None:
            return None
        return sampler_line(self.config.sampler, self.eval_sampler)

    def _after_the_fit(self) -> str:
        """index.md's sentence on the trainer's calls after the fit, as the user makes them."""
        return after_the_fit(self.after_fit)

    def ran_outside_a_fit(self, call: str, fit: str, main_process: bool) -> None:
        """The trainer's `call` (an evaluation, test or predict call) ran the model before any
        `fit` of this callback: warn once, since nothing else would say so (no run exists; after a
        fit, its index.md names such calls). The run is the fit's: they are not observed."""
        if self._fits_started or self._outside_said or not main_process:
            return
        self._outside_said = True
        warn(outside_a_fit_warning(self.owner, call, fit))

    def enter_setup(self) -> None:
        """The fit's setup (before its first loop): its forwards are neither training nor
        evaluation forwards (a model summary of an example input), passed through."""
        if self.phases is not None:
            self.phases.enter_setup()

    def leave_setup(self) -> None:
        """The fit's first loop starts (sanity check or training): the count of its setup
        forwards is final, and said now (a fit killed later keeps the note, the run state
        holds it at once; the fit's end says it again, one note)."""
        if self.phases is None:
            return
        setting_up = self.phases.current == SETUP
        self.phases.leave_setup()
        counts = observed_counts(self.observed) if setting_up and self.observed else None
        if counts is not None and self.observed is not None and counts.unobserved_setup_forwards:
            add_run_note(self.observed, setup_note(counts.unobserved_setup_forwards))

    def enter_training(self) -> None:
        """A training step starts: its forwards are training forwards."""
        if self._training_steps is not None:
            self._training_steps += 1
        if self.phases is not None:
            self.phases.enter_training()

    def leave_training(self) -> None:
        """A training step ended: forwards until the next one are evaluation forwards."""
        if self.phases is not None:
            self.phases.leave_training()

    def check_first_step(self) -> None:
        """After the first training step: warn when no training forward called the observed
        module. Training forwards, not root forwards: under `record_eval` the sanity check's
        forwards are root forwards too, and a step that bypasses the module must still be told."""
        if self._checked_first_step or self.observed is None:
            return
        self._checked_first_step = True
        counts = observed_counts(self.observed)
        if counts is None:
            return
        trained = counts.root_forwards if counts.train_forwards is None else counts.train_forwards
        if trained == 0:
            said = bypassed_note(self.observed)
            warn(f"torchinstruments: {self.owner}: {said}")
            add_run_note(self.observed, f"{self.owner}: {said}.")  # the run's reader sees why

    def finish(
        self,
        exception: BaseException | None = None,
        step: int | None = None,
        *,
        completed: bool = False,
    ) -> Path | None:
        """Remove the observer; with `exception`, index.md first says the fit raised there.
        `completed`: the trainer's end-of-fit event ended it (a fit that ran no training step
        is then said to have reached its step limit; one ended otherwise says why itself)."""
        observed, self.observed = self.observed, None
        self.phases = None
        if observed is None or not has_observer(observed):
            return None
        if completed and self._training_steps == 0:
            said = no_training_step_note(self._global_step(), self.no_steps)
            add_run_note(observed, said)
            warn(f"torchinstruments: {self.owner}: {said}")
        self._note_fit_end(observed)
        if exception is not None:
            where = f" at global step {step}" if step is not None else ""
            removed_after_exception(observed, f"{type(exception).__name__}{where}")
            add_run_note(observed, exception_note(self.owner, exception, where))
        return remove_observer(observed)

    def _note_fit_end(self, observed: nn.Module) -> None:
        """index.md at the fit's end: its evaluation and setup forwards, and the evaluations it
        repeated (the samples its TensorBoard logger left out are the sink's note at removal)."""
        note_evaluation(
            observed, self.owner, self.evaluations, self._recording, self._after_the_fit()
        )
        sets, self.eval_sets = self.eval_sets, None
        if sets is not None and (said := sets.note(self.dataset_metrics)) is not None:
            add_run_note(observed, said)
        evaluations, self._evaluations = self._evaluations, None
        if evaluations is not None:
            said = repeated_evaluations(
                self._earlier, evaluations.counts(), self._resume_step, self._retried
            )
            if said is not None:
                add_run_note(observed, said)
                warn(f"torchinstruments: {self.owner}: {said}")

    def _finish_left_attached(self, run: Path) -> None:
        """A resumed fit continues `run`, which an observer of this process still writes: an
        earlier fit's, left attached when it ended without the end-of-fit callback (an
        exception outside its training step), whose callback is not this one (a trainer and
        callback built anew to resume, as in a notebook). It is finished as `_finish_stale`
        finishes this callback's own; left attached, it held the run's lock, and the resumed
        fit raised RunLockedError in its first callback."""
        written = place_rank(resolve_output_dir(run), self.config.rank_policy).directory
        stale = observer_writing(written)
        if stale is None:
            return
        said = left_attached_note(self.owner)
        add_run_note(stale, said)
        note_evaluation(stale, self.owner, self.evaluations, None, self._after_the_fit())
        warn(f"torchinstruments: {self.owner}: {literal_if_unclear(str(written))}: {said}")
        remove_observer(stale)

    def _finish_stale(self) -> None:
        """A new fit while the last one's observer is still attached: it ended without a word."""
        assert self.observed is not None
        add_run_note(self.observed, stale_note(self.owner))
        warn(
            f"torchinstruments: {self.owner}: the previous fit's observer was still attached "
            "(its fit ended without an end-of-fit callback); its run "
            f"{literal_if_unclear(str(self.directory))} is finished now, before this fit starts"
        )
        self._note_fit_end(self.observed)
        remove_observer(self.observed)
        self.observed = None
        self.phases = None
