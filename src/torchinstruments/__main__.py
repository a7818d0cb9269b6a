"""Command line: `python -m torchinstruments finalize|show|compare|plot|heatmap` (also
`torchinstruments`).

Design decision: the command line is a thin argparse shell over `rundir.finish.finalize`, which
calls `finish_run`, the same routine the library runs at removal. It imports only the run
directory package (Polars), never torch. Exit codes: 0 done and complete, 1 not a run directory,
an error, or a run that is still incomplete after finalizing, 2 the directory is locked by a live
run (or bad usage).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from torchinstruments.cli import COMMANDS, add_commands, run_command
from torchinstruments.cli.text import plural
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.index_page import bound_count
from torchinstruments.rundir.lock import RunLockedError
from torchinstruments.rundir.state import NewerStateError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchinstruments", description="TorchInstruments run-directory tools."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser(
        "finalize",
        help="complete an interrupted run directory",
        description="Merge history.parts/ into history.parquet and write result.json and "
        "index.md. Refuses a directory locked by a live run; unreadable parts are left in place. "
        "On a directory of rank-NNN/ runs: finalizes each rank, then writes its index.md.",
    )
    cmd.add_argument("directory", type=Path, metavar="DIR", help="the run's output directory")
    add_commands(commands)
    return parser


def _finalize(directory: Path) -> int:
    """Run finalize and print what it did; returns the exit code."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            report = finalize(directory)
    except RunLockedError as exc:
        print(f"torchinstruments finalize: refused: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, NewerStateError) as exc:
        print(f"torchinstruments finalize: {exc}", file=sys.stderr)
        return 1
    c = report.counts
    merge = report.merge
    if merge is not None:
        # Counts rebuilt from history are lower bounds (as index.md says); kept ones are exact.
        if report.state.counts_recovered:  # lower bounds; a 0 there is unknown, never 0
            counts = (
                f"{bound_count(c.root_forwards, 'root forward')}, "
                f"{bound_count(c.samples, 'sample')}, {bound_count(c.backward_samples)} with a "
                "backward (rebuilt from history)"
            )
        else:
            counts = (
                f"{plural(c.root_forwards, 'root forward')}, {plural(c.samples, 'sample')}, "
                f"{c.backward_samples} with a backward"
            )
        print(
            f"finalized {report.directory}: {plural(merge.rows, 'row')} in {merge.path} "
            f"({plural(len(merge.merged_parts), 'part')} merged); {counts}"
        )
    for path in report.removed_temporaries:
        print(f"removed incomplete temporary {path}")
    if report.run_info_recovered:
        print("the directory had no readable run info; layers were rebuilt from history")
    if report.complete and report.interrupted:
        print(
            "state: interrupted: the run ended without remove_observer; every row it wrote is in "
            "history.parquet, rows of its last flush interval may be missing (see index.md)"
        )
    elif report.complete:
        print("state: complete")
    for problem in report.problems:
        print(f"torchinstruments finalize: incomplete: {problem}", file=sys.stderr)
    return 0 if report.complete else 1


def _finalize_ranks(parent: Path) -> int:
    """`finalize PARENT`: finalize every rank directory, then write the parent's index.md."""
    from torchinstruments.rundir.page_ranks import rank_dirs, write_parent_index

    codes = [_finalize(directory) for _, directory in rank_dirs(parent)]
    try:
        path = write_parent_index(parent)
    except OSError as exc:
        print(f"torchinstruments finalize: {parent}/index.md: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({plural(len(codes), 'rank')})")
    return max(codes)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m torchinstruments` and the `torchinstruments` script.

    Args:
        argv: arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        The exit code.
    """
    args = _parser().parse_args(argv)
    if args.command == "finalize":
        from torchinstruments.rundir.page_ranks import rank_dirs

        directory = Path(args.directory).expanduser()
        if (
            not (directory / "history.parquet").exists()
            and not (directory / "history.parts").exists()
        ) and rank_dirs(directory):
            return _finalize_ranks(directory.absolute())
        return _finalize(args.directory)
    if args.command in COMMANDS:
        return run_command(args)
    return 2  # unreachable: argparse requires a known command


if __name__ == "__main__":
    sys.exit(main())
