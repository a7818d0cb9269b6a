"""What index.md and the warnings say of a trainer fit: its words, never its state.

Design decision: the notes a callback writes about a fit (what it did not record, which run a
resumed fit continued and why, how it ended) are built here from plain values, and `_fit` (the
fit's life: inject, follow, remove) only decides when each is said. A text from outside the
library (a checkpoint's path, a run directory, an exception's message) is quoted as the rest of
the library quotes it (`rundir.shell`): a path as a code span of its literal (`path_span`), so one
holding a backtick, a `|`, a `*` or a line break reads back as itself in index.md, and cannot
split the note's line or render as markup.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from torchinstruments.registry import add_run_note, observed_counts
from torchinstruments.rundir.attempts import TWO_SCHEDULES
from torchinstruments.rundir.ranges import plural, was_were
from torchinstruments.rundir.shell import error_said, literal_span
from torchinstruments.rundir.unsampled import NO_TRAINING_STEP, STEP_BYPASSED
from torchinstruments.sampling import describe_sampler

__all__ = [
    "after_the_fit",
    "bypassed_note",
    "exception_note",
    "left_attached_note",
    "no_training_step_note",
    "not_continued_note",
    "note_evaluation",
    "outside_a_fit_warning",
    "path_span",
    "record_eval_note",
    "sampler_line",
    "setup_note",
    "stale_note",
    "unnamed_run_note",
]


def path_span(path: str | Path) -> str:
    """A path from outside (a checkpoint, a run directory) as a note names it: a code span of
    its literal (`rundir.shell.literal_span`), which reads back as the path itself."""
    return literal_span(str(path))


def after_the_fit(calls: str) -> str:
    """index.md's sentence on the trainer's `calls` after the fit, as the user makes them."""
    return f"{calls} after the fit run after the observer was removed: not observed, not counted."


def sampler_line(sampler: object, eval_sampler: object) -> str:
    """index.md's sampler line under `record_eval`: what each sampler is asked with, since
    forward_index then counts evaluation forwards too."""
    return (
        f"{describe_sampler(sampler)}, asked with the count of training "
        f"forwards; evaluation forwards: {describe_sampler(eval_sampler)}, "
        f"{TWO_SCHEDULES}. forward_index counts both, so the values named here are not the "
        "samples' forward_index; the `step` column is the trainer's global step"
    )


def record_eval_note(owner: str, evaluations: str, eval_sampler: object, after: str) -> str:
    """index.md's note at the start of a fit under `record_eval` (`evaluations`: the trainer's
    evaluations inside a fit; `after`: `after_the_fit`)."""
    return (
        f"evaluation forwards inside the fit ({evaluations}: every forward outside a training "
        "step but the fit's setup forwards, and those under no_grad inside a training step, "
        "which no backward follows, as generate()'s) are recorded as their own series "
        f"({owner}, record_eval): sampled by {describe_sampler(eval_sampler)} on the count of "
        "evaluation forwards, so they never move the training schedule; their rows have mode "
        f"eval. {after}"
    )


def not_continued_note(
    owner: str, checkpoint: str | None, run: Path | None, why: str, continued: Path | None
) -> str:
    """index.md's note (and the warning) when the checkpoint's `run` could not be continued
    (`why`), and `continued` was instead (`checkpoint`: the trainer's words for it, a path
    already quoted by `path_span`)."""
    return (
        f"this fit resumed from the checkpoint {checkpoint or '(unnamed)'}, whose run "
        f"{path_span(str(run))} could not be continued ({why}); {owner} continued "
        f"{path_span(str(continued))} instead (the last run under the trainer's directory, or a "
        "new one there)"
    )


def unnamed_run_note(
    owner: str,
    checkpoint: str | None,
    run: Path | None,
    directory_name: str,
    held: bool,
    step: int | None,
) -> str:
    """index.md's note (and the warning) when the checkpoint names no run (written without the
    callback, or by a release whose checkpoints did not keep it): the last run under the
    trainer's directory `run` was continued (`held`), which may not be the one that wrote the
    checkpoint, or a new run started there, whose first step is the checkpoint's and not 0."""
    said = (
        f"this fit resumed from the checkpoint {checkpoint or '(unnamed)'}, which names no "
        f"run (written without {owner}, or by a torchinstruments release whose "
        f"checkpoints did not keep it); {owner} "
    )
    if held:
        return said + (
            f"continued {path_span(str(run))}, the last run under {directory_name}, which may not "
            "be the run that wrote the checkpoint"
        )
    at = "" if step is None else f" (global step {step})"
    return said + (
        f"started {path_span(str(run))}, a new run, since {directory_name} holds no run to "
        f"continue: its first samples are at the checkpoint's step{at}, and the steps trained "
        "before the checkpoint are in no attempt of it"
    )


def outside_a_fit_warning(owner: str, call: str, fit: str) -> str:
    """The warning when the trainer's `call` ran the model before any `fit` of the callback."""
    return (
        f"torchinstruments: {owner}: {call} ran before any {fit} with this callback "
        f"and was not observed: {owner} observes {fit} (its training steps, and the "
        "evaluation inside it with record_eval), so no run directory was written for it; "
        "call inject_observer(model, ...) and remove_observer(model) around it to record it"
    )


def bypassed_note(observed: nn.Module) -> str:
    """The warning's and index.md's words when the first training step never called the
    observed module, naming its submodules to pass as `module=` (code spans: a name such as
    `_net_` rendered as emphasis outside one)."""
    children = [literal_span(name) for name, _ in observed.named_children()]
    shown = ", ".join(children[:8]) + (", ..." if len(children) > 8 else "")
    its = f"; its submodules: {shown}" if children else ""
    return (
        f"{STEP_BYPASSED} "
        f"{literal_span(type(observed).__name__)}, so no training forward is recorded (a "
        "training step that calls a submodule directly, e.g. self.net(x), bypasses it); "
        f"pass module='net' (the attribute your step calls{its}) to observe that module "
        "instead"
    )


def no_training_step_note(step: int, no_steps: str) -> str:
    """index.md's note (and the warning) on a fit that ended at global `step` without a
    training step (`no_steps`: why a fit of this trainer may)."""
    return (
        f"{NO_TRAINING_STEP}: it ended at global step {step} without one "
        f"({no_steps}), so none of its forwards could be a training sample"
    )


def exception_note(owner: str, exception: BaseException, where: str) -> str:
    """index.md's note on a fit that ended with `exception` (`where`: ` at global step N`)."""
    ended = "was interrupted" if isinstance(exception, KeyboardInterrupt) else "ended"
    return (
        f"the fit {ended} with an exception{where}: {error_said(exception)}. The run holds "
        f"this attempt's samples up to then ({owner} removed the observer when the trainer "
        "reported the exception)."
    )


def stale_note(owner: str) -> str:
    """index.md's note on a fit whose observer was still attached when the callback's next fit
    started: it ended without the end-of-fit callback."""
    return (
        f"the fit ended without the trainer's end-of-fit callback ({owner} removed the "
        "observer when the next fit started); an exception outside the training step is the "
        "likely cause"
    )


def left_attached_note(owner: str) -> str:
    """index.md's note on a fit left attached (`stale_note`) and finished by another callback's
    fit resumed from a checkpoint into its run."""
    return (
        f"the fit ended without the trainer's end-of-fit callback (an exception outside the "
        f"training step is the likely cause); a later fit that resumed from a checkpoint "
        f"continues this run, and its {owner} removed this fit's observer when it started"
    )


def note_evaluation(
    observed: nn.Module,
    owner: str,
    evaluations: str,
    recording: bool | None,
    after: str,
) -> None:
    """index.md: how many evaluation and setup forwards there were, and what became of them
    (`owner`: the callback's name; `evaluations`: its trainer's evaluations inside a fit;
    `recording`: whether record_eval recorded them; None: as the counts say, for another
    callback's fit; `after`: the sentence on the trainer's calls after the fit, said in every
    run: in the evaluation note where there is one (record_eval's is said at the fit's start),
    else alone, so a fit without evaluation still says what it did not record)."""
    counts = observed_counts(observed)
    if counts is None:
        return
    unobserved, setup = counts.unobserved_eval_forwards, counts.unobserved_setup_forwards
    if recording is None:
        recording = bool(counts.eval_forwards)
    if recording:
        seen = counts.eval_forwards or 0
        add_run_note(
            observed,
            f"{plural(seen, 'evaluation forward')} {was_were(seen)} seen (record_eval).",
        )
    elif unobserved:
        they, them = ("it takes", "it") if unobserved == 1 else ("they take", "them")
        add_run_note(
            observed,
            f"{plural(unobserved, 'evaluation forward')} inside the fit ({evaluations}: "
            "forwards outside a training step, and those under no_grad inside a training step, "
            f"which no backward follows, as generate()'s) {was_were(unobserved)} not observed: "
            f"{they} no sample and forward_index does not count {them} "
            f"({owner}(record_eval=True) records "
            f"evaluation forwards as their own series). {after}",
        )
    else:  # no evaluation note carries it: the trainer's calls after the fit are said alone
        add_run_note(observed, after)
    if setup:
        add_run_note(observed, setup_note(setup))


def setup_note(setup: int) -> str:
    """index.md's note on the fit's `setup` setup forwards (at least one), passed through."""
    one = setup == 1
    return (
        f"{plural(setup, 'setup forward')} at the fit's start, before its first loop "
        "(Lightning's model summary and the logger's graph of example_input_array, an "
        f"on_fit_start hook), {was_were(setup)} not observed, whatever record_eval says: "
        f"{'it is neither a training nor an evaluation forward, takes' if one else 'they are neither training nor evaluation forwards, take'} "
        "no sample, and neither forward_index nor the count of evaluation forwards "
        f"counts {'it' if one else 'them'}."
    )
