"""Opening a run directory for a new attempt: `inject_observer(..., resume=True)`.

Design decision: the earlier attempt is completed by `rundir.finish.finalize`, the same code a
user would run, before anything of the new attempt is written, so a killed attempt is recorded
exactly as `finalize` records it (parts merged, losses in the ledger, a cut sample marked) and
its rows are never touched again. Then `rundir.attempts.plan_continuation` says where the new
attempt's ids start. Refusals name what to do: a live run (its lock is held) is never continued,
a directory holding only a leftover `tensorboard/` has no run to continue, and a model whose
selected layers differ from the run's would make one history of two models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import polars as pl

from torchinstruments.records import RunInfo
from torchinstruments.rundir.attempts import (
    KILLED,
    REMOVED,
    AttemptCounts,
    Continuation,
    plan_continuation,
)
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    PARTS_DIR,
    RUN_MARKERS,
    STATE_FILE,
    TENSORBOARD_DIR,
    list_parts,
    scan_history,
)
from torchinstruments.rundir.merge import merged_part_numbers
from torchinstruments.rundir.opening import run_within
from torchinstruments.rundir.page_ranks import is_rank_run
from torchinstruments.rundir.parent_rewrite import rewrite_parent_index
from torchinstruments.rundir.recovery import load_state
from torchinstruments.rundir.shell import tool_command
from torchinstruments.rundir.state import NewerStateError, RunState, Status


def holds_run(directory: Path) -> bool:
    """Whether `directory` holds a run to continue (a leftover tensorboard/ alone is none)."""
    return any((directory / name).exists() for name in RUN_MARKERS if name != TENSORBOARD_DIR)


def _needs_finish(directory: Path) -> bool:
    """Whether the earlier attempt must be finalized first (killed, parts left, state unreadable)."""
    if list_parts(directory):
        return True
    try:
        state = load_state(directory)
    except NewerStateError:
        raise
    except (OSError, ValueError):
        return True
    return state is None or state.status is Status.IN_PROGRESS


def open_continuation(
    directory: Path, run: RunInfo, step: Callable[[str], None] = lambda name: None
) -> tuple[Continuation, RunState]:
    """Finalize the earlier attempt of the run in `directory` and plan the next one.

    Args:
        directory: the run directory (it holds a run: `holds_run`).
        run: the new attempt's run info.
        step: called as each step begins (reading the state, each file `finalize` writes), so
            that inject can bound each (`rundir.opening.run_within`).

    Returns:
        Where the new attempt starts, and the run's state as the earlier attempts left it.

    Raises:
        RunLockedError: a live process holds the run.
        NewerStateError: a newer torchinstruments wrote it.
        FileExistsError: there is nothing to continue (no history), or the layers differ.
    """
    if not (directory / PARTS_DIR).is_dir() and not (directory / HISTORY_FILE).is_file():
        raise FileExistsError(
            f"output_dir={str(directory)!r} holds run files but no history (neither {PARTS_DIR}/ "
            f"nor {HISTORY_FILE}), so resume=True has nothing to continue; pass a new output_dir"
        )
    step(f"reading {STATE_FILE}")
    if not _needs_finish(directory):
        return _planned(directory, run)
    # Without its parent page: a rank's new attempt rewrites it as it starts (with the rank in
    # progress), and a page rendered here (the rank interrupted) would be rendered again at once.
    finished = finalize(directory, step, parent_page=False).state
    step(f"reading {STATE_FILE}")
    try:
        return _planned(directory, run)
    except FileExistsError:  # no attempt starts: the page says the one finalized here
        if is_rank_run(directory, finished):
            rewrite_parent_index(directory.parent)
        raise


def _planned(directory: Path, run: RunInfo) -> tuple[Continuation, RunState]:
    """`open_continuation`'s plan from the earlier attempts' state (finalized by then)."""
    previous = load_state(directory)
    if previous is None or previous.counts is None:
        raise FileExistsError(
            f"output_dir={str(directory)!r}: its run's state could not be completed, so "
            "resume=True cannot continue it; pass a new output_dir"
        )
    if not previous.run_info_recovered:
        before = [(layer.name, layer.module_type) for layer in previous.run.layers]
        now = [(layer.name, layer.module_type) for layer in run.layers]
        if before != now:
            raise FileExistsError(
                f"resume=True: the run in output_dir={str(directory)!r} observed other layers "
                f"than this model and selector ({len(before)} there, {len(now)} here; "
                f"{_difference(before, now)}); one run's history is one model's: pass a new "
                "output_dir, or the selector that chose the run's layers"
            )
    attempts = previous.attempts or (
        AttemptCounts(
            0,
            previous.run.started_at,
            root_forwards=previous.counts.root_forwards,
            samples=previous.counts.samples,
            backward_samples=previous.counts.backward_samples,
            ended=KILLED if previous.interrupted else REMOVED,
            train_forwards=previous.counts.train_forwards,
            eval_forwards=previous.counts.eval_forwards,
        ),
    )
    attempts = _last_sampler_known(attempts, previous)
    history = directory / HISTORY_FILE
    first_part = max(merged_part_numbers(history), default=-1) + 1 if history.is_file() else 0
    lost = [loss.last_sample_id for loss in previous.losses if loss.last_sample_id is not None]
    taken = max(lost, default=-1) + 1
    plan = plan_continuation(directory, attempts, history, first_part, samples_taken=taken)
    if previous.run_info_recovered:  # rebuilt after a kill: what it measured is unknown
        return plan, previous
    earlier = previous.run
    plan = dataclasses.replace(
        plan, earlier_metrics=earlier.metrics, earlier_focus=earlier.focus_layers
    )
    return plan, previous


__all__ = ["holds_run", "open_continuation", "open_continuation_within"]


def _last_sampler_known(
    attempts: tuple[AttemptCounts, ...], previous: RunState
) -> tuple[AttemptCounts, ...]:
    """`attempts` with the last one's sampler taken from the run's info where a state written
    before attempts kept their own left it unknown: the run info is the last attempt's."""
    last = attempts[-1]
    if last.sampler is not None or previous.run_info_recovered:
        return attempts
    return (*attempts[:-1], dataclasses.replace(last, sampler=previous.run.sampler))


def _difference(before: list[tuple[str, str]], now: list[tuple[str, str]]) -> str:
    """Which (layer, module type) pairs only the run has and which only this model has, the
    first three of each, or that the same ones come in another order."""
    there = [layer for layer in before if layer not in now]
    here = [layer for layer in now if layer not in before]
    if not there and not here:
        return "the same layers in another order"

    def named(layers: list[tuple[str, str]]) -> str:
        shown = ", ".join(f"{name!r} ({kind})" for name, kind in layers[:3]) or "none"
        return shown + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")

    return f"only in the run: {named(there)}; only here: {named(here)}"


def open_continuation_within(
    directory: Path, run: RunInfo, wait_s: float, rows_per_s: float
) -> tuple[Continuation, RunState]:
    """`open_continuation` (finalize the earlier attempt), each step waited for `wait_s`, as
    removal waits for its own (`rundir.opening.run_within`): the merge longer by the rows of
    the parts (`rows_per_s`), as many as their footers say, for as long as it runs where they
    cannot say.

    Raises:
        TimeoutError: naming output_dir, when a step does not return in its time.
    """
    merge_s: list[float] = [wait_s]

    def work(step: Callable[[str], None]) -> tuple[Continuation, RunState]:
        step(f"the row counts of {PARTS_DIR}/")
        merge_s[0] = wait_s + _rows_in_parts(directory) / rows_per_s
        return open_continuation(directory, run, step)

    command = tool_command("finalize", directory)
    return run_within(
        directory,
        work,
        lambda step: merge_s[0] if step == HISTORY_FILE else wait_s,
        "inject_observer's completion of the run's earlier attempt (resume=True)",
        f"it holds the run's lock until it returns; then `{command}` completes the earlier "
        "attempt, and resume=True continues the run.",
    )


def _rows_in_parts(directory: Path) -> float:
    """The rows in the run's parts, as their footers say; infinite where they cannot say."""
    parts = list_parts(directory)
    try:
        return scan_history(parts).select(pl.len()).collect().item() if parts else 0
    except Exception:  # a damaged part: the merge's time cannot be told beforehand
        return math.inf
