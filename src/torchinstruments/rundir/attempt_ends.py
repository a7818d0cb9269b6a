"""How the attempts of a run ended, in the one set of words every reader uses.

Design decision: index.md's state line, its counts line and Attempts table, `show` and
`finalize`'s summary all say an attempt's end from here, so that none says other than another.
An attempt whose process died in remove_observer's last flush (`rundir.state.LAST_PARTS`) had
remove_observer called: it is "killed during removal" everywhere, never one that "ended without
remove_observer" in one place and killed during removal in another; a plain kill of another
attempt of the same run is still said as one. A state written before attempts kept that end
(its entry says "killed") is read from the note `finalize` added when it closed the attempt.
"""

from __future__ import annotations

from pathlib import Path

from torchinstruments.rundir.attempt_states import BY_CHECKPOINT, BY_RESUME, BY_RETRY
from torchinstruments.rundir.attempts import (
    FINISHED_UNREMOVED,
    IN_PROGRESS,
    IN_REMOVAL,
    KILLED,
    KILLED_IN_LAST_FLUSH,
    AttemptCounts,
    attempt_total,
)
from torchinstruments.rundir.lock import writer_ended
from torchinstruments.rundir.ranges import few_ranges
from torchinstruments.rundir.state import LAST_PARTS, RunState, killed_in_removal, removal_doing

__all__ = [
    "DURING_LAST_FLUSH",
    "attempt_end",
    "attempt_ends_now",
    "attempts_said",
    "continued_said",
    "killed_before_last",
    "killed_flush",
    "last_finished",
    "unremoved_attempts",
    "unremoved_said",
]

DURING_LAST_FLUSH = (
    f"was killed or crashed during remove_observer, while {removal_doing(LAST_PARTS)}"
)

# Each end of an attempt whose process died, as killed before or during removal (an open one is
# said as it will be closed: a finish whose merge failed left it open).
_IN_REMOVAL = {KILLED_IN_LAST_FLUSH, IN_REMOVAL}
_UNREMOVED = {KILLED, IN_PROGRESS, *_IN_REMOVAL}


def attempt_end(state: RunState, entry: AttemptCounts) -> str:
    """`entry`'s end (`AttemptCounts.ended`); a "killed" one that the state's notes say died in
    removal's last flush (a state from before that end was kept) is "killed during removal"."""
    if entry.ended == KILLED and _noted_in_last_flush(state, entry):
        return KILLED_IN_LAST_FLUSH
    return entry.ended


def attempt_ends_now(state: RunState, directory: Path) -> list[str]:
    """Each attempt's end as a reader says it now (`show`'s attempts line, its JSON): one still
    open in the state (`in progress`, `in removal`) is said as the run's lock tells its process
    (`rundir.lock.writer_ended`, asked only then), never "in progress" for one whose process
    died before `finalize` closed it; nor "finished" for the last one while the state says its
    finish without remove_observer (at the exit, or at collection) began and never ended."""
    ends = [attempt_end(state, entry) for entry in state.attempts]
    if state.removal_step is not None and ends and ends[-1] == FINISHED_UNREMOVED:
        ends[-1] = IN_REMOVAL  # its finish at the exit began: finished once that finish ended
    if not any(end in (IN_PROGRESS, IN_REMOVAL) for end in ends):
        return ends
    ended = writer_ended(directory)
    if ended is None:
        still = "in progress, or ended without remove_observer"
    else:
        still = "ended without remove_observer, not finalized" if ended else IN_PROGRESS
    return [still if end in (IN_PROGRESS, IN_REMOVAL) else end for end in ends]


def attempts_said(state: RunState, directory: Path) -> str:
    """A continued run's attempts as `show` says them (`attempt_ends_now`): how many, how they
    continued the run (`continued_said`), and which ended how, `2, continued with resume=True
    (killed: attempt 0; removed: attempt 1)`; "" for a run of one attempt (its state says how it
    ended)."""
    if len(state.attempts) < 2:
        return ""
    ends: dict[str, list[int]] = {}
    for entry, end in zip(state.attempts, attempt_ends_now(state, directory), strict=True):
        ends.setdefault(end, []).extend(entry.numbers)  # a folded entry: each of its attempts
    said = "; ".join(
        f"{end}: attempt{'s' if len(which) > 1 else ''} {few_ranges(which)}"  # not "attempt 0-2"
        for end, which in ends.items()
    )
    return f"{attempt_total(state.attempts)}, {continued_said(state.attempts[1:])} ({said})"


def continued_said(later: tuple[AttemptCounts, ...]) -> str:
    """How the `later` attempts (all but the first) continued the run: `continued with
    resume=True` (the caller's option), `continued by a fit resumed from a checkpoint` (a trainer
    callback passed resume for it, the user did not), `continued by the trainer's retry of its
    training loop` (auto_find_batch_size), each with their attempts where they differ
    (`continued with resume=True in attempt 1 and by a fit resumed from a checkpoint in attempt
    2`: in words, not in parentheses, as `attempts_said` puts the ends in parentheses right
    after it), or `continued` alone where a state written before this was kept does not say."""
    how: dict[str | None, list[int]] = {}
    for entry in later:
        how.setdefault(entry.continued_by, []).extend(entry.numbers)
    words: dict[str | None, str] = {
        BY_RESUME: "with resume=True",
        BY_CHECKPOINT: "by fits resumed from checkpoints"
        if len(how.get(BY_CHECKPOINT, ())) > 1
        else "by a fit resumed from a checkpoint",
        BY_RETRY: "by the trainer's retries of its training loop in one train() call"
        if len(how.get(BY_RETRY, ())) > 1
        else "by the trainer's retry of its training loop in one train() call",
    }
    if len(how) == 1:
        [by] = how
        return f"continued {words[by]}" if by in words else "continued"
    each = [
        f"{words.get(by, 'in a way not recorded')} in attempt {few_ranges(which)}"
        for by, which in how.items()
    ]
    return "continued " + " and ".join(each)


def _noted_in_last_flush(state: RunState, entry: AttemptCounts) -> bool:
    """Whether `finalize`'s note of a kill in the last flush is `entry`'s: labelled with its
    attempt, or unlabelled (written while the attempt was the run's last) and it is the last."""
    note = killed_in_removal(LAST_PARTS)
    if f"attempt {entry.attempt}: {note}" in state.notes:
        return True
    return note in state.notes and entry.attempt == state.attempts[-1].attempt


def killed_before_last(state: RunState) -> tuple[int, ...]:
    """The attempts whose process died when a later attempt was finished (removed, or at its
    exit); empty for a run of one attempt or whose last attempt's process died. The state line
    names them: "the process" would read as the last attempt's, which was finished."""
    if len(state.attempts) < 2 or state.attempts[-1].counts_recovered:
        return ()
    return tuple(
        n for a in state.attempts if attempt_end(state, a) in _UNREMOVED for n in a.numbers
    )


def last_finished(state: RunState) -> str:
    """How the last attempt of a run was finished, after "the last attempt was": `removed`, or
    finished without remove_observer (when its model was collected or at its exit)."""
    if state.attempts and state.attempts[-1].ended == FINISHED_UNREMOVED:
        return f"{FINISHED_UNREMOVED} (see its note)"
    return "removed"


def unremoved_said(state: RunState, how: str = "") -> str:
    """Who ended unremoved and how, subject first: `the process ended without remove_observer`
    for a run of one attempt, else each attempt whose process died, grouped by its end
    (`attempt(s) 0 ended without remove_observer and attempt(s) 1 was killed or crashed during
    remove_observer, ...`). `how` follows "ended without remove_observer" (by what)."""
    plain = f"ended without remove_observer{how}"
    if len(state.attempts) < 2:
        noted = any(killed_in_removal(LAST_PARTS) in note for note in state.notes)
        during = noted or any(attempt_end(state, a) in _IN_REMOVAL for a in state.attempts)
        return f"the process {DURING_LAST_FLUSH if during else plain}"
    ends = [(n, attempt_end(state, a)) for a in state.attempts for n in a.numbers]
    before = [n for n, end in ends if end in _UNREMOVED and end not in _IN_REMOVAL]
    during = [n for n, end in ends if end in _IN_REMOVAL]
    said = [
        *([f"attempt(s) {few_ranges(before)} {plain}"] if before else []),
        *([f"attempt(s) {few_ranges(during)} {DURING_LAST_FLUSH}"] if during else []),
    ]
    return " and ".join(said) or f"the process {plain}"


def killed_flush(state: RunState) -> str:
    """The flush interval that bounds what the attempts whose process died may have lost, each
    attempt's own (a restarted job may pass another HistoryConfig): `flush_seconds=60.0 s` for a
    run of one attempt, `flush_seconds=20.0 s for attempt 0, 30.0 s for attempt 1` for several.
    An earlier attempt of a state written before attempts kept theirs is named, not quoted (the
    run's settings are its last attempt's)."""
    last = state.run.history.flush_seconds
    if len(state.attempts) < 2:
        return f"flush_seconds={last} s"
    known: dict[float, list[int]] = {}  # seconds -> its attempts (one entry per value: bounded)
    unknown: list[int] = []
    for entry in unremoved_attempts(state):
        seconds = entry.flush_seconds
        if seconds is None and entry is state.attempts[-1]:
            seconds = last
        if seconds is None:
            unknown.extend(entry.numbers)
        else:
            known.setdefault(seconds, []).extend(entry.numbers)
    each = [f"{s} s for attempt{'s' * (len(a) > 1)} {few_ranges(a)}" for s, a in known.items()]
    said = [f"flush_seconds={', '.join(each)}"] if known else []
    if unknown:
        said.append(
            f"flush_seconds attempt(s) {few_ranges(unknown)} ran with (their own HistoryConfig's, "
            "not kept by the version that wrote them, nor this page's)"
        )
    return " and ".join(said) or f"flush_seconds={last} s"


def unremoved_attempts(state: RunState) -> tuple[AttemptCounts, ...]:
    """The attempts whose process died (`unremoved_said` names them): how many decides whether
    what is said of their rows is "its" or "their"."""
    return tuple(a for a in state.attempts if attempt_end(state, a) in _UNREMOVED)
