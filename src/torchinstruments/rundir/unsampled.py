"""Why a run holds no sample, in the words remove_observer's warning and index.md share.

A run can end without a sample for reasons its reader cannot see in an empty history: the
sampler chose none of the forwards seen, a trainer callback passed its forwards through
unobserved (evaluation, setup), the model was never called because a module built from it
after inject_observer ran its layers instead (`bypass.py`), or a continued run's new attempt
sampled nothing while the earlier attempts' rows are still there. The warning at removal and
index.md's "No sample was recorded" line say which, from the run's counts alone, in the same
words (index_page.py renders the line, api.py warns).
"""

from __future__ import annotations

from pathlib import Path

from torchinstruments.records import RunCounts
from torchinstruments.rundir.attempts import Continuation
from torchinstruments.rundir.ranges import plural, was_were
from torchinstruments.rundir.shell import literal_if_unclear

__all__ = [
    "NO_TRAINING_STEP",
    "STEP_BYPASSED",
    "bypass_clause",
    "no_sample_warning",
    "passed_through",
    "unsampled_sentence",
]

# The opening of a trainer callback's note that its training steps never called the observed
# module (integrations/_fit.py): the counts then cannot tell the fit from a loop that never
# called the model, the note can, and it is kept in the run's state with the counts.
STEP_BYPASSED = "the first training step never called the observed"
# The opening of a trainer callback's note that its fit ended before any training step (its
# step limit reached already: a fit resumed from the checkpoint of its last step), which says why.
NO_TRAINING_STEP = "the fit ran no training step"


def passed_through(counts: RunCounts) -> str | None:
    """The forwards a trainer callback passed through unobserved, in the words index.md and
    remove_observer's warning share (`2 evaluation forwards ran unobserved`); None when none
    did (a plain loop) or when that is unknown (a state written before these counts)."""
    evaluation, setup = counts.unobserved_eval_forwards, counts.unobserved_setup_forwards
    said = [
        *([plural(evaluation, "evaluation forward")] if evaluation else []),
        *([plural(setup, "setup forward") + " (before the fit's first loop)"] if setup else []),
    ]
    return " and ".join(said) + " ran unobserved" if said else None


def no_sample_warning(counts: RunCounts, directory: Path, earlier: Continuation | None) -> str:
    """remove_observer's warning when its observer took no sample. In a continued run (a fit
    resumed from the checkpoint of its last step trains nothing) the directory still holds the
    earlier attempts' rows, and index.md shows this attempt's zero in its Attempts table: say
    that, as much as is known. The ids they took count samples whose rows never reached
    history (a killed attempt's last flush interval, the loss ledger's), at least as many after
    a kill (index.md's "at least"), so the samples history holds are counted apart."""
    passed = passed_through(counts)
    seen = f"{plural(counts.root_forwards, 'root forward')} seen, none sampled" + (
        "" if passed is None else f"; {passed}"
    )
    if counts.bypassed_by is not None and not counts.root_forwards:
        seen = f"{seen}; {bypass_clause(counts.bypassed_by)}"
    if earlier is None or not earlier.first_sample_id:
        return (
            f"torchinstruments: no sample was recorded ({seen}): "
            f"{literal_if_unclear(str(directory))} holds no rows, "
            "and its index.md says so"
        )
    said = f"torchinstruments: this attempt recorded no sample ({seen}): "
    said += f"{literal_if_unclear(str(directory))} holds"
    taken, held, killed = earlier.first_sample_id, earlier.samples_held, earlier.after_a_kill
    ids = "0" if taken == 1 else f"0 to {taken - 1}"
    if held == taken and not killed:
        return (
            f"{said} the earlier attempts' {plural(taken, 'sample')} (sample_id {ids}) and "
            "none of this one's; its index.md's Attempts table says so"
        )
    more, why = (
        (" and perhaps more", "a killed attempt's last rows died with it")
        if killed
        else ("", "the rest were recorded but not written, as index.md says")
    )
    return (
        f"{said} none of its rows, and rows of {held} "
        f"of the {'at least ' if killed else ''}{plural(taken, 'sample')} the earlier attempts took "
        f"(sample_id {ids}{more}; {why}); its index.md's Attempts table says so"
    )


def bypass_clause(built_by: str) -> str:
    """Why no root forward was seen while a module built from the model after inject_observer
    exists (bypass.py), and the fix: the warning and index.md say it in these words."""
    compiled = "compile_regions" in built_by
    return (
        f"the model itself was never called, but {built_by} shares its "
        "layers and calls them with a forward of its own, so they ran unobserved: call "
        "inject_observer on that module"
        + (" (the one compile_regions returns)" if compiled else "")
        + " and remove_observer on it, not on the model"
    )


def unsampled_sentence(counts: RunCounts, notes: tuple[str, ...] = ()) -> str:
    """Why a removed run with selected layers holds no sample: what the observer saw, and what
    a trainer callback passed through unobserved. A model called only outside the training
    steps was called: it is never said to have been "never called", nor is a model whose
    passed-through forwards nobody counted, nor one whose fit's training steps bypassed it
    (`STEP_BYPASSED`, in `notes`, the run's notes beside its counts': they ran its parts), nor
    one whose fit ran no training step at all (`NO_TRAINING_STEP`: the note says why)."""
    passed = passed_through(counts)
    if counts.bypassed_by is not None and not counts.root_forwards:
        return bypass_clause(counts.bypassed_by)
    if counts.root_forwards:
        forwards = counts.root_forwards
        seen = f"{plural(forwards, 'root forward')} {was_were(forwards)} seen and the sampler chose none"
        return seen if passed is None else f"{seen} ({passed})"
    if any(NO_TRAINING_STEP in note for note in (*counts.notes, *notes)):
        said = f"{NO_TRAINING_STEP} (the note above says why)"
        return said if passed is None else f"{said}, and {passed}"
    if passed is not None:
        return f"no training forward called the model, and {passed}"
    if any(STEP_BYPASSED in note for note in (*counts.notes, *notes)):
        return (
            "the trainer's training steps ran without calling the model (the note above says "
            "which module to observe)"
        )
    if counts.unobserved_eval_forwards is None or counts.unobserved_setup_forwards is None:
        return (
            "no root forward was seen (whether a trainer callback passed forwards through "
            "unobserved is unknown: the run's state predates that count)"
        )
    return "the model was never called"
