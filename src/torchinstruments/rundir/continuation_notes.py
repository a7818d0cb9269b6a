"""What index.md and a warning say when a continued run's new attempt cannot simply go on.

Design decision: a run continued into the same directory (`resume=True`, a trainer's resumed fit)
is one run of several attempts, and index.md's metrics, focus and sampler lines are the last
attempt's. Where the new attempt measures other metrics, has other focus layers, or has samplers
that cannot continue where a killed attempt left them, the rows of the earlier attempts would
read as the whole run's: each of these is said once, at inject, in a warning and in index.md
(`continuation_notes`). Kept apart from `attempts`, which counts the attempts and plans where a
continued one starts.
"""

from __future__ import annotations

from torchinstruments.rundir.attempts import TWO_SCHEDULES, Continuation
from torchinstruments.rundir.ranges import few_ranges

__all__ = ["continuation_notes", "schedule_fallback_note", "setting_change_note"]


def continuation_notes(
    continuation: Continuation, metrics: tuple[str, ...], focus: tuple[str, ...]
) -> tuple[str, ...]:
    """What index.md and a warning say when a new attempt cannot simply go on where the earlier
    ones left: samplers that lost their counts, metrics or focus layers other than the attempt
    before's (index.md's lines of both are the last attempt's)."""
    earlier = continuation.attempt - 1
    notes = (
        schedule_fallback_note(continuation),
        # index.md's metrics line is the last attempt's, so without it a metric the earlier
        # attempt measured, or one it did not, would look like the whole run's
        setting_change_note(
            continuation.earlier_metrics,
            metrics,
            f"this attempt measures other metrics than attempt {earlier} did",
            "history has each of them only for the samples of the attempts that measured it, "
            "and index.md's metrics line is the last attempt's",
        ),
        # tensorboard/ then holds histograms of layers index.md's focus line (the last
        # attempt's) does not name, or lacks some it names, over the earlier attempts' steps
        setting_change_note(
            continuation.earlier_focus,
            focus,
            f"this attempt's focus layers are not attempt {earlier}'s",
            "tensorboard/ has each one's histograms only on the steps of the attempts that had "
            "it as a focus layer, and index.md's focus line is the last attempt's",
        ),
    )
    return tuple(note for note in notes if note)


def setting_change_note(
    before: tuple[str, ...] | None, now: tuple[str, ...], differs: str, so: str
) -> str | None:
    """The note when this attempt's names of a setting (its metrics, `reducers=`; its focus
    layers, `histogram_selector=` and `max_histogram_modules=`) are not the attempt before's:
    `differs (only there: ...; only here: ...), so ...`. None when they are the same set, or
    the attempt before left none (`before` None)."""
    if before is None or set(before) == set(now):
        return None
    return f"{differs} ({_only(before, now)}), so {so}"


def _only(before: tuple[str, ...], now: tuple[str, ...], most: int = 8) -> str:
    """`only there: a, b; only here: c`, at most `most` names each (then how many more)."""

    def named(names: list[str]) -> str:
        shown = ", ".join(names[:most]) or "none"
        return shown if len(names) <= most else f"{shown} and {len(names) - most} more"

    there = named([n for n in before if n not in now])
    return f"only there: {there}; only here: {named([n for n in now if n not in before])}"


def schedule_fallback_note(continuation: Continuation) -> str | None:
    """index.md's note when the new attempt's samplers could not continue where an earlier
    attempt with two schedules (`record_eval`) left them, since it died before writing its
    training and evaluation counts: where each sampler continues instead; None otherwise."""
    unknown = [
        n
        for a in continuation.attempts
        if (a.train_forwards is None or a.eval_forwards is None)
        and TWO_SCHEDULES in (a.sampler or "")
        for n in a.numbers  # a folded entry: each of its attempts
    ]
    if not unknown:
        return None
    which = few_ranges(unknown)  # bounded, however many attempts were killed
    return (
        f"attempt {which} ended without removal (killed) before it wrote how many training and "
        "how many evaluation forwards its samplers were asked about (record_eval), so this "
        "attempt's samplers cannot continue where it left them: the training sampler is asked "
        f"from {continuation.first_train_index} on (the run's root forwards so far as its rows "
        "and TensorBoard events show, evaluation forwards included) and the evaluation sampler "
        f"from {continuation.first_eval_index} on; an uninterrupted job's samplers would be "
        "asked with other counts, so this attempt's samples can be other forwards of a step or "
        "an evaluation than the earlier attempts' were"
    )
