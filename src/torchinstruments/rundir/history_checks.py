"""What a finish checks history.parquet against, once the parts are merged into it.

Design decision: each check reads the merged history once (a column's distinct values, or rows
per attempt, on the streaming engine) and turns what it finds into index.md's words; a check
that cannot read history says nothing (the merge just read it, and the other checks stand).
After a crash the loss ledger may not have survived, so the gaps in history's sample ids and
the TensorBoard events with no row are the only traces of rows that died in memory; a run with
more than one attempt is checked attempt by attempt, since each removed attempt knows its own
rows where the job's are not known. `rundir.finish` runs these checks and lists their lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import polars as pl

from torchinstruments.records import RunCounts
from torchinstruments.rundir.attempts import AttemptCounts, raise_to_events
from torchinstruments.rundir.event_steps import event_steps
from torchinstruments.rundir.layout import HISTORY_FILE, scan_history
from torchinstruments.rundir.ledger import sample_range, uncovered
from torchinstruments.rundir.state import RunState


def attempts_short(history: Path, state: RunState) -> list[str]:
    """Each attempt whose rows in `history` fall short of the rows it recorded, less its loss
    ledger entries (those of its sample_id range), one line each. A continued run whose earlier
    attempt was killed does not know the job's rows, but a removed attempt knows its own."""
    try:
        held = dict(
            scan_history(history).group_by("attempt").len().collect(engine="streaming").rows()
        )
    except (OSError, pl.exceptions.PolarsError):
        return []  # the merge just read it; the other checks stand
    ends = [a.first_sample_id for a in state.attempts[1:]] + [None]
    found = []
    for entry, end in zip(state.attempts, ends, strict=True):
        if entry.rows is None:
            continue
        mine = [
            loss.rows
            for loss in state.losses
            if loss.first_sample_id is not None
            and loss.first_sample_id >= entry.first_sample_id
            and (end is None or loss.first_sample_id < end)
        ]
        # a folded entry's rows are its attempts' together (`rundir.attempt_folds`)
        lost, rows = sum(mine), sum(held.get(n, 0) for n in entry.numbers)
        if rows < entry.rows - lost:
            ledger = f" ({lost} more are in the loss ledger)" if lost else ""
            found.append(
                f"{HISTORY_FILE} holds {rows} of the {entry.rows} rows {_attempts(entry)} "
                f"recorded; {entry.rows - lost - rows} rows are missing{ledger}"
            )
    return found


def _attempts(entry: AttemptCounts) -> str:
    """`attempt 3`, or `attempts 3-9` for a folded entry."""
    first, last = entry.numbers[0], entry.numbers[-1]
    return f"attempt {first}" if first == last else f"attempts {first}-{last}"


def events_without_rows(
    directory: Path,
    history: Path,
    state: RunState,
    counts: RunCounts,
    recovered: bool,
    killed: list[int],
) -> tuple[RunState, RunCounts]:
    """After a kill: the sampled forwards the run's TensorBoard events hold and history has no
    row of (their rows died in memory), and counts rebuilt from history raised to them, as are
    those of the `killed` attempts (closed now from their rows)."""
    steps = event_steps(directory)
    if not steps:
        return state, counts
    try:
        present = (
            scan_history(history)
            .select(pl.col("forward_index").unique())
            .collect(engine="streaming")["forward_index"]
            .to_list()
        )
    except (OSError, pl.exceptions.PolarsError):
        return state, counts
    missing = sorted(steps - set(present))
    state = dataclasses.replace(
        state,
        events_without_rows=tuple(missing[:20]),
        events_without_rows_total=len(missing),
        attempts=raise_to_events(state.attempts, killed, missing),
    )
    if recovered:
        counts = dataclasses.replace(
            counts,
            root_forwards=max(counts.root_forwards, max(steps) + 1),
            samples=counts.samples + len(missing),
        )
    return state, counts


def unexplained_gaps(history: Path, state: RunState, left: Sequence[str]) -> list[str]:
    """Sample ranges with no row in history that the loss ledger does not explain; where the
    merge left unreadable parts (`left`, their names), a gap's rows may be in one of them, and
    the line says so before it says they were never written.

    Used after a crash, when the ledger may not have survived (nothing could be written after
    the losses): the gaps in the sample ids on disk are then the only trace of them. Samples
    after the last one on disk cannot be told from the rows; the interrupted line says so.
    """
    try:
        gaps = uncovered(_sample_gaps(history), state.losses)
    except (OSError, pl.exceptions.PolarsError):
        return []  # the merge just read it; a failure here leaves the other checks standing
    # ids a continued run skipped after a killed attempt: its samples whose rows died with it
    # (`rundir.attempts.plan_continuation`), which the Attempts section names
    skipped = {b.first_sample_id for a, b in pairwise(state.attempts) if a.counts_recovered}
    # inside a folded run of killed attempts (`rundir.attempt_folds`) each of them may have
    # skipped ids before the next one's first, which the fold no longer names one by one
    folded = [
        (a.first_sample_id, b.first_sample_id)
        for a, b in pairwise(state.attempts)
        if a.counts_recovered and len(a.numbers) > 1
    ]
    gaps = [
        (first, last)
        for first, last in gaps
        if last + 1 not in skipped and not any(lo <= first and last < hi for lo, hi in folded)
    ]
    maybe = ""
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        maybe = (
            f"their rows may be in {', '.join(left[:3])}{more} (unreadable, left in place); else "
        )
    return [
        f"no row of {sample_range(first, last)} is in {HISTORY_FILE} and no loss ledger entry "
        f"covers them: {maybe}they were recorded but not written (parts that kept failing, e.g. "
        "on a full disk, until the process ended), unless those sampled forwards recorded "
        "nothing (layers that returned no tensor)"
        for first, last in gaps
    ]


def _sample_gaps(history: Path) -> list[tuple[int, int]]:
    """Ranges `(first, last)` of sample ids below the last one in `history` with no row, as
    `ledger.missing_samples` finds them, found by Polars: every finish of a run once killed
    checks them, and the whole job's ids as Python ints cost memory and time in its samples."""
    sample = pl.col("sample_id")
    return (
        scan_history(history)
        .select(sample.drop_nulls().unique().sort())
        .select(first=sample.shift(1, fill_value=-1) + 1, last=sample - 1)
        .filter(pl.col("first") <= pl.col("last"))
        .collect(engine="streaming")
        .rows()
    )


__all__ = ["attempts_short", "events_without_rows", "unexplained_gaps"]
