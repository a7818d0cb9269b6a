"""Reading a run directory without torch: the one reader of `show`, `compare`, `plot`, `heatmap`.

Design decisions:

- Files are listed here and handed to Polars as an explicit list with `glob=False` and hive
  partitioning off, so a run directory whose name holds glob characters or `key=value` parts
  (`runs/exp[lr=0.1]`) is read literally, like the library writes it.
- A finished run is its history.parquet; a live or crashed run is its completed parts
  (history.parts/part-*.parquet); a run whose merge was interrupted is history.parquet plus the
  parts its metadata does not list as merged. Rows are ordered as the library wrote them (the
  merged file first, then parts in part order) and ordered by sample_id with that write order
  breaking ties, so "latest" means the same as result.json's `latest`.
- A live run may merge (and delete its parts) between listing and reading; the read is retried
  with a fresh listing (`READ_ATTEMPTS`). Every reader lists and reads through `read_with` (one
  run) or `read_each_with` (several: the ranks of a parent, compare's two runs).
- A history file that is not a whole Parquet file (a copy cut short, a machine that lost power)
  stops the command with one line naming it and what to do (`UnreadableHistoryError`), except
  a part beside history.parquet, which `finalize` leaves in place when it cannot read it: that
  one is left out (`RunFiles.unreadable`) and `show` names it. The runs found below a directory
  that holds none are named by index.md's rule (`literal_if_unclear`): a name read from disk.
- Summaries follow result.json's definitions: `latest` is the last observation of a series, and
  the recent window is computed by result.json's own implementation
  (`rundir.windows.window_summaries`: the series' latest `window` sample_ids, the exact mean of
  its finite values), so `show` and result.json agree to the last bit.

The cost: each command reads the history again (filters are pushed into the Parquet scan, so
only the selected layers, signals and metrics are decoded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import polars as pl

from torchinstruments.cli.run_dirs import rank_directories, runs_below
from torchinstruments.cli.states import run_state
from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import SIGNALS, RunInfo
from torchinstruments.rundir.cut_finish import finishing_said, killed_in_finish
from torchinstruments.rundir.index_page import (
    counts_sentence,
    interrupted_sentence,
    page_notes,
    partial_in_flight,
)
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    HISTORY_SCHEMA,
    INDEX_FILE,
    PARTS_DIR,
    STATE_FILE,
    list_parts,
)
from torchinstruments.rundir.left_parts import part_unreadable, parts_beside
from torchinstruments.rundir.lock import writer_ended
from torchinstruments.rundir.marks import is_mark
from torchinstruments.rundir.ranges import listed
from torchinstruments.rundir.recovery import NO_SETTINGS
from torchinstruments.rundir.shell import command_line, error_said, literal_if_unclear, tool_command
from torchinstruments.rundir.state import RunState, Status
from torchinstruments.rundir.windows import SERIES_KEY, TENSOR_KEY
from torchinstruments.rundir.write_trouble import read_trouble

X_COLUMNS = ("sample_id", "forward_index")
READ_ATTEMPTS = 5
_ORDER = "_write_order"
T = TypeVar("T")


class NotARunError(FileNotFoundError):
    """The directory holds no run (neither history.parquet nor completed parts)."""


class UnreadableHistoryError(ValueError):
    """A history file of the run is not a whole Parquet file; the message says what to do.

    Attributes:
        directory: the run directory whose file it is (a reader of a parent of rank runs
            leaves that rank out and reads the others).
    """

    def __init__(self, message: str, directory: Path) -> None:
        super().__init__(message)
        self.directory = directory


@dataclass(frozen=True)
class RunFiles:
    """The Parquet files that hold a run's history right now.

    Attributes:
        directory: the run directory.
        history: history.parquet, when it exists.
        parts: completed parts not (yet) merged into history.parquet, in write order.
        unreadable: parts beside history.parquet that Parquet cannot read (`finalize` leaves
            such a part in place and says so): left out of the reading, and said.
    """

    directory: Path
    history: Path | None
    parts: tuple[Path, ...]
    unreadable: tuple[Path, ...] = ()

    @property
    def paths(self) -> list[Path]:
        """All files to read, in write order."""
        return ([self.history] if self.history else []) + list(self.parts)


@dataclass(frozen=True)
class RunFacts:
    """What the run's state file says about it, plus what its files say now.

    Attributes:
        directory: the run directory.
        run: the run's RunInfo, or None when its state is missing or unreadable.
        state: "complete", "in progress", or a sentence saying what is missing.
        counts: the counts line of index.md (without the leading "- "), when the run has counts.
        files: the files the history was read from.
        run_state: the state read (`cli.states.run_state`), or None.
        marked: the marked samples in the history files now (`rundir.marks`: a root forward
            that raised, or a sample only partly written), sample_id -> the reason of its first
            marker row. Their values are partial: `show` and `compare` say so.
    """

    directory: Path
    run: RunInfo | None
    state: str
    counts: str | None
    files: RunFiles
    run_state: RunState | None = None
    marked: Mapping[int, str] = field(default_factory=dict)

    @property
    def notes(self) -> tuple[str, ...]:
        """The notes at the top of the run's index.md (`index_page.page_notes`): what the run
        did not record, and why; none without a state."""
        return page_notes(self.run_state) if self.run_state is not None else ()

    def marked_lines(self, limit: int = 3) -> list[str]:
        """`marked samples: N (sample 3: <reason>; ...)`, or nothing when none is marked."""
        if not self.marked:
            return []
        shown = [  # a reason quotes the user's exception: index.md's rule
            f"sample {s}: {literal_if_unclear(self.marked[s])}" for s in sorted(self.marked)[:limit]
        ]
        more = "; ..." if len(self.marked) > limit else ""
        return [
            f"marked samples: {len(self.marked)}, partial, not ordinary ones "
            f"({'; '.join(shown)}{more})"
        ]


def locate(directory: Path) -> RunFiles:
    """List the files that hold `directory`'s history now.

    Args:
        directory: a run directory (used literally, never as a pattern).

    Raises:
        NotARunError: if it has neither history.parquet nor completed parts; the message names
            its `rank-NNN/` subdirectories when it has some.
    """
    directory = Path(directory).expanduser()
    shown = literal_if_unclear(str(directory))  # a path the user typed: index.md's rule
    if not directory.is_dir():
        what = "is a file, not a run directory" if directory.exists() else "does not exist"
        raise NotARunError(f"{shown} {what}: pass a run's output directory")
    history = directory / HISTORY_FILE
    if history.is_file():
        try:
            parts = parts_beside(directory, history)
        except pl.exceptions.PolarsError:
            message = _damaged_message(directory, history, [history])
            raise UnreadableHistoryError(message, directory) from None
        # Parts beside history.parquet are rare (a merge cut short, or one `finalize` could
        # not read and left in place): check those alone, not a live run's every part.
        unreadable = tuple(p for p in parts if part_unreadable(p))
        readable = tuple(p for p in parts if p not in unreadable)
        return RunFiles(directory, history, readable, unreadable)
    if parts := list_parts(directory):
        return RunFiles(directory, None, tuple(parts))
    ranks = rank_directories(directory)
    if ranks:
        names = ", ".join(p.name for p in ranks)
        raise NotARunError(
            f"{shown} holds no run itself but rank directories ({names}): pass one of "
            f"them, e.g. {command_line(ranks[0])}"
        )
    if any((directory / name).exists() for name in (PARTS_DIR, STATE_FILE, INDEX_FILE)):
        raise NotARunError(
            f"{shown} is a run without any history yet: no sample has been written "
            f"({PARTS_DIR}/ has no completed part and {HISTORY_FILE} does not exist)"
        )
    below = runs_below(directory)
    if below:
        names = listed([literal_if_unclear(str(p.relative_to(directory))) for p in below])
        raise NotARunError(
            f"{shown} holds no run itself but {len(below)} below it ({names}): pass "
            f"one of them, e.g. {command_line(below[0])}"
        )
    raise NotARunError(f"{shown} holds no run: neither {HISTORY_FILE} nor {PARTS_DIR}/")


def scan_files(files: RunFiles, *, write_order: bool = True) -> pl.LazyFrame:
    """The history of `files` as one LazyFrame, with a `_write_order` row index if asked.

    The row index keeps filters from reaching the Parquet scan (a row's index depends on every
    row before it), so a query that needs no order asks for none and reads only what it keeps.
    """
    if not files.paths:
        lf = pl.DataFrame(schema=HISTORY_SCHEMA).lazy()
    else:
        lf = pl.scan_parquet(
            files.paths,
            schema=HISTORY_SCHEMA,
            glob=False,
            hive_partitioning=False,
            missing_columns="insert",  # a file of an earlier version (`layout.LATER_COLUMNS`)
        )
    return lf.with_row_index(_ORDER) if write_order else lf


def read_history(
    directory: Path,
    query: Callable[[pl.LazyFrame], pl.LazyFrame] = lambda lf: lf,
    *,
    write_order: bool = True,
) -> pl.DataFrame:
    """Collect `query(history)` for a finished, live or crashed run.

    Args:
        directory: the run directory.
        query: builds the result from the history LazyFrame (which has the history schema plus,
            with `write_order`, `_write_order`, the row's position in write order).
        write_order: whether the query needs `_write_order` (without it, filters and column
            choices reach the Parquet scan).

    Returns:
        The collected frame.

    Raises:
        NotARunError: see `locate`.
    """
    return read_with(
        directory, lambda files: query(scan_files(files, write_order=write_order)).collect()
    )


def read_with(directory: Path, compute: Callable[[RunFiles], T]) -> T:
    """`compute(files)` over the files that hold `directory`'s history now, computed again
    over a fresh listing when a live run merged (and removed) parts meanwhile (`READ_ATTEMPTS`):
    for a computation that reads the history in several collects (`cli.chunked`).

    Raises:
        NotARunError: see `locate`.
        UnreadableHistoryError: a history file is not a whole Parquet file.
    """
    for attempt in range(READ_ATTEMPTS):
        merged_before = _identity(Path(directory).expanduser() / HISTORY_FILE)  # before listing
        files = locate(directory)
        try:
            result = compute(files)
            # A continued run's removal put history.parquet, now holding the parts read beside
            # it, in place while they were read: their rows were read twice. List again.
            if not files.parts or _identity(files.history) == merged_before:
                return result
            if attempt == READ_ATTEMPTS - 1:
                raise FileNotFoundError(f"{files.history} kept changing while it was read")
        except (FileNotFoundError, pl.exceptions.ComputeError):
            # A live run merged (and removed) parts between listing and reading: list again.
            if attempt == READ_ATTEMPTS - 1 or all(p.exists() for p in files.paths):
                damaged = [p for p in files.paths if part_unreadable(p)]
                if damaged:
                    message = _damaged_message(files.directory, files.history, damaged)
                    raise UnreadableHistoryError(message, files.directory) from None
                raise
    raise AssertionError("unreachable")


def read_each_with(directories: Sequence[Path], compute: Callable[[list[RunFiles]], T]) -> T:
    """`compute` over the files of each of `directories` (in their order), each protected as
    `read_with` protects one: a computation over several runs (the ranks of a parent, the two
    runs of `compare`) computes again when any of them merged meanwhile.

    Raises:
        NotARunError: see `locate`.
        UnreadableHistoryError: a history file is not a whole Parquet file.
    """
    if not directories:
        return compute([])
    first, *rest = directories
    return read_with(
        first, lambda files: read_each_with(rest, lambda others: compute([files, *others]))
    )


def _identity(history: Path | None) -> tuple[int, int] | None:
    """history.parquet's inode and modification time (None when absent): every write of it
    replaces the file (`layout.replace_atomically`), so a new one has another identity."""
    try:
        found = history.stat() if history is not None else None
    except FileNotFoundError:
        return None
    return None if found is None else (found.st_ino, found.st_mtime_ns)


def _damaged_message(directory: Path, history: Path | None, damaged: Sequence[Path]) -> str:
    """What to do about the history files of `directory` that Parquet cannot read."""
    names = ", ".join(str(p) for p in damaged)
    if history in damaged:
        return (
            f"{names}: the history file is unreadable (not a whole Parquet file: cut short by "
            "a copy or a crash of the machine); restore it from a copy of the run"
        )
    return (
        f"{names}: unreadable (not a whole Parquet file: cut short by a copy or a crash of the "
        f"machine); `{tool_command('finalize', directory)}` merges the readable parts and "
        "leaves this one in place, said in index.md, and the commands then read the rest"
    )


def read_facts(directory: Path) -> RunFacts:
    """What the state file says about `directory`, and which files hold its history now."""
    directory = Path(directory).expanduser()
    files = locate(directory)
    try:
        state = run_state(directory)
    except (OSError, ValueError) as error:
        why = f"the run's state is unreadable ({error_said(error)})"
        return RunFacts(directory, None, why, None, files, marked=read_marked(directory))
    if state is None:
        why = f"{NO_SETTINGS} (settings and layer order unknown)"
        return RunFacts(directory, None, why, None, files, marked=read_marked(directory))
    counts = None if state.counts is None else counts_sentence(state)
    sentence = _state_sentence(state, files, directory)
    return RunFacts(directory, state.run, sentence, counts, files, state, read_marked(directory))


def read_marked(directory: Path) -> dict[int, str]:
    """The marked samples of `directory`'s history now: sample_id -> first marker's reason."""
    frame = read_history(
        directory,
        lambda lf: (
            lf.filter(is_mark())
            .sort("sample_id", _ORDER)
            .group_by("sample_id", maintain_order=True)
            .agg(pl.col("unavailable_reason").first())
        ),
    )
    return {int(r["sample_id"]): r["unavailable_reason"] or "" for r in frame.iter_rows(named=True)}


def state_sentence(directory: Path, state: RunState) -> str:
    """`directory`'s state as `show` prints it ("complete", "interrupted ...", ...)."""
    return _state_sentence(state, locate(directory), directory)


def _state_sentence(state: RunState, files: RunFiles, directory: Path) -> str:
    """The state as `show` prints it; parts not yet merged make a finished run incomplete."""
    status = state.status
    finalize_command = tool_command("finalize", directory)
    if status is Status.COMPLETE and not files.parts and state.removed_in_flight:
        partial = partial_in_flight(state.removed_in_flight)
        return f"complete, removed while a sample was in flight ({partial} and marked)"
    if status is Status.COMPLETE and not files.parts:
        killed = [note for note in state.notes if killed_in_finish(note)]
        return "complete" + "".join(f" ({literal_if_unclear(note)})" for note in killed[-1:])
    if status is Status.INTERRUPTED and not files.parts:
        return interrupted_sentence(state)
    if status is Status.INCOMPLETE:
        missing = [  # the state's text (errors, paths), by index.md's rule
            *(literal_if_unclear(problem) for problem in state.problems),
            *(literal_if_unclear(loss.describe()) for loss in state.losses),
        ]
        return "INCOMPLETE: " + "; ".join(missing) + " (see the top of index.md)"
    trouble = read_trouble(directory) if status is Status.IN_PROGRESS else None
    if trouble is not None:  # its writes failed: the state file could not say so
        said = literal_if_unclear(trouble)  # read from the lock file
        return _trouble_sentence(said, writer_ended(directory), finalize_command)
    if status is Status.IN_PROGRESS and state.removal_step is not None:
        return finishing_said(state, writer_ended(directory), finalize_command)
    if status is Status.IN_PROGRESS:
        ended = writer_ended(directory)
        if ended is False:
            return "in progress (a live process holds the run's lock; no final counts yet)"
        if ended:
            return (
                "interrupted: not finished, and no process holds the run's lock (its process "
                "ended without remove_observer: killed, crashed or os._exit; no final counts); "
                f"`{finalize_command}` completes it"
            )
        return (
            "in progress, or interrupted (no final counts yet; if the process is gone, "
            f"`{finalize_command}` completes it)"
        )
    return f"incomplete (parts not merged yet; `{finalize_command}`)"


def _trouble_sentence(trouble: str, ended: bool | None, finalize_command: str) -> str:
    """The state of a run whose writer said, in its lock file, why nothing reached its
    directory (`rundir.write_trouble`), its process live or `ended` (None: unknown)."""
    if ended is False:
        return (
            f"in progress, but recording nothing to its directory {trouble} (a live process "
            "holds the run's lock; its state file was last written before that)"
        )
    return (
        f"interrupted: its writes failed {trouble}; {'no' if ended else 'if no'} process holds "
        f"the run's lock (its state file was last written before that); `{finalize_command}` "
        "completes it once the directory takes writes"
    )


def window_of(facts: RunFacts, window: int | None) -> int:
    """The window asked for, else the run's own, else `HistoryConfig`'s default."""
    if window is not None:
        return window
    return facts.run.history.window if facts.run is not None else HistoryConfig().window


def select(
    lf: pl.LazyFrame,
    *,
    layers: str | None = None,
    signals: Sequence[str] = SIGNALS,
    metrics: Sequence[str] | None = None,
) -> pl.LazyFrame:
    """Rows of the chosen layers (regex, searched anywhere in the name), signals and metrics;
    never marker rows (`RunFacts.marked` lists those)."""
    conditions = [pl.col("signal").is_in(list(signals)), ~is_mark()]
    if layers is not None:
        conditions.append(pl.col("layer").str.contains(layers))
    if metrics is not None:
        conditions.append(pl.col("metric").is_in(list(metrics)))
    return lf.filter(*conditions)


def metric_order(present: Sequence[str], run: RunInfo | None) -> list[str]:
    """Metrics in the run's declared order, then any others, sorted."""
    declared = list(run.metrics) if run is not None else []
    ordered = [m for m in declared if m in present]
    return ordered + sorted(set(present) - set(ordered))


def layer_order(present: Sequence[str], run: RunInfo | None) -> list[str]:
    """Layers in traversal order (the run's), then any others, sorted."""
    declared = [li.name for li in run.layers] if run is not None else []
    wanted = set(present)
    ordered = [name for name in declared if name in wanted]
    return ordered + sorted(wanted - set(ordered))


def _counts_unknown(directory: Path) -> bool:
    """Whether the run's state says what its rows held is unknown (killed before any layer's
    row reached the disk: `RunState.layer_counts_unknown`; its TensorBoard events may still
    prove samples, so "no sample was taken" would be false)."""
    try:
        state = run_state(Path(directory))
    except (OSError, ValueError):
        return False
    return state is not None and state.layer_counts_unknown


class SelectionError(ValueError):
    """A `--layers`, `--signal` or `--metrics` choice that matches nothing in the run(s)."""


def _has_row(directories: Sequence[Path], condition: pl.Expr) -> bool:
    """Whether any of the runs holds a row where `condition` holds.

    The filter reaches the Parquet scan (a row group whose statistics rule it out is not
    decoded) and the read stops at the first such row: a 5.4 M-row history is not decoded
    whole to learn which names it holds.
    """
    return any(
        read_history(
            d, lambda lf: lf.filter(condition).head(1).select(pl.len()), write_order=False
        ).item()
        > 0
        for d in directories
    )


def _held(directories: Sequence[Path], column: str) -> list[str]:
    """The values of one name column in the runs' histories (for a refusal's message only)."""
    frames = [
        read_history(d, lambda lf: lf.select(pl.col(column).unique()), write_order=False)
        for d in directories
    ]
    return pl.concat(frames)[column].unique().drop_nulls().to_list()


def check_selection(
    directories: Sequence[Path],
    *,
    layers: str | None,
    signals: Sequence[str],
    metrics: Sequence[str] | None,
) -> None:
    """Refuse a choice that matches nothing, listing what the runs hold.

    A typo (`--metrics zero_frac`, `--layers zzz`) would otherwise look like missing data. The
    names come from the history itself, so a custom reducer's metric counts like a default one.
    Only what the answer needs is read: whether some row matches each choice (`_has_row`: a
    row group that cannot hold it is skipped, the read stops at the first), and the names a
    refusal lists.

    Raises:
        SelectionError: naming the option, what matched nothing and the available names.
    """
    runs = "these runs" if len(directories) > 1 else "this run"
    its = "their" if len(directories) > 1 else "its"  # compare's two runs are theirs
    shown = ", ".join(literal_if_unclear(str(d)) for d in directories)  # index.md's rule
    if not _has_row(directories, pl.lit(True)):
        if any(_counts_unknown(d) for d in directories):
            raise SelectionError(
                f"{shown}: no row reached the disk (the process "
                "ended before its first part was written), so what its samples held is unknown "
                "(its index.md says how many are known): nothing to show"
            )
        raise SelectionError(
            f"{shown}: {runs} recorded no rows (no sample was taken; "
            f"{its} index.md {'files say' if len(directories) > 1 else 'says'} why): nothing to "
            "show"
        )
    problems = []
    if layers is not None and not _has_row(directories, pl.col("layer").str.contains(layers)):
        names = layer_order(_held(directories, "layer"), None)
        problems.append(
            f"--layers {layers!r} matches no layer with rows in {runs}; {its} layers with "
            f"rows: {listed(names, quote=True)} (a selected layer that never ran in a sampled forward "
            "has none: index.md's Layers section lists every one)"
        )
    if not _has_row(directories, pl.col("signal").is_in(list(signals))):
        held = [s for s in SIGNALS if _has_row(directories, pl.col("signal") == s)]
        problems.append(
            f"--signal {'/'.join(signals)}: {runs} recorded only {', '.join(held) or 'nothing'}"
        )
    if metrics is not None:
        unknown = [m for m in metrics if not _has_row(directories, pl.col("metric") == m)]
        known = ", ".join(sorted(_held(directories, "metric"))) if not metrics or unknown else ""
        if not metrics:  # `--metrics ""`, e.g. from a shell variable that was not set
            problems.append(
                f"--metrics names no metric (it is empty): name one or more, comma-separated; "
                f"the metrics of {runs}: {known}"
            )
        elif unknown:
            problems.append(
                f"--metrics: {', '.join(repr(m) for m in unknown)} "
                f"{'is not a metric' if len(unknown) == 1 else 'are not metrics'} of {runs}; "
                f"{its} metrics: {known}"
            )
    if problems:
        raise SelectionError("; ".join(problems))


def parse_list(text: str | None) -> list[str] | None:
    """`"mean, std"` -> `["mean", "std"]`; None stays None."""
    if text is None:
        return None
    return [item.strip() for item in text.split(",") if item.strip()]


__all__ = [
    "SERIES_KEY",
    "TENSOR_KEY",
    "X_COLUMNS",
    "NotARunError",
    "RunFacts",
    "RunFiles",
    "SelectionError",
    "UnreadableHistoryError",
    "check_selection",
    "layer_order",
    "locate",
    "metric_order",
    "parse_list",
    "rank_directories",
    "read_each_with",
    "read_facts",
    "read_history",
    "read_with",
    "runs_below",
    "scan_files",
    "select",
    "state_sentence",
    "window_of",
]
