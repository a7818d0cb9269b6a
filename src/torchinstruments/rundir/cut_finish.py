"""Who was finishing a run whose finish a kill cut: remove_observer, or the run's finish without
it (when the observed model was garbage collected, or at the process's exit:
`torchinstruments.unremoved`).

Design decision: the state file says that a finish began and where it stood
(`RunState.removal_step`), not who ran it. The note of an attempt finished without
remove_observer (`UNREMOVED_NOTE`), which its process wrote into the state file before that
finish began (the live save at its last flush, and the state of every later step), says it.
So every reader asks here: `show`, index.md's status query, a parent page's rank cell and query,
and `finalize`, which puts one note in place of that one (`cut_unremoved_note`): "the run was
being finished at the process's exit; that finish did not complete: ..." never sits beside a
note saying the run was finished then, nor beside one naming remove_observer, which never ran.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchinstruments.rundir.attempts import UNREMOVED_NOTE, AttemptCounts, attempt_notes
from torchinstruments.rundir.state import (
    KILLED_IN_REMOVAL,
    RunState,
    kill_cost,
    removal_doing,
)

__all__ = [
    "AT_EXIT",
    "COLLECTED",
    "FINISH_CUT",
    "cut_unremoved_note",
    "finisher",
    "finisher_text",
    "finishing_said",
    "killed_in_finish",
    "unremoved_note",
]

# Where a run without remove_observer was finished, as its note says (`unremoved.unremoved_note`).
COLLECTED = "when the observed model was garbage collected"
AT_EXIT = "at the process's exit"
# What the note says once `finalize` completed such a finish that a kill cut.
FINISH_CUT = "that finish did not complete"
_FINISHED = "the run was finished"  # how each form of the unremoved note says the finish


def unremoved_note(notes: Sequence[str], attempts: Sequence[AttemptCounts]) -> str | None:
    """The note of the last attempt saying it was finished without remove_observer (labelled
    with that attempt once the run has several, `attempts.attempt_notes`), else None."""
    label = attempt_notes(attempts[-1].attempt, ("",))[0] if len(attempts) > 1 else ""
    return next((n for n in notes if n.startswith(label + UNREMOVED_NOTE)), None)


def finisher(state: RunState) -> str:
    """Who was finishing `state`'s run: `remove_observer`, or `the run's finish at the
    process's exit (without remove_observer)` (or when its model was garbage collected)."""
    note = unremoved_note(state.notes, state.attempts)
    if note is None:
        return "remove_observer"
    return (
        f"the run's finish {COLLECTED if COLLECTED in note else AT_EXIT} (without remove_observer)"
    )


def finishing_said(state: RunState, ended: bool | None, finalize_command: str) -> str:
    """`show`'s state of a run being finished (`RunState.removal_step`), by remove_observer or
    without it (`finisher`), its process `ended` (None: unknown) as finalize tells
    it: no process holds the run's lock."""
    doing, by = removal_doing(state.removal_step or ""), finisher(state)
    if ended:
        return (
            f"interrupted during {by}, while {doing}: no process holds the run's lock (killed "
            f"or crashed); `{finalize_command}` completes it"
        )
    if by == "remove_observer":
        return (
            f"being removed: remove_observer was {doing} (if its process is gone, it was killed "
            f"during removal, or removal gave that write up: `{finalize_command}` completes it)"
        )
    return (
        f"being finished: {by} was {doing} (if its process is gone, it was killed during that "
        f"finish, or the finish gave that write up: `{finalize_command}` completes it)"
    )


def finisher_text() -> str:
    """`finisher` as plain Python over the state file's JSON, for index.md's queries (which
    run without the library)."""
    return f'''def finisher(state: dict) -> str:
    """Who was finishing a run its state file says was being finished (`removal_step`):
    remove_observer, or the run's finish without it (its last attempt's note says so)."""
    attempts = state.get("attempts") or []
    label = f"attempt {{attempts[-1]['attempt']}}: " if len(attempts) > 1 else ""
    for note in state.get("notes") or []:
        if note.startswith(label + "{UNREMOVED_NOTE}"):
            where = "{COLLECTED}" if "{COLLECTED}" in note else "{AT_EXIT}"
            return f"the run's finish {{where}} (without remove_observer)"
    return "remove_observer"'''


def cut_unremoved_note(note: str, step: str) -> str:
    """The note `finalize` puts in place of `note` (`unremoved_note`) once the finish that a
    kill cut at removal's `step` is completed: the run was being finished then, and what that
    kill may have cost (as `state.killed_in_removal` says it for remove_observer)."""
    head = note.removesuffix(".").split("; it holds the samples taken until then")[0]
    head = head.replace(_FINISHED, "the run was being finished", 1)
    return f"{head}; {FINISH_CUT}: {kill_cost(step, 'that finish')}"


def killed_in_finish(note: str) -> bool:
    """Whether `note` is `finalize`'s of a finish a kill cut (remove_observer's, or one
    without it), which `show` and `finalize` repeat beside the state."""
    return KILLED_IN_REMOVAL in note or (UNREMOVED_NOTE in note and FINISH_CUT in note)
