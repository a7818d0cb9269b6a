"""The run directory's rules: its file names, the history schema, literal paths, atomic writes.

Design decision: a run directory is fixed once, at injection: `resolve_output_dir` expands `~` and
makes the path absolute, so a later `os.chdir` cannot move the run, and every read, write, scan
and merge afterwards uses it literally. Polars treats path strings as glob patterns by default, so
every Polars call in this package passes `glob=False` and lists files itself (`list_parts`): a
directory named `exp[lr=0.1]` or `a?b` is just a name.

Every file the library writes appears through `replace_atomically` (`os.replace` of a complete,
synced temporary file whose name ends in `TMP_SUFFIX`, a suffix no user file is expected to carry),
so crash recovery can delete the library's leftovers and nothing else.

This module imports Polars but never torch: `torchinstruments finalize` runs without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import polars as pl

__all__ = [
    "HISTORY_COMPRESSION",
    "HISTORY_COMPRESSION_LEVEL",
    "HISTORY_FILE",
    "HISTORY_ORDER",
    "HISTORY_PAGE_BYTES",
    "HISTORY_ROW_GROUP_ROWS",
    "HISTORY_SCHEMA",
    "INDEX_FILE",
    "LOCK_FILE",
    "MERGE_TMP_DIR",
    "ORDER_KEY",
    "PARTS_DIR",
    "RECORDED_SCHEMA",
    "RESULT_FILE",
    "RUN_MARKERS",
    "STATE_FILE",
    "TENSORBOARD_DIR",
    "TMP_SUFFIX",
    "check_output_dir",
    "empty_history",
    "fsync_path",
    "is_library_temporary",
    "list_parts",
    "order_metadata",
    "part_number",
    "part_path",
    "read_order",
    "replace_atomically",
    "resolve_output_dir",
    "scan_history",
    "sink_history",
    "temporary_path",
    "write_parquet_atomic",
    "write_text_atomic",
]

PARTS_DIR = "history.parts"
HISTORY_FILE = "history.parquet"
RESULT_FILE = "result.json"
INDEX_FILE = "index.md"
LOCK_FILE = ".lock"
# The run's state (rundir.state): the machine-readable truth index.md is rendered from.
STATE_FILE = ".state.json"
TENSORBOARD_DIR = "tensorboard"
MERGE_TMP_DIR = "history.merge.torchinstruments-tmp"
# Temporary files of atomic writes; finalize deletes files with this suffix and no others.
TMP_SUFFIX = ".torchinstruments-tmp"
# What marks a directory as holding a run (inject refuses such a directory). tensorboard/ too: a
# leftover one (its run's other files deleted) would mix two runs' histograms in one event log.
RUN_MARKERS = (PARTS_DIR, HISTORY_FILE, RESULT_FILE, INDEX_FILE, STATE_FILE, TENSORBOARD_DIR)

HISTORY_SCHEMA = pl.Schema(
    {
        "sample_id": pl.Int64(),
        "forward_index": pl.Int64(),
        "timestamp": pl.Datetime("us", "UTC"),
        "rank": pl.Int32(),
        "layer": pl.String(),
        "module_type": pl.String(),
        "call_index": pl.Int32(),
        "signal": pl.String(),
        "tensor_path": pl.String(),
        "shape": pl.List(pl.Int64()),
        "dtype": pl.String(),
        "placement": pl.String(),
        "mesh_coordinate": pl.List(pl.Int64()),
        "step": pl.Int64(),
        "mode": pl.String(),
        "grad_enabled": pl.Boolean(),
        "metric": pl.String(),
        "value": pl.Float64(),
        "unavailable_reason": pl.String(),
        "population": pl.String(),
    }
)
# What a record's rows hold (`rundir.columns` builds them); the history writer adds the columns
# below, which are the same for every row of one process.
RECORDED_SCHEMA = pl.Schema(HISTORY_SCHEMA)
# The attempt (process) that wrote the row, from 0; a continued run's later processes count up
# (`rundir.attempts`). Null in rows written by a version before it.
HISTORY_SCHEMA = pl.Schema({**RECORDED_SCHEMA, "attempt": pl.Int32()})

# The order of history.parquet: by sample_id, then signal (output before output_gradient), then
# write order (a forward's tensors in the order its layers returned, a backward's in the order its
# gradients arrived). A stable sort on two columns, not on every key column: parts are written in
# that order already, so the merge usually only concatenates them (merge.py), and neighbouring
# layers' values stay neighbours in the file, which compresses better than name order.
HISTORY_ORDER = ("sample_id", "signal")
# A part's or history.parquet's Parquet metadata entry: JSON `{"first": [sample_id, signal],
# "last": [...]}` when its rows are in HISTORY_ORDER (first/last null when it has none); absent
# when they are not, or the file predates it.
ORDER_KEY = "torchinstruments.order"

_PART_RE = re.compile(r"^part-(\d+)\.parquet$")


def resolve_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """The run directory as an absolute path with `~` expanded, fixed for the life of the run.

    Raises:
        ValueError: if `output_dir` is empty.
        FileExistsError: if it names an existing file (not a directory).
    """
    text = os.fspath(output_dir)
    if isinstance(text, bytes) or not text.strip():
        raise ValueError(
            f"output_dir must name a directory, got {output_dir!r}; pass e.g. output_dir='stats'"
        )
    path = Path(text).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise FileExistsError(
            f"output_dir={str(path)!r} is an existing file, not a directory; pass a directory path"
        )
    return path


def check_output_dir(path: Path) -> None:
    """Refuse an output directory that already holds a run (or a leftover tensorboard/).

    The message names both ways on, and never a command after which the same refusal comes
    back: `resume=True` continues the run there (a restarted job), or a new output_dir starts
    a new one.

    Raises:
        FileExistsError: if it contains history.parts/, history.parquet, result.json, index.md,
            .state.json or a tensorboard/ folder.
    """
    found = [
        name
        for name in RUN_MARKERS
        if (path / name).exists() and (name != TENSORBOARD_DIR or (path / name).is_dir())
    ]
    if found == [TENSORBOARD_DIR]:
        raise FileExistsError(
            f"output_dir={str(path)!r} holds a {TENSORBOARD_DIR}/ folder and no run (a leftover "
            "of a run whose other files were deleted?): this run's histograms would mix with "
            f"its events. Pass a new output_dir, or move or delete {TENSORBOARD_DIR}/ first."
        )
    if found:
        raise FileExistsError(
            f"output_dir={str(path)!r} already holds a run ({', '.join(found)}). To continue "
            "that run in this directory (a restarted or requeued job), pass resume=True to "
            "inject_observer (a killed run is completed first, then sample_id continues); to "
            "start a new run, pass a new output_dir (or move the old run away)."
        )


def part_path(directory: Path, number: int) -> Path:
    """The path of part `number` under `directory/history.parts/`."""
    return directory / PARTS_DIR / f"part-{number:09d}.parquet"


def part_number(path: Path) -> int | None:
    """The number of a part file, or None when the name is not a part's."""
    match = _PART_RE.match(path.name)
    return int(match.group(1)) if match else None


def list_parts(directory: Path) -> list[Path]:
    """Completed parts under `directory/history.parts/`, in the order they were written."""
    parts_dir = directory / PARTS_DIR
    if not parts_dir.is_dir():
        return []
    found = [(part_number(p), p) for p in parts_dir.iterdir() if p.is_file()]
    return [p for n, p in sorted((n, p) for n, p in found if n is not None)]


def scan_history(paths: Path | list[Path]) -> pl.LazyFrame:
    """A lazy scan of history files, taken literally (never as glob patterns)."""
    return pl.scan_parquet(paths, schema=HISTORY_SCHEMA, glob=False)


# history.parquet's Parquet layout (`sink_history`). Polars (2.1) compresses each page on its own
# and picks the encodings itself: `value` (Float64) is always PLAIN, the integer columns and
# strings dictionary-encoded per row group. A sample repeats most of the previous one's values
# (counts, zero fractions, layers that no longer change), and the codec finds those repeats only
# inside one page, so a row group whose every column is one page (HISTORY_PAGE_BYTES holds 2**18
# rows of up to 64 bytes) pays for a new value once per row group. `timestamp` (one per tensor,
# shared by its metrics) is a dictionary plus one run per tensor, whatever the layout or the row
# order: Polars writes no delta encoding, and the runs' keys count up, which no codec predicts.
# Measured on bench/removal.py's `chain` (1 M rows, 18k series), bytes per row: Polars' defaults
# 1.49; zstd with 2**17-row groups and 4 MiB pages 1.26 (value 0.80, timestamp 0.39); zstd with
# 2**18 rows and 16 MiB pages 1.08 (0.65, 0.38); brotli level 5 with 2**18 rows, what is written
# now, 0.98 (0.62, 0.33). Its `deep` case (60 steps, 3.2 M rows): 1.53, 1.12 and 1.02. Brotli
# costs CPU: about 0.18 s more per million rows to write (the merge) and twice zstd's time to
# decode (0.05 to 0.08 s for the chain's whole file); brotli levels 6 to 9 save under 2% more,
# level 4 half as much, zstd levels up to 12 nothing. Larger groups cost memory: the merge holds
# a row group while it encodes it (alone, zstd: +141..144 MiB at 2**18, +215..229 at 2**19;
# brotli adds 45 to 60), and every reader decodes one at a time. 2**19 rows with brotli (0.89)
# put removal's peak at +245..255 MiB, at issue 21's +256 MiB bar, even with result.json
# reading 2**17 rows at a time. Reordering the rows inside a sample (by series, by metric)
# moves the file by at most 6% with zstd and by nothing with brotli. docs/benchmarks.md has the
# figures.
HISTORY_ROW_GROUP_ROWS = 2**18
HISTORY_PAGE_BYTES = 2**24
HISTORY_COMPRESSION: Literal["brotli"] = "brotli"
HISTORY_COMPRESSION_LEVEL = 5


def sink_history(lf: pl.LazyFrame, target: Path, metadata: dict[str, str] | None = None) -> None:
    """Stream `lf` (history rows) into the Parquet file `target` with history.parquet's layout
    and Parquet key-value `metadata`."""
    lf.sink_parquet(
        target,
        compression=HISTORY_COMPRESSION,
        compression_level=HISTORY_COMPRESSION_LEVEL,
        metadata=metadata or None,
        row_group_size=HISTORY_ROW_GROUP_ROWS,
        data_page_size=HISTORY_PAGE_BYTES,
    )


def empty_history(schema: pl.Schema | None = None) -> pl.DataFrame:
    """A history table with no rows and the exact schema (or `schema`)."""
    return pl.DataFrame(schema=HISTORY_SCHEMA if schema is None else schema)


def temporary_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: next to it, except a part's.

    A part's temporary is in the run directory, not in `history.parts/`: a live reader of that
    directory (`pl.read_parquet(run / "history.parts")`, which refuses a directory holding files
    of different extensions, or a glob that lists a name the rename just removed) then only ever
    sees completed parts. The same file system, so the rename stays atomic; the name ends in
    `TMP_SUFFIX`, so `finalize` deletes it after a crash.
    """
    if path.parent.name == PARTS_DIR and part_number(path) is not None:
        return path.parent.parent / f"{PARTS_DIR}-{path.name}{TMP_SUFFIX}"
    return path.with_name(path.name + TMP_SUFFIX)


def is_library_temporary(path: Path) -> bool:
    """Whether `path` is a leftover of one of the library's atomic writes."""
    return path.name.endswith(TMP_SUFFIX)


def fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage (best effort for directories)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if not path.is_dir():
            raise
        return  # directories cannot be opened on some platforms
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def order_metadata(frame: pl.DataFrame) -> dict[str, str]:
    """`{ORDER_KEY: ...}` when `frame`'s rows are in HISTORY_ORDER, else no entry."""
    if not frame.height:
        return {ORDER_KEY: json.dumps({"first": None, "last": None})}
    sample, signal = frame["sample_id"], frame["signal"]
    step = sample.diff()
    if sample.null_count() or signal.null_count() or (step < 0).any():
        return {}
    if ((step == 0) & (signal < signal.shift(1))).any():
        return {}
    first, last = [frame.row(i, named=True) for i in (0, -1)]
    return {
        ORDER_KEY: json.dumps(
            {
                "first": [first["sample_id"], first["signal"]],
                "last": [last["sample_id"], last["signal"]],
            }
        )
    }


def read_order(path: Path) -> tuple[tuple[int, str] | None, tuple[int, str] | None] | None:
    """(first, last) HISTORY_ORDER key of a file whose metadata says it is in that order, else
    None; (None, None) for a file without rows."""
    entry = pl.read_parquet_metadata(path).get(ORDER_KEY)
    if entry is None:
        return None
    try:
        order = json.loads(entry)
        first, last = order["first"], order["last"]
        if first is None or last is None:
            return None, None
        return (int(first[0]), str(first[1])), (int(last[0]), str(last[1]))
    except (ValueError, TypeError, KeyError, IndexError):
        return None


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Make `path` appear complete or not at all: `write(tmp)`, fsync, `os.replace`, fsync dir.

    The one way the library puts a file in place (parts, history.parquet, result.json,
    index.md, the state file). `write` fills a temporary file in the same directory (its name
    ends in `TMP_SUFFIX`, so `finalize` may delete it after a crash); on any exception the
    temporary is removed and the exception propagates.

    The fsync policy is one for every file: the temporary's data is synced before the rename,
    and the directory after it (best effort where a directory cannot be opened). A process
    crash alone never needs it (the rename is atomic in the page cache), but a machine crash
    does: without the first sync a power loss can leave a complete-looking name with no data,
    and without the second the rename can be lost while later deletions survive (the merge
    deletes parts once history.parquet is in place; `finalize` trusts every final name). The
    cost is two fsyncs per file, and files are few: a part per `buffer_rows` rows or per half
    flush interval, plus a handful at removal.

    Args:
        path: the final path.
        write: writes the complete content to the path it is given.
    """
    tmp = temporary_path(path)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(path.parent)
    if tmp.parent != path.parent:
        fsync_path(tmp.parent)  # the temporary's name left that directory


def write_parquet_atomic(
    frame: pl.DataFrame, path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write `frame` (with Parquet key-value `metadata`) to `path` with `replace_atomically`."""
    replace_atomically(path, lambda tmp: frame.write_parquet(tmp, metadata=metadata or None))


def write_text_atomic(path: Path, text: str) -> None:
    """Write UTF-8 `text` (with `\\n` line ends) to `path` with `replace_atomically`."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)

    replace_atomically(path, write)
