"""A parent of `rank-NNN/` runs (`rank_policy="all"`), read rank by rank: which ranks it holds,
which of them have history now (and why the others have none), and `--rank`'s syntax.

Design decision: a parent is read with the ranks it can read and says which it could not (a rank
killed before its first part, or still before it; a rank whose history file is not a whole
Parquet file, named with what to do); only a parent where no rank can be read is refused. A
damaged part of a rank not yet finalized is found when a reading meets it, not by a check of
every part beforehand (a live rank's parts are many): the command then reads the parent again
inside `leaving_out`, which every reader of the parent in it (`ranks_with_history`) obeys.
The parent's directory and each note's beginning are printed by index.md's rule
(`literal_if_unclear`, as `show DIR` prints them): an escape in them never reaches the terminal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from torchinstruments.cli.reader import (
    NotARunError,
    RunFacts,
    UnreadableHistoryError,
    locate,
    read_facts,
)
from torchinstruments.cli.run_dirs import RANK_DIR, rank_directories
from torchinstruments.cli.states import run_state
from torchinstruments.cli.text import NOTES_SHOWN, cut_note
from torchinstruments.rundir.attempt_ends import attempts_said
from torchinstruments.rundir.attempts import attempt_total
from torchinstruments.rundir.index_page import page_notes
from torchinstruments.rundir.layout import INDEX_FILE, STATE_FILE
from torchinstruments.rundir.left_parts import left_out_said
from torchinstruments.rundir.lock import writer_ended
from torchinstruments.rundir.page_ranks import attempts_line
from torchinstruments.rundir.ranges import plural, ranges
from torchinstruments.rundir.shell import literal_if_unclear
from torchinstruments.rundir.state import Status

_RANK_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")

# How the reason of a rank left out for a history file it cannot read begins.
UNREADABLE = "damaged history"

# The ranks one command's reading of a parent leaves out (rank -> why), set by `leaving_out`.
_LEFT_OUT: ContextVar[Mapping[int, str] | None] = ContextVar("left_out", default=None)


@contextlib.contextmanager
def leaving_out(unreadable: Mapping[int, str]) -> Iterator[None]:
    """Within it, every `ranks_with_history` leaves out the ranks of `unreadable` (rank -> the
    message of the file it could not read), with that reason; reset on leaving."""
    token = _LEFT_OUT.set(dict(unreadable))
    try:
        yield
    finally:
        _LEFT_OUT.reset(token)


def unreadable_rank(parent: Path, error: UnreadableHistoryError) -> int | None:
    """The rank of `parent` whose directory holds the file `error` names, or None."""
    for run in rank_runs(parent):
        if run.directory.resolve() == Path(error.directory).expanduser().resolve():
            return run.rank
    return None


@dataclass(frozen=True)
class RankRun:
    """One rank's run directory under a parent."""

    rank: int
    directory: Path


def parse_ranks(text: str) -> tuple[int, ...]:
    """`"0,2-4"` -> `(0, 2, 3, 4)`; raises ValueError naming `--rank` on anything else."""
    ranks: list[int] = []
    for item in (i.strip() for i in text.split(",")):
        found = _RANK_ITEM.match(item)
        if not found:
            raise ValueError(f"--rank {text!r}: expected ranks like 0 or 0,3 or 0-7")
        low = int(found.group(1))
        high = int(found.group(2)) if found.group(2) else low
        if high < low:
            raise ValueError(f"--rank {text!r}: the range {item} is empty")
        ranks += [r for r in range(low, high + 1) if r not in ranks]
    return tuple(ranks)


def is_parent(directory: Path) -> bool:
    """Whether `directory` holds no run itself but `rank-NNN/` run directories."""
    directory = Path(directory).expanduser()
    try:
        locate(directory)
    except NotARunError:
        return bool(rank_directories(directory))
    return False


def rank_runs(parent: Path, ranks: Sequence[int] | None = None) -> list[RankRun]:
    """The parent's rank runs, all or those of `ranks` (in rank order).

    Raises:
        ValueError: if a rank asked for has no directory, naming the ranks there are.
    """
    parent = Path(parent).expanduser()
    found = {int(m.group(1)): d for d in rank_directories(parent) if (m := RANK_DIR.match(d.name))}
    if ranks is None:
        return [RankRun(r, found[r]) for r in sorted(found)]
    missing = [r for r in ranks if r not in found]
    if missing:
        raise ValueError(
            f"--rank: no rank directory for rank {', '.join(map(str, missing))} in {parent}; "
            f"its ranks: {', '.join(map(str, sorted(found)))}"
        )
    return [RankRun(r, found[r]) for r in sorted(set(ranks))]


def ranks_with_history(
    parent: Path, ranks: Sequence[int] | None = None
) -> tuple[list[RankRun], dict[int, str]]:
    """The parent's rank runs (all, or those of `ranks`) that have history now, and why each of
    the others is not read (a rank killed before its first part, or still before it; a rank
    whose history file is not a whole Parquet file, `UNREADABLE`, here or in `leaving_out`): a
    parent is read with the ranks it can read, and says which it could not.

    Raises:
        ValueError: a rank asked for has no directory (`rank_runs`).
        NotARunError: no rank can be read, naming each rank and why.
    """
    readable, without = [], {}
    left_out = _LEFT_OUT.get() or {}
    for run in rank_runs(parent, ranks):
        if run.rank in left_out:
            without[run.rank] = f"{UNREADABLE}: {left_out[run.rank]}"
            continue
        try:
            locate(run.directory)
        except NotARunError:
            without[run.rank] = _no_history(run.directory)
            continue
        except UnreadableHistoryError as error:  # its history.parquet
            without[run.rank] = f"{UNREADABLE}: {error}"
            continue
        readable.append(run)
    if not readable and without:
        some = "can be read" if unreadable_ranks(without) else "has any history yet"
        raise NotARunError(
            f"{Path(parent).expanduser()}: no rank {some} ({without_history_line(without)})"
        )
    return readable, without


def unreadable_ranks(without: Mapping[int, str]) -> dict[int, str]:
    """The ranks of `without` left out for a history file they cannot read (`UNREADABLE`)."""
    return {rank: why for rank, why in without.items() if why.startswith(UNREADABLE)}


def not_read_lines(without: Mapping[int, str]) -> list[str]:
    """What every reader of a parent says of the ranks it did not read: those without history,
    then those whose history file it cannot read (each with what to run)."""
    damaged = unreadable_ranks(without)
    empty = {rank: why for rank, why in without.items() if rank not in damaged}
    lines = [f"not read, no history: {without_history_line(empty)}"] if empty else []
    for rank in sorted(damaged):
        lines.append(f"not read, rank {rank}: {damaged[rank]}")
    return lines


def _no_history(directory: Path) -> str:
    """Why a rank's directory has no history, in a few words."""
    try:
        state = run_state(directory)
    except (OSError, ValueError):
        return "no sample written yet (its state is unreadable)"
    if state is None:
        return f"no sample written yet (no {STATE_FILE})"
    if state.status is Status.IN_PROGRESS:  # its lock tells which, as `show` of the rank says
        ended = writer_ended(directory)
        if ended is False:
            return "no sample written yet (in progress: a live process holds its lock)"
        if ended:
            return (
                "no sample written yet (its process ended before its first part, killed or "
                "crashed: no process holds its lock)"
            )
        return "no sample written yet (in progress, or its process died before its first part)"
    return f"no sample written yet ({state.status.value})"


def missing_ranks(
    facts: Sequence[RunFacts],
    read: Sequence[int],
    without: Mapping[int, str],
    ranks: Sequence[int] | None,
) -> tuple[int, ...]:
    """The ranks the world size (the largest the read ranks' state files give) expects and no
    directory holds, when all ranks are asked for (`ranks` None); () otherwise."""
    if ranks is not None:
        return ()
    world = max((f.run.world_size or 0 for f in facts if f.run is not None), default=0)
    there = set(read) | set(without)
    return tuple(r for r in range(world) if r not in there)


def missing_line(missing: Sequence[int]) -> str:
    """What every reader of a parent says of `missing_ranks`."""
    return (
        f"missing: no directory for rank {ranges(missing)} (it never attached, or wrote "
        "elsewhere): what it saw is unknown"
    )


def without_history_line(without: Mapping[int, str]) -> str:
    """`rank 1, 3: no sample written yet (...)`: the ranks without history, grouped by why."""
    by_reason: dict[str, list[int]] = {}
    for rank in sorted(without):
        by_reason.setdefault(without[rank], []).append(rank)
    return "; ".join(f"rank {ranges(rs)}: {why}" for why, rs in by_reason.items())


def header_lines(
    parent: Path,
    runs: Sequence[RankRun],
    facts: Sequence[RunFacts],
    without_history: Mapping[int, str],
    missing: Sequence[int] = (),
    *,
    complete_said: bool = True,
) -> list[str]:
    """The header of `show PARENT` and `compare PARENT`: one line for the parent, one per state
    of the ranks read, one per way the attempts of continued ranks ended (as `show` of one
    rank says them: its state names only the earlier attempts' end), one for ranks not read,
    one for ranks the world size expects and no directory holds, and each rank's marked
    samples. Without `complete_said`, the ranks whose state is complete get neither line: what a
    picture, a csv or a markdown table says on stderr, as for one run, which says its state
    only when it is not complete."""
    states: dict[str, list[int]] = {}
    ended: dict[str, list[int]] = {}
    for run, f in zip(runs, facts, strict=True):
        state = f.state.split(" (")[0]
        if not complete_said and state == "complete":
            continue  # neither its state nor how its attempts ended (every one removed)
        states.setdefault(state, []).append(run.rank)
        said = attempts_said(f.run_state, f.directory) if f.run_state else ""
        if said:
            ended.setdefault(said, []).append(run.rank)
    lines = [
        f"ranks: {literal_if_unclear(str(parent))} ({plural(len(runs), 'rank')}: {ranges(r.rank for r in runs)})"
    ]
    for state, which in states.items():
        lines.append(f"rank {ranges(which)}: {state}")
    for said, which in ended.items():
        lines.append(f"rank {ranges(which)}: attempts: {said}")
    lines += not_read_lines(without_history)
    if missing:
        lines.append(missing_line(missing))
    lines += rank_notes(runs, facts)
    lines += notes_of_ranks(runs, facts)
    for run, f in zip(runs, facts, strict=True):
        for line in f.marked_lines():
            lines.append(f"rank {run.rank}: {line}")
    return lines


def notes_of_ranks(runs: Sequence[RankRun], facts: Sequence[RunFacts]) -> list[str]:
    """The ranks' notes (each rank's index.md's, as `show` of one rank begins them), said once
    for all the ranks that hold the same note (a job's ranks mostly note alike), the first
    `text.NOTES_SHOWN` of them begun: bounded however many ranks there are."""
    held: dict[str, list[int]] = {}  # note -> the ranks whose index.md holds it
    for run, f in zip(runs, facts, strict=True):
        for note in dict.fromkeys(page_notes(f.run_state) if f.run_state else ()):
            held.setdefault(note, []).append(run.rank)
    if not held:
        return []
    ranks = sorted({rank for which in held.values() for rank in which})
    lines = [
        f"notes: {plural(len(held), 'note')} on rank {ranges(ranks)}, in full at the top of "
        f"each rank's {INDEX_FILE}:"
    ]
    for note, which in list(held.items())[:NOTES_SHOWN]:
        lines.append(f"- rank {ranges(which)}: {literal_if_unclear(cut_note(note))}")
    if len(held) > NOTES_SHOWN:
        rest = sorted({rank for which in list(held.values())[NOTES_SHOWN:] for rank in which})
        lines.append(f"- ... ({len(held) - NOTES_SHOWN} more, on rank {ranges(rest)})")
    return lines


def rank_notes(runs: Sequence[RankRun], facts: Sequence[RunFacts]) -> list[str]:
    """What every reader of a parent says as its index.md does: that the ranks' directories
    hold different numbers of attempts, and each rank's parts left out, unreadable."""
    lines: list[str] = []
    attempts: dict[int, list[int]] = {}
    for run, f in zip(runs, facts, strict=True):
        if f.run_state is not None:
            attempts.setdefault(max(attempt_total(f.run_state.attempts), 1), []).append(run.rank)
    if len(attempts) > 1:
        lines.append(attempts_line(attempts))
    for run, f in zip(runs, facts, strict=True):
        if f.files.unreadable:  # beside history.parquet: read by no reader, named here
            recovered = f.run_state.counts_recovered if f.run_state else None
            lines.append(f"rank {run.rank}: {left_out_said(f.files.unreadable, recovered)}")
    return lines


def parent_facts(parent: Path, runs: Sequence[RankRun]) -> tuple[RunFacts, list[RunFacts]]:
    """The first rank's facts with the parent as directory (titles, layer order), and each rank's."""
    each = [read_facts(run.directory) for run in runs]
    return dataclasses.replace(each[0], directory=Path(parent).expanduser()), each


__all__ = [
    "UNREADABLE",
    "RankRun",
    "header_lines",
    "is_parent",
    "leaving_out",
    "not_read_lines",
    "notes_of_ranks",
    "parent_facts",
    "parse_ranks",
    "rank_notes",
    "rank_runs",
    "ranks_with_history",
    "unreadable_rank",
    "unreadable_ranks",
    "without_history_line",
]
