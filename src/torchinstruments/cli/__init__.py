"""The command line: `finalize`, and reading a run with `show`, `compare`, `plot` and `heatmap`.

Design decision: these commands read run directories with Polars only; nothing here (nor what it
imports) imports torch or tensorboard, so `torchinstruments show DIR` starts in a fraction of a
second and works where torch is not installed. This package is the whole command line:
`main` (the `torchinstruments` script and `python -m torchinstruments`) parses the arguments
(`cli.arguments`: the parser, with the reading subcommands beside `finalize`), and
`run_command` runs one; each command imports its module only when it runs. Exit codes: 0 done, 1 not a run, nothing to show, an unreadable history file or a picture that
could not be written, 2 bad
usage (argparse's, directories and `--rank` that name no run to compare, a path starting
with `~name` for a user that does not exist, or a run directory whose path is not UTF-8), 3 matplotlib missing (plot, heatmap), 141
(`CLOSED_PIPE`) when the reader of standard output went away, 130 (`INTERRUPTED`) after Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torchinstruments.cli.arguments import parser

if TYPE_CHECKING:
    from torchinstruments.cli.selection import Selection

COMMANDS = ("show", "compare", "plot", "heatmap")
# The exit code when standard output's reader went away before the command finished (`show DIR |
# head`): what the shell reports for a process that SIGPIPE ended, 128 + 13.
CLOSED_PIPE = 141
# The exit code after Ctrl-C (SIGINT) stopped a command: what a shell reports for it, 128 + 2.
# finalize's files are each written atomically: finalize again completes the run.
INTERRUPTED = 130


def _width() -> int:
    """The terminal's width, at least 80 (80 when output is not a terminal)."""
    return max(80, shutil.get_terminal_size((80, 24)).columns)


def _path(path: Path) -> str:
    """A file the command wrote, by index.md's rule (`literal_if_unclear`): heatmap writes into
    the run directory, whose name (or `-o`'s) may hold an escape that rewrote the terminal."""
    from torchinstruments.rundir.shell import literal_if_unclear

    return literal_if_unclear(str(path))


def _error_said(error: OSError) -> str:
    """An error writing a picture, in one line (`rundir.shell.error_said`)."""
    from torchinstruments.rundir.shell import error_said

    return error_said(error)


def _selection(args: argparse.Namespace, *directories: Path) -> Selection:
    """The selection the options ask for, refused (SelectionError) where it matches nothing."""
    from torchinstruments.cli.reader import check_selection, parse_list
    from torchinstruments.cli.selection import Selection
    from torchinstruments.records import SIGNALS

    signals = SIGNALS if args.signal == "both" else (args.signal,)
    metrics = parse_list(args.metrics)
    selection = Selection(
        layers=args.layers,
        signals=signals,
        metrics=tuple(metrics) if metrics is not None else None,
        window=getattr(args, "window", None),
    )
    check_selection(
        directories, layers=selection.layers, signals=signals, metrics=selection.metrics
    )
    return selection


def _say_states(prog: str, *directories: Path, notes: bool) -> None:
    """One stderr line per run whose state file cannot be read (a newer schema, a bad value):
    the drawing and comparing commands go on with the history, and say so. With `notes`, the
    run's state when it is not complete (interrupted, in progress, incomplete) and its notes,
    as `show` begins them (what it did not record, and why): a picture, a csv or a markdown
    table is never made past them silently."""
    from torchinstruments.cli.reader import state_sentence
    from torchinstruments.cli.states import run_state
    from torchinstruments.cli.text import notes_lines
    from torchinstruments.rundir.index_page import page_notes
    from torchinstruments.rundir.shell import error_said, literal_if_unclear

    for directory in directories:
        shown = literal_if_unclear(str(directory))  # a path the user typed: index.md's rule
        try:
            state = run_state(Path(directory).expanduser())
        except (OSError, ValueError) as error:
            print(
                f"{prog}: {shown}: the run's state is unreadable ({error_said(error)}); its "
                "history is read as it is (layer order and settings unknown)",
                file=sys.stderr,
            )
            continue
        if not notes or state is None:
            continue
        sentence = state_sentence(Path(directory).expanduser(), state)
        if sentence != "complete":
            print(f"{prog}: {shown}: state: {sentence}", file=sys.stderr)
        for line in notes_lines(page_notes(state)):
            print(f"{prog}: {line}", file=sys.stderr)


def run_command(args: argparse.Namespace) -> int:
    """Run `show`, `compare`, `plot` or `heatmap` from parsed arguments; returns the exit code.

    A directory of `rank-NNN/` runs (and `--rank`) goes to `cli.ranks_command` first. Each
    run's state file is decoded once for the whole command (`cli.states`).
    """
    from torchinstruments.cli.ranks_command import UsageError, run_on_ranks
    from torchinstruments.cli.reader import NotARunError
    from torchinstruments.cli.states import decoded_once
    from torchinstruments.cli.text import error_lines

    with decoded_once():
        try:
            done = run_on_ranks(args, _run_single, _selection, _width())
        except UsageError as exc:
            print(error_lines(f"torchinstruments {args.command}", exc, "error: "), file=sys.stderr)
            return 2
        except (NotARunError, ValueError) as exc:
            print(error_lines(f"torchinstruments {args.command}", exc), file=sys.stderr)
            return 1
        except BrokenPipeError:
            raise  # the reader of stdout went away: `main` ends quietly (CLOSED_PIPE)
        except OSError as exc:  # a parent's picture that cannot be written, as `_run_single`
            print(f"torchinstruments {args.command}: {_error_said(exc)}", file=sys.stderr)
            return 1
        return _run_single(args) if done is None else done


def _run_single(args: argparse.Namespace) -> int:
    """Run a command whose directories are single runs; returns the exit code."""
    from torchinstruments.cli.reader import NotARunError
    from torchinstruments.cli.text import error_lines, plural

    prog = f"torchinstruments {args.command}"
    try:
        if args.command == "show":
            from torchinstruments.cli import show
            from torchinstruments.cli.selection import summary

            if args.format in ("csv", "markdown"):  # text and json say them in the output
                _say_states(prog, args.directory, notes=True)
            selection = _selection(args, args.directory)
            facts, frame = summary(args.directory, selection)
            from torchinstruments.cli.reader import window_of

            text = show.render(
                facts,
                frame,
                fmt=args.format,
                width=args.width or _width(),
                window=window_of(facts, selection.window),
                every_tensor=args.every_tensor,
            )
            print(text)
            return 0
        if args.command in ("compare", "plot", "heatmap"):
            _say_states(
                prog,
                *(
                    [args.directory_a, args.directory_b]
                    if args.command == "compare"
                    else [args.directory]
                ),
                # compare's text and json say them in the output
                notes=args.command != "compare" or args.format in ("csv", "markdown"),
            )
        if args.command == "compare":
            from torchinstruments.cli import compare

            comparison = compare.compare(
                args.directory_a,
                args.directory_b,
                _selection(args, args.directory_a, args.directory_b),
                tolerance=args.tolerance,
                x=args.x,
            )
            width = args.width or _width()
            if args.format in ("csv", "markdown"):  # text and json say them in the output
                for line in compare.open_lines(comparison):
                    print(f"{prog}: {line}", file=sys.stderr)
            print(compare.render(comparison, fmt=args.format, width=width, every_series=args.every))
            return 0
        if args.command == "plot":
            from torchinstruments.cli import plot
            from torchinstruments.cli.pictures import (
                MatplotlibMissingError,
                checked_png,
                metrics_left_out_line,
            )

            output = args.output or Path(args.directory) / "trends.png"
            selection = _selection(args, args.directory)
            checked_png(output)
            try:
                result = plot.plot(
                    args.directory,
                    output,
                    selection,
                    x=args.x,
                    max_tensors=args.max_tensors,
                    yscale=args.yscale,
                )
            except MatplotlibMissingError as exc:
                print(error_lines(prog, exc), file=sys.stderr)
                return 3
            print(
                f"wrote {_path(result.path)} ({result.width_px}x{result.height_px} px): "
                f"{plural(len(result.panels), 'panel')}, {plural(len(result.tensors), 'tensor')}, "
                f"x = {result.x}"
            )
            left_out_line = metrics_left_out_line(prog, result)
            if left_out_line is not None:
                print(left_out_line, file=sys.stderr)
            if result.left_out:
                print(
                    f"{prog}: {plural(len(result.left_out), 'tensor')} left out "
                    f"({', '.join(result.left_out[:5])}{', ...' if len(result.left_out) > 5 else ''}); "
                    "choose with --layers REGEX or raise --max-tensors",
                    file=sys.stderr,
                )
            shortened = [
                f"{short} = {full}"
                for short, full in zip(result.legend, result.tensors, strict=True)
                if short != full
            ]
            if shortened:
                print(
                    f"{prog}: {plural(len(shortened), 'legend label')} shortened (the PNG's "
                    f"Description metadata has them too): {'; '.join(shortened)}",
                    file=sys.stderr,
                )
            return 0
        if args.command == "heatmap":
            from torchinstruments.cli import heatmap
            from torchinstruments.cli.pictures import MatplotlibMissingError, checked_folder

            selection = _selection(args, args.directory)  # a missing run is said first
            output_dir = checked_folder(args.output_dir or Path(args.directory))
            try:
                results = heatmap.heatmap(
                    args.directory,
                    output_dir,
                    selection,
                    x=args.x,
                    scale=args.scale,
                    max_tensors=args.max_tensors or heatmap.DEFAULT_MAX_TENSORS,
                )
            except MatplotlibMissingError as exc:
                print(error_lines(prog, exc), file=sys.stderr)
                return 3
            for r in results:
                print(
                    f"wrote {_path(r.path)} ({r.width_px}x{r.height_px} px): {r.metric}, "
                    f"{plural(r.rows, 'tensor')} x {plural(r.columns, 'sample')}"
                )
            left_out = results[0].left_out if results else ()
            if left_out:
                print(
                    f"{prog}: {plural(len(left_out), 'tensor')} left out "
                    f"({', '.join(left_out[:5])}{', ...' if len(left_out) > 5 else ''}); "
                    "choose with --layers REGEX or raise --max-tensors",
                    file=sys.stderr,
                )
            return 0
    except (NotARunError, ValueError) as exc:
        print(error_lines(prog, exc), file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # the reader of stdout went away: `main` ends quietly (CLOSED_PIPE)
    except OSError as exc:  # a picture that cannot be written (a folder in its place, no space)
        print(f"{prog}: {_error_said(exc)}", file=sys.stderr)
        return 1
    raise ValueError(f"unknown command {args.command!r}")


__all__ = ["COMMANDS", "main", "run_command"]


_PATH_ARGUMENTS = {
    "directory": "DIR",
    "directory_a": "DIR_A",
    "directory_b": "DIR_B",
    "output": "--output",
    "output_dir": "--output-dir",
}


def _expand_paths(args: argparse.Namespace) -> bool:
    """Expand `~` in the path arguments once; False (said in one line on stderr) when one
    starts with `~name` for a user that does not exist (a usage error, exit 2)."""
    from torchinstruments.cli.text import error_lines
    from torchinstruments.rundir.output_dir import expand_user

    for attribute, shown in _PATH_ARGUMENTS.items():
        value = getattr(args, attribute, None)
        if value is None:
            continue
        try:
            setattr(args, attribute, expand_user(value, shown))
        except ValueError as error:
            print(error_lines(f"torchinstruments {args.command}", error), file=sys.stderr)
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m torchinstruments` and the `torchinstruments` script.

    Args:
        argv: arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        The exit code.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser().parse_args(words)
    except SystemExit as exited:
        if exited.code == 2:  # a usage error, said by argparse: a path it read as an option?
            _say_dashed_paths(words)
        raise
    if not _expand_paths(args):
        return 2
    try:
        if args.command == "finalize":
            from torchinstruments.cli.finalize import finalize_command

            return finalize_command(args.directory)
        if args.command in COMMANDS:
            return run_command(args)
    except BrokenPipeError:
        return _reader_went_away()
    except KeyboardInterrupt:  # Ctrl-C in a long heatmap or finalize: a line, not a traceback
        print(f"torchinstruments {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 2  # unreachable: argparse requires a known command


def _say_dashed_paths(words: Sequence[str]) -> None:
    """After argparse refused the command line: one line per word that starts with `-`, is
    no option, and names an existing path (a run directory called `-run`). argparse reads such
    a word as an unknown option, and said `the following arguments are required: DIR` without
    naming it; the line names it and how to pass it (`./-run`, or after `--`). An option's
    own name that is also a path (a file called `-o`) gets the line too: it only adds a hint."""
    from torchinstruments.rundir.shell import command_line

    command = next((word for word in words if not word.startswith("-")), None)
    prog = "torchinstruments" + ("" if command is None else f" {command}")
    for word in words:
        if word == "--":
            break
        if word[:1] != "-" or not os.path.lexists(word):
            continue
        print(
            f"{prog}: error: {command_line(word)} is read as an option, but it is a path "
            f"here: pass it as {command_line(Path(word))} (or after --)",
            file=sys.stderr,
        )


def _reader_went_away() -> int:
    """Standard output's reader closed the pipe (`show DIR | head`): it read what it wanted, so
    the command stops without a traceback. stdout then points at /dev/null, so that the
    interpreter's flush at exit does not fail on the closed pipe again."""
    with contextlib.suppress(OSError, ValueError):  # not a file descriptor (tests, notebooks)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return CLOSED_PIPE
