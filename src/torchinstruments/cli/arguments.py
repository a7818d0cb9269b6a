"""The command line's arguments: the parser, its subcommands and their options.

Design decision: the arguments are checked where argparse reads them (a `--layers` pattern by
Polars' own engine, a `--width` too narrow for the tables), so a bad one is a usage error (exit
2) before any run is read; and building the parser imports no command module, nor Polars
(except to check a pattern), so `--help` and a usage error stay quick. What each command does
with them is `cli.run_command`'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Protocol

_X_CHOICES = ("sample_id", "forward_index")
# plot and heatmap can also draw over history's step (the trainer's global step); compare
# matches samples one to one, which a step shared by several samples cannot do.
_DRAW_X_CHOICES = (*_X_CHOICES, "step")


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


def _run_directory(text: str) -> Path:
    """argparse type: a run directory's path, refused where it is not UTF-8 (a byte of another
    encoding, which Python gives as a lone surrogate): Polars, which reads the run, takes paths
    as UTF-8 text only, and raised a bare TypeError ('Object does not have a .read() method')
    with a traceback; inject refuses such a path for the same reason (a link works)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        from torchinstruments.rundir.shell import literal_if_unclear

        raise argparse.ArgumentTypeError(
            f"{literal_if_unclear(text)} is not UTF-8, and Polars reads only UTF-8 paths: pass "
            "a symbolic link of a UTF-8 name to it (`ln -s`), or rename it"
        ) from None
    return Path(text)


# The largest count an option takes: Polars' own (Int64), which raised OverflowError with a
# traceback for `--window 100000000000000000000000`.
MAX_COUNT = 2**63 - 1


def _positive(text: str) -> int:
    """argparse type: an int from 1 to MAX_COUNT. A text that is no int is refused in the same
    words: argparse's own message named this function (`invalid _positive value: 'x'`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value!r}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be an int <= {MAX_COUNT}, got {value!r}")
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
    """argparse type: a float >= 0 (a text that is no number refused in the same words, as
    `_positive` says why)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
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
    cmd.add_argument(
        "directory", type=_run_directory, metavar="DIR", help="a run's output directory"
    )
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
    cmd.add_argument("directory_a", type=_run_directory, metavar="DIR_A", help="run A")
    cmd.add_argument(
        "directory_b",
        type=_run_directory,
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
    cmd.add_argument(
        "directory", type=_run_directory, metavar="DIR", help="a run's output directory"
    )
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
    cmd.add_argument(
        "directory", type=_run_directory, metavar="DIR", help="a run's output directory"
    )
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


def parser() -> argparse.ArgumentParser:
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
    cmd.add_argument(
        "directory", type=_run_directory, metavar="DIR", help="the run's output directory"
    )
    add_commands(commands)
    return parser


__all__ = ["MAX_COUNT", "MIN_WIDTH", "Subcommands", "add_commands", "parser"]
