"""The command line: `finalize`, and reading a run with `show`, `compare`, `plot` and `heatmap`.

Design decision: these commands read run directories with Polars only; nothing here (nor what it
imports) imports torch or tensorboard, so `torchinstruments show DIR` starts in a fraction of a
second and works where torch is not installed. This package is the whole command line:
`main` (the `torchinstruments` script and `python -m torchinstruments`) parses the arguments
(`add_commands` puts the reading subcommands on the parser, beside `finalize`), and
`run_command` runs one; each command imports its module only when it runs. Exit codes: 0 done, 1 not a run, nothing to show or an unreadable history file, 2 bad
usage (argparse's, directories and `--rank` that name no run to compare, or a path starting
with `~name` for a user that does not exist), 3 matplotlib missing (plot, heatmap), 141
(`CLOSED_PIPE`) when the reader of standard output went away.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torchinstruments.cli.selection import Selection

COMMANDS = ("show", "compare", "plot", "heatmap")
# The exit code when standard output's reader went away before the command finished (`show DIR |
# head`): what the shell reports for a process that SIGPIPE ended, 128 + 13.
CLOSED_PIPE = 141
_X_CHOICES = ("sample_id", "forward_index")
# plot and heatmap can also draw over history's step (the trainer's global step); compare
# matches samples one to one, which a step shared by several samples cannot do.
_DRAW_X_CHOICES = (*_X_CHOICES, "step")


def _width() -> int:
    """The terminal's width, at least 80 (80 when output is not a terminal)."""
    return max(80, shutil.get_terminal_size((80, 24)).columns)


def _regex(text: str) -> str:
    """argparse type: a regular expression that Polars' engine (Rust's `regex`, which runs the
    `--layers` filter) compiles; checked by that engine itself, on an empty frame, since Python's
    `re` accepts patterns it refuses (look-around, back-references)."""
    import polars as pl

    try:
        pl.DataFrame(schema={"layer": pl.String}).select(pl.col("layer").str.contains(text))
    except pl.exceptions.PolarsError as exc:
        lines = str(exc).splitlines()
        why = next((li.strip() for li in lines if li.strip().startswith("error:")), lines[0])
        raise argparse.ArgumentTypeError(
            f"not a valid regular expression for Polars, which runs it "
            f"({why.removeprefix('error: ')}; Polars' regex has no look-around such as (?!...) "
            "or (?<=...) and no back-references such as \\1)"
        ) from None
    return text


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value!r}")
    return value


# The narrowest `--width`: a table keeps its number cells (10 characters each) and names of
# at least 6, so a narrower width draws no narrower table, only splits names and notes into
# slivers (`--width 1`: a layer name one letter a line).
MIN_WIDTH = 40


def _text_width(text: str) -> int:
    """argparse type: a text width the tables can be drawn in (an int >= MIN_WIDTH)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < MIN_WIDTH:
        raise argparse.ArgumentTypeError(
            f"must be an int >= {MIN_WIDTH} (narrower is too narrow to draw the tables), "
            f"got {text!r}"
        )
    return value


def _tolerance(text: str) -> float:
    """argparse type: a float >= 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


_ALL_METRICS = "all metrics in the run"
# plot's own default (cli.pictures.DEFAULT_METRICS, written out here so that building the parser
# imports no command module): a figure that reads on a screen, for a run and a directory of
# rank-NNN/ runs alike.
_PLOT_METRICS = (
    "mean, std, zero_fraction and nonfinite_fraction where the run has any of them, the others "
    "named on stderr; as many for a directory of rank-NNN/ runs"
)


def _selection_options(
    cmd: argparse.ArgumentParser, *, window: bool = True, metrics_default: str = _ALL_METRICS
) -> None:
    from torchinstruments.cli.ranks_command import add_rank_option

    add_rank_option(cmd)
    cmd.add_argument(
        "--layers",
        type=_regex,
        metavar="REGEX",
        help="layers whose name matches this regular expression (searched anywhere in the name; "
        "anchor with ^...$ for an exact name; Polars' regex syntax: no look-around or "
        "back-references)",
    )
    cmd.add_argument(
        "--signal",
        choices=("output", "output_gradient", "both"),
        default="both",
        help="which signal to read (default: both)",
    )
    cmd.add_argument(
        "--metrics",
        metavar="M1,M2",
        help=f"comma-separated metric names (default: {metrics_default})",
    )
    if window:
        cmd.add_argument(
            "--window",
            type=_positive,
            metavar="N",
            help="samples in the recent window (default: the run's own window)",
        )


def _format_option(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--format",
        choices=("text", "csv", "json", "markdown"),
        default="text",
        help="text (default, for the terminal) or csv / json / markdown (one row per series, "
        "full precision)",
    )
    cmd.add_argument(
        "--width",
        type=_text_width,
        metavar="COLUMNS",
        help=f"text width, at least {MIN_WIDTH} (default: the terminal's, at least 80)",
    )


class Subcommands(Protocol):
    """What `add_commands` uses of `ArgumentParser.add_subparsers()`'s result (argparse's class
    for it is private)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A new subcommand's parser."""
        ...


def add_commands(commands: Subcommands) -> None:
    """Add `show`, `compare`, `plot` and `heatmap` to the package's subcommand parsers."""
    from torchinstruments.rundir.shell import MATPLOTLIB_INSTALL

    cmd = commands.add_parser(
        "show",
        help="a finished or live run: facts, latest values and recent window means",
        description="Print the run's facts from its state file and, per layer, call, signal and tensor, "
        "the latest value and the recent window mean of each chosen metric. Works on finished "
        "runs (history.parquet), live or crashed ones (history.parts/).",
    )
    cmd.add_argument("directory", type=Path, metavar="DIR", help="a run's output directory")
    _selection_options(cmd)
    _format_option(cmd)
    cmd.add_argument(
        "--all",
        action="store_true",
        dest="every_tensor",
        help="text view: one row per tensor even beyond 60 tensors (default there: one row per "
        "module type and signal; of a directory of rank runs, beyond 60 rows per metric: one "
        "row per module type, signal and at; csv/json/markdown always hold every series)",
    )

    cmd = commands.add_parser(
        "compare",
        help="two matched runs side by side: window means, differences, first differing sample",
        description="Per layer, signal, tensor and metric: both runs' recent window means, their "
        "difference (B - A), and the first matched sample where they differ by more than "
        "--tolerance. Measured differences only. Rank directories (stats/rank-000, "
        "stats/rank-001) are compared like any two runs. A directory of rank-NNN/ runs alone "
        "(DIR_A, no DIR_B) is compared rank by rank (--rank 0,3 or 0-7 picks the ranks); two "
        "such directories with --rank N compare rank N of each.",
    )
    cmd.add_argument("directory_a", type=Path, metavar="DIR_A", help="run A")
    cmd.add_argument(
        "directory_b",
        type=Path,
        metavar="DIR_B",
        nargs="?",
        help="run B (omitted: DIR_A is a directory of rank-NNN/ runs, compared rank by rank)",
    )
    _selection_options(cmd)
    cmd.add_argument(
        "--tolerance",
        type=_tolerance,
        default=0.0,
        help="largest |B - A| that is not a difference (default 0: any difference)",
    )
    cmd.add_argument(
        "--x",
        choices=_X_CHOICES,
        default="sample_id",
        help="match samples on sample_id (default) or forward_index",
    )
    _format_option(cmd)
    cmd.add_argument(
        "--all",
        action="store_true",
        dest="every",
        help="text view: every series even beyond 60 (default there: the 60 that differ "
        "earliest, and how many more differ; csv/json/markdown always hold every series)",
    )

    cmd = commands.add_parser(
        "plot",
        help="PNG small multiples of metric trends (needs matplotlib: the `plot` extra)",
        description="Draw one panel per metric and signal, one line per tensor, over sample_id, "
        f"forward_index or step (--x), into a PNG. Needs matplotlib: {MATPLOTLIB_INSTALL}.",
    )
    cmd.add_argument("directory", type=Path, metavar="DIR", help="a run's output directory")
    _selection_options(cmd, window=False, metrics_default=_PLOT_METRICS)
    cmd.add_argument(
        "--x",
        choices=_DRAW_X_CHOICES,
        default="sample_id",
        help="x axis: sample_id (default), forward_index, or step (the trainer's global step, "
        "or set_step's value; samples without one are left out)",
    )
    cmd.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="PNG",
        help="PNG file to write, its name ending in .png, in an existing folder (default: "
        "DIR/trends.png; DIR/trends-ranks.png for a directory of rank-NNN/ runs)",
    )
    cmd.add_argument(
        "--max-tensors",
        type=_positive,
        default=10,
        metavar="N",
        help="draw at most N tensors (lines per panel), in traversal order (default 10); on a "
        "directory of rank-NNN/ runs, at most N ranks, each with all its modes",
    )
    cmd.add_argument(
        "--yscale",
        choices=("linear", "log", "symlog"),
        default="linear",
        help="y axis of every panel: linear (default), log (symlog in a panel whose drawn lines "
        "have values <= 0) "
        "or symlog (linear near 0, logarithmic beyond: one large tensor no longer flattens the "
        "rest)",
    )

    cmd = commands.add_parser(
        "heatmap",
        help="PNG per metric: tensors down, samples across (needs matplotlib: the `plot` extra)",
        description="Write one image per metric: tensors (traversal order) down, samples "
        "across, output and output_gradient side by side, one colour scale per panel. A null "
        "value (no value: its reason is in unavailable_reason, e.g. a tensor without finite "
        "entries) is grey, and a tensor without a row at a sample is white. Needs "
        f"matplotlib: {MATPLOTLIB_INSTALL}.",
    )
    cmd.add_argument("directory", type=Path, metavar="DIR", help="a run's output directory")
    _selection_options(cmd, window=False)
    cmd.add_argument(
        "--x",
        choices=_DRAW_X_CHOICES,
        default="sample_id",
        help="order and label the columns by sample_id (default), forward_index or step "
        "(samples without a step are left out)",
    )
    cmd.add_argument(
        "--scale",
        choices=("linear", "robust", "log"),
        default="linear",
        help="colour scale of each panel: linear min..max (default), robust (2nd..98th "
        "percentile) or log (symmetric log when values are not all positive)",
    )
    cmd.add_argument(
        "--max-tensors",
        type=_positive,
        default=None,
        metavar="N",
        help="draw at most N tensors (rows), in traversal order, the same in every image "
        "(default 60, each row labelled; the others are counted in the image and named on "
        "stderr); on a directory of rank-NNN/ runs, at most N ranks (default: all), each with "
        "all its modes",
    )
    cmd.add_argument(
        "-o",
        "--output-dir",
        type=Path,
        metavar="DIR_OUT",
        help="directory for heatmap-<metric>.png (heatmap-ranks-<metric>.png for a directory "
        "of rank-NNN/ runs; default: DIR; metrics whose names clean to the same file name get "
        "-2, -3, ...: each wrote line names its file)",
    )


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


def _say_unreadable_state(prog: str, *directories: Path) -> None:
    """One stderr line per run whose state file cannot be read (a newer schema, a bad value):
    the drawing and comparing commands go on with the history, and say so."""
    from torchinstruments.rundir.recovery import load_state

    for directory in directories:
        try:
            load_state(Path(directory).expanduser())
        except (OSError, ValueError) as error:
            print(
                f"{prog}: {directory}: the run's state is unreadable ({error}); its history is "
                "read as it is (layer order and settings unknown)",
                file=sys.stderr,
            )


def run_command(args: argparse.Namespace) -> int:
    """Run `show`, `compare`, `plot` or `heatmap` from parsed arguments; returns the exit code.

    A directory of `rank-NNN/` runs (and `--rank`) goes to `cli.ranks_command` first.
    """
    from torchinstruments.cli.ranks_command import UsageError, run_on_ranks
    from torchinstruments.cli.reader import NotARunError

    try:
        done = run_on_ranks(args, _run_single, _selection, _width())
    except UsageError as exc:
        print(f"torchinstruments {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (NotARunError, ValueError) as exc:
        print(f"torchinstruments {args.command}: {exc}", file=sys.stderr)
        return 1
    return _run_single(args) if done is None else done


def _run_single(args: argparse.Namespace) -> int:
    """Run a command whose directories are single runs; returns the exit code."""
    from torchinstruments.cli.reader import NotARunError
    from torchinstruments.cli.text import plural

    prog = f"torchinstruments {args.command}"
    try:
        if args.command == "show":
            from torchinstruments.cli import show
            from torchinstruments.cli.selection import summary

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
            _say_unreadable_state(
                prog,
                *(
                    [args.directory_a, args.directory_b]
                    if args.command == "compare"
                    else [args.directory]
                ),
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
                print(f"{prog}: {exc}", file=sys.stderr)
                return 3
            print(
                f"wrote {result.path} ({result.width_px}x{result.height_px} px): "
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
                print(f"{prog}: {exc}", file=sys.stderr)
                return 3
            for r in results:
                print(
                    f"wrote {r.path} ({r.width_px}x{r.height_px} px): {r.metric}, "
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
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    raise ValueError(f"unknown command {args.command!r}")


__all__ = ["COMMANDS", "add_commands", "main", "run_command"]


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
    from torchinstruments.rundir.output_dir import expand_user

    for attribute, shown in _PATH_ARGUMENTS.items():
        value = getattr(args, attribute, None)
        if value is None:
            continue
        try:
            setattr(args, attribute, expand_user(value, shown))
        except ValueError as error:
            print(f"torchinstruments {args.command}: {error}", file=sys.stderr)
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m torchinstruments` and the `torchinstruments` script.

    Args:
        argv: arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        The exit code.
    """
    args = _parser().parse_args(argv)
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
    return 2  # unreachable: argparse requires a known command


def _reader_went_away() -> int:
    """Standard output's reader closed the pipe (`show DIR | head`): it read what it wanted, so
    the command stops without a traceback. stdout then points at /dev/null, so that the
    interpreter's flush at exit does not fail on the closed pipe again."""
    with contextlib.suppress(OSError, ValueError):  # not a file descriptor (tests, notebooks)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return CLOSED_PIPE
