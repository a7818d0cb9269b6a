"""`torchinstruments finalize DIR`: complete an interrupted run directory (or every rank's).

Design decision: a thin shell over `rundir.finish.finalize`, which calls `finish_run`, the same
routine the library runs at removal; it imports only the run directory package (Polars), never
torch. Exit codes: 0 done and complete, 1 not a run directory, an error, or a run that is still
incomplete after finalizing, 2 the directory is locked by a live run.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from torchinstruments.cli.rank_runs import missing_line, missing_ranks, rank_runs
from torchinstruments.cli.reader import NotARunError, read_facts
from torchinstruments.cli.text import error_lines, plural
from torchinstruments.rundir.attempt_ends import unremoved_attempts, unremoved_said
from torchinstruments.rundir.cut_finish import killed_in_finish
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.gradient_counts import gradient_count
from torchinstruments.rundir.index_page import gradient_zero_known_of
from torchinstruments.rundir.layout import PARTS_GONE_DIR
from torchinstruments.rundir.left_parts import left_out_parts, left_out_said
from torchinstruments.rundir.lock import RunLockedError
from torchinstruments.rundir.ranges import bound_count
from torchinstruments.rundir.recovery import load_state, recovered_layers
from torchinstruments.rundir.reserve import RESERVE_FILE
from torchinstruments.rundir.shell import error_said, literal_if_unclear
from torchinstruments.rundir.state import NewerStateError

__all__ = ["finalize_command"]


def finalize_command(directory: Path) -> int:
    """`finalize DIR`: a run directory, or a directory of rank-NNN/ runs; the exit code."""
    from torchinstruments.rundir.page_ranks import rank_dirs

    expanded = Path(directory).expanduser()
    if (
        not (expanded / "history.parquet").exists() and not (expanded / "history.parts").exists()
    ) and rank_dirs(expanded):
        return _finalize_ranks(expanded.absolute())
    return _finalize(directory)


def _finalize(directory: Path, rank: str = "") -> int:
    """Run finalize and print what it did; returns the exit code. `rank` (`"rank 1: "`, when
    finalizing a parent's ranks, which writes the parent's page once after them all) names the
    rank in each line of what is missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            report = finalize(directory, parent_page=not rank)
    except RunLockedError as exc:
        print(error_lines("torchinstruments finalize", exc, "refused: "), file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, NewerStateError) as exc:
        print(error_lines("torchinstruments finalize", exc), file=sys.stderr)
        return 1
    except OSError as exc:  # the lock file cannot be opened: a directory it may not write
        print(f"torchinstruments finalize: {error_said(exc)}", file=sys.stderr)
        return 1
    c = report.counts
    merge = report.merge
    if merge is not None:
        # Counts rebuilt from history are lower bounds (as index.md says); kept ones are exact.
        if report.state.counts_recovered:  # lower bounds; a 0 there is unknown, never 0
            # unless no sample could have had a gradient (each ran with grad disabled)
            known = gradient_zero_known_of(report.state)
            counts = (
                f"{bound_count(c.root_forwards, 'root forward')}, "
                f"{bound_count(c.samples, 'sample')}, {gradient_count(c.backward_samples, known)} "
                "with output gradients (rebuilt from history)"
            )
        else:
            counts = (
                f"{plural(c.root_forwards, 'root forward')}, {plural(c.samples, 'sample')}, "
                f"{c.backward_samples} with output gradients"
            )
        print(
            f"finalized {_shown(report.directory)}: {plural(merge.rows, 'row')} in "
            f"{_shown(merge.path)} "
            f"({plural(len(merge.merged_parts), 'part')} merged); {counts}"
        )
    for path in report.removed_temporaries:
        print(_removed_line(path))
    for path, why in report.kept_temporaries:
        print(f"torchinstruments finalize: could not {_kept_line(path, why)}", file=sys.stderr)
    kept = tuple(_shown(path) for path, _ in report.kept_temporaries)  # as the lines say it
    for line in report.state.left_behind:  # no row is missing: disk space, said once
        if not line.startswith(kept or ("\0",)):  # the line above said it, with why
            print(f"torchinstruments finalize: {_text(line)}", file=sys.stderr)
    if report.run_info_recovered:
        found = recovered_layers(report.state.run)
        print(f"the directory had no readable run info; layers were {found}")
    killed = [note for note in report.state.notes if killed_in_finish(note)]
    said = "".join(f" ({_text(note)})" for note in killed[-1:])
    if report.complete and report.interrupted:
        several = len(unremoved_attempts(report.state)) > 1  # named together: their rows
        it, its = ("they", "their") if several else ("it", "its")
        print(
            f"state: interrupted: {unremoved_said(report.state)}; every row {it} wrote is "
            f"in history.parquet, rows of {its} last flush interval{'s' * several} may be "
            "missing (see index.md)" + said
        )
    elif report.complete:
        print("state: complete" + said)
    for problem in report.problems:
        print(f"torchinstruments finalize: {rank}incomplete: {_text(problem)}", file=sys.stderr)
    for loss in report.state.losses:  # rows recorded but never written: incomplete too
        print(
            f"torchinstruments finalize: {rank}incomplete: {_text(loss.describe())}",
            file=sys.stderr,
        )
    return 0 if report.complete else 1


# The folder of parts a merge renamed away and did not delete (a folder without write
# permission, or a kill between the two): no write that did not finish, but a second copy of
# rows history.parquet holds.
_MERGED_PARTS = (
    "the merged parts an earlier merge left (a second copy of rows history.parquet holds)"
)


def _text(line: str) -> str:
    """A line of the state file's text (a problem, a loss's reason, a note) by index.md's rule
    (`literal_if_unclear`): such text quotes errors and paths, and a state file written by
    another version or by hand may hold anything; an escape in it must not reach the terminal."""
    return literal_if_unclear(line)


def _shown(path: Path) -> str:
    """A path in a line finalize prints, by index.md's rule (`literal_if_unclear`): a run
    directory named with an escape or a line break must not rewrite the terminal."""
    return literal_if_unclear(str(path))


def _removed_line(path: Path) -> str:
    """What finalize says of a file it deleted: the live run's disk reserve and the merged
    parts an earlier merge left are no torn writes."""
    if path.name == RESERVE_FILE:
        return f"removed the disk space the live run held for its final state {_shown(path)}"
    if path.name == PARTS_GONE_DIR:
        return f"removed {_shown(path)}, {_MERGED_PARTS}"
    return f"removed incomplete temporary {_shown(path)}"


def _kept_line(path: Path, why: str) -> str:
    """What finalize says of a leftover it could not delete, after "could not"."""
    if path.name == PARTS_GONE_DIR:
        return (
            f"delete {_shown(path)}, {_MERGED_PARTS} ({why}); index.md says so until it is deleted"
        )
    return f"remove temporary {_shown(path)} ({why})"


def _finalize_ranks(parent: Path) -> int:
    """`finalize PARENT`: finalize every rank directory, then write the parent's index.md."""
    from torchinstruments.rundir.page_ranks import rank_dirs
    from torchinstruments.rundir.parent_rewrite import remove_ask_leftovers, write_parent_index

    codes = [_finalize(directory, f"rank {rank}: ") for rank, directory in rank_dirs(parent)]
    removed = remove_ask_leftovers(parent)
    if removed:  # said as a run's removed temporaries are, in one line however many
        print(
            f"removed {plural(len(removed), 'temporary', 'temporaries')} an earlier version left "
            f"in {_shown(parent)} ({_names(removed)}): asks of ranks killed while asking for its "
            "index.md to be rewritten"
        )
    try:
        path = write_parent_index(parent, wait=True)
    except OSError as exc:
        named = f"{_shown(parent / 'index.md')}: "
        print(error_lines("torchinstruments finalize", exc, named), file=sys.stderr)
        return 1
    print(f"wrote {_shown(path)} ({plural(len(codes), 'rank')})")
    for rank, directory in rank_dirs(parent):  # as the parent's index.md says them
        parts = left_out_parts(directory)
        if parts:
            print(f"rank {rank}: {left_out_said(parts, _recovered(directory))}")
    missing = _missing(parent)
    if missing:  # as index.md and every reader of the parent say it
        print(missing_line(missing))
    return max(codes)


def _names(paths: list[Path], most: int = 3) -> str:
    """The first `most` file names of `paths`, then how many more."""
    shown = ", ".join(p.name for p in paths[:most])
    return shown if len(paths) <= most else f"{shown} and {len(paths) - most} more"


def _recovered(directory: Path) -> bool | None:
    """Whether the rank's counts were rebuilt from its history (None: its state is unreadable)."""
    try:
        state = load_state(directory)
    except (OSError, ValueError):
        return None
    return None if state is None else state.counts_recovered


def _missing(parent: Path) -> tuple[int, ...]:
    """The ranks the world size expects and no directory holds (`rank_runs.missing_ranks`),
    from the state files finalize left readable."""
    runs, facts = rank_runs(parent), []
    for run in runs:
        try:
            facts.append(read_facts(run.directory))
        except (NotARunError, OSError, ValueError):
            continue  # a rank finalize could not complete: said above, in its own lines
    return missing_ranks(facts, [r.rank for r in runs], {}, None)
