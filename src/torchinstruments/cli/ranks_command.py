"""The command-line side of multi-rank runs: `--rank`, and each command on a parent directory.

Design decision: `run_command` asks `run_on_ranks` first; it answers None when no directory of
the command is a parent of `rank-NNN/` runs and `--rank` is not given, so single runs take the
path they always took. On a parent, one rank (`--rank N`) is that rank's directory, read by the
single-run command; several ranks (or none named: all of them) are read side by side
(`cli.rank_spread`, `cli.ranks`, `cli.ranks_draw`). `compare` with two directories compares one rank of each
parent (`--rank N`); with one directory, a parent, it compares its ranks with each other (all,
or the ranks `--rank` names, at least two). A combination that names no pair of runs (one
parent and one rank; two directories with a parent and no single `--rank`) is a usage error,
exit 2, whose message names what to pass.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchinstruments.cli.ranks_draw import RankLines


class UsageError(ValueError):
    """A combination of arguments that names no run to read (exit 2, like argparse's errors)."""


def add_rank_option(cmd: argparse.ArgumentParser) -> None:
    """`--rank N` (or `0,3`, `0-7`): which ranks of a parent of `rank-NNN/` runs to read."""
    cmd.add_argument(
        "--rank",
        metavar="N[,M|-M]",
        help="for a directory of rank-NNN/ runs (rank_policy='all'): the ranks to read; one "
        "rank reads that rank's run alone (default: all ranks, side by side)",
    )


def _resolve(directory: Path, ranks: tuple[int, ...] | None) -> Path:
    """A parent with one rank chosen -> that rank's directory; anything else unchanged."""
    from torchinstruments.cli.rank_runs import is_parent, rank_runs

    if ranks is not None and len(ranks) == 1 and is_parent(directory):
        return rank_runs(directory, ranks)[0].directory
    return directory


def run_on_ranks(
    args: argparse.Namespace,
    run_single: Callable[[argparse.Namespace], int],
    selection: Callable[..., object],
    width: int,
) -> int | None:
    """Run `args.command` on a parent of rank runs; None when it concerns no parent.

    Args:
        args: the parsed arguments (`rank` is None or the `--rank` text).
        run_single: runs a command whose directories are single runs.
        selection: `cli._selection(args, *directories)`, which refuses a choice matching nothing.
        width: the text width.

    Raises:
        UsageError: a combination of directories and `--rank` that names no run to read.
        ValueError: bad `--rank`.
    """
    from torchinstruments.cli.rank_runs import (
        is_parent,
        leaving_out,
        parse_ranks,
        unreadable_rank,
    )
    from torchinstruments.cli.reader import UnreadableHistoryError, locate

    ranks = parse_ranks(args.rank) if getattr(args, "rank", None) else None
    names = ("directory_a", "directory_b") if args.command == "compare" else ("directory",)
    given = [getattr(args, n) for n in names if getattr(args, n) is not None]
    parents = [d for d in given if is_parent(d)]
    if not parents:
        for directory in given:  # a typo or an empty folder is said to be that, not "one run"
            locate(directory)
        if ranks is not None:
            raise ValueError(
                f"--rank {args.rank}: {given[0]} holds no rank-NNN/ directories (it is one run)"
            )
        if args.command == "compare" and args.directory_b is None:
            raise UsageError(
                f"DIR_B is needed: {args.directory_a} is one run (only a directory of "
                "rank-NNN/ runs is compared with itself, rank by rank)"
            )
        return None
    if args.command == "compare" and args.directory_b is not None:
        if parents and (ranks is None or len(ranks) != 1):
            raise UsageError(
                "compare DIR_A DIR_B with a directory of rank-NNN/ runs needs --rank N (the "
                "rank to compare); compare one such directory alone to compare its ranks"
            )
        args.directory_a = _resolve(args.directory_a, ranks)
        args.directory_b = _resolve(args.directory_b, ranks)
        return run_single(args)
    if args.command == "compare" and ranks is not None and len(ranks) == 1:
        raise UsageError(
            f"compare {given[0]} --rank {args.rank} names one run, and compare needs two: pass "
            f"two runs (DIR_A DIR_B, e.g. two rank-NNN/ directories), two directories of "
            f"rank-NNN/ runs with --rank N (rank N of each), or {given[0]} without --rank (or "
            "with several ranks, e.g. --rank 0,3) to compare its ranks with each other"
        )
    if ranks is not None and len(ranks) == 1:
        setattr(args, names[0], _resolve(given[0], ranks))
        return run_single(args)
    parent = given[0]
    unreadable: dict[int, str] = {}  # ranks whose history file a reading could not read
    said: set[str] = set()  # stderr lines said already: a reading again says only new ones
    while True:
        with leaving_out(unreadable):
            try:
                return _on_parent(args, parent, ranks, selection, width, said)
            except UnreadableHistoryError as error:
                rank = unreadable_rank(parent, error)
                if rank is None or rank in unreadable:
                    raise
                unreadable[rank] = str(error)  # read again without it, and say why


def _on_parent(
    args: argparse.Namespace,
    parent: Path,
    ranks: tuple[int, ...] | None,
    selection: Callable[..., object],
    width: int,
    said: set[str],
) -> int:
    """Run `args.command` on the ranks of `parent` side by side (`said`: the stderr lines said
    so far, which a reading again does not repeat)."""
    from torchinstruments.cli import rank_spread
    from torchinstruments.cli import ranks as multi
    from torchinstruments.cli.rank_runs import (
        header_lines,
        missing_ranks,
        not_read_lines,
        ranks_with_history,
    )
    from torchinstruments.cli.reader import read_facts

    def say(line: str) -> None:
        if line not in said:
            said.add(line)
            print(f"torchinstruments {args.command}: {line}", file=sys.stderr)

    runs, without = ranks_with_history(parent, ranks)
    if args.command in ("plot", "heatmap") or args.format in ("csv", "markdown"):
        # What the text of show and compare says in its header, but the ranks found complete
        # (as one run's state is said only when it is not): a picture or a table of a parent
        # whose rank was killed never looks like one of a finished job.
        facts = [read_facts(r.directory) for r in runs]
        missing = missing_ranks(facts, [r.rank for r in runs], without, ranks)
        for line in header_lines(parent, runs, facts, without, missing, complete_said=False)[1:]:
            say(line)
    elif without and args.format != "text":  # json: its rank facts hold the rest
        for line in not_read_lines(without):
            say(line)
    chosen = selection(args, *(r.directory for r in runs))
    if args.command == "show":
        result = rank_spread.spread(parent, chosen, ranks)  # type: ignore[arg-type]
        print(
            rank_spread.render_spread(
                result, fmt=args.format, width=args.width or width, every_tensor=args.every_tensor
            )
        )
        return 0
    if args.command == "compare":
        found = multi.departures(
            parent,
            chosen,  # type: ignore[arg-type]
            ranks=ranks,
            tolerance=args.tolerance,
            x=args.x,
        )
        every = getattr(args, "every", False)
        if args.format in ("csv", "markdown"):  # as the ranks' states above: text and json say them
            for line in multi.open_lines(found):
                say(line)
        text = multi.render_departures(
            found, fmt=args.format, width=args.width or width, every_series=every
        )
        print(text)
        return 0
    return _draw(args, parent, ranks, chosen)


def _draw(
    args: argparse.Namespace, parent: Path, ranks: tuple[int, ...] | None, chosen: object
) -> int:
    """`plot` or `heatmap` on a parent: one tensor, rank by rank."""
    from torchinstruments.cli import ranks_draw
    from torchinstruments.cli.pictures import (
        MatplotlibMissingError,
        checked_folder,
        checked_png,
        metrics_left_out_line,
    )
    from torchinstruments.cli.text import error_lines, plural
    from torchinstruments.rundir.shell import literal_if_unclear

    prog = f"torchinstruments {args.command}"
    try:
        if args.command == "plot":
            output = checked_png(args.output or Path(parent) / "trends-ranks.png")
            result, lines = ranks_draw.plot_ranks(
                parent,
                output,
                chosen,  # type: ignore[arg-type]
                ranks=ranks,
                x=args.x,
                max_tensors=args.max_tensors,
                yscale=args.yscale,
            )
            print(
                f"wrote {literal_if_unclear(str(result.path))} "
                f"({result.width_px}x{result.height_px} px): "
                f"{plural(len(result.panels), 'panel')}, tensor {lines.name()}, "
                f"{lines.describe('line')}, x = {result.x}"
            )
            left_out_line = metrics_left_out_line(prog, result)
            if left_out_line is not None:
                print(left_out_line, file=sys.stderr)
            _say_ranks_left_out(prog, lines)
            return 0
        output_dir = checked_folder(args.output_dir or Path(parent))
        results, lines = ranks_draw.heatmap_ranks(
            parent,
            output_dir,
            chosen,  # type: ignore[arg-type]
            ranks=ranks,
            x=args.x,
            scale=args.scale,
            max_ranks=args.max_tensors,
        )
        for r in results:
            print(
                f"wrote {literal_if_unclear(str(r.path))} ({r.width_px}x{r.height_px} px): "
                f"{r.metric} of tensor "
                f"{lines.name()}, {lines.describe('row')} x {plural(r.columns, 'sample')}"
            )
        _say_ranks_left_out(prog, lines)
        return 0
    except MatplotlibMissingError as exc:
        print(error_lines(prog, exc), file=sys.stderr)
        return 3


def _say_ranks_left_out(prog: str, lines: RankLines) -> None:
    """On stderr, the ranks a drawing left out (`--max-tensors` counts ranks there), and the
    ranks read that hold no row of its tensor, if any: a picture never has fewer ranks than
    were read without saying which and why."""
    from torchinstruments.cli.text import plural
    from torchinstruments.rundir.ranges import ranges

    if lines.left_out:
        print(
            f"{prog}: {plural(len(lines.left_out), 'rank')} left out (rank "
            f"{ranges(lines.left_out)}; --max-tensors counts ranks here); choose with --rank or "
            "raise --max-tensors",
            file=sys.stderr,
        )
    if lines.without_rows:
        print(
            f"{prog}: rank {ranges(lines.without_rows)}: not drawn, no row of tensor "
            f"{lines.name()} that the selection reads",
            file=sys.stderr,
        )


__all__ = ["UsageError", "add_rank_option", "run_on_ranks"]
