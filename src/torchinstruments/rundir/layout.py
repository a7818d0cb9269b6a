"""The run directory's rules: its file names, the history schema, literal paths, atomic writes.

Design decision: a run directory is fixed once, at injection: `output_dir.resolve_output_dir` expands `~` and
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import polars as pl

__all__ = [
    "CONSTANT_KEY",
    "HISTORY_COMPRESSION",
    "HISTORY_COMPRESSION_LEVEL",
    "HISTORY_FILE",
    "HISTORY_ORDER",
    "HISTORY_PAGE_BYTES",
    "HISTORY_ROW_GROUP_ROWS",
    "HISTORY_SCHEMA",
    "INDEX_FILE",
    "LATER_COLUMNS",
    "LOCK_FILE",
    "MERGE_TMP_DIR",
    "ORDER_KEY",
    "PARTS_DIR",
    "PARTS_GONE_DIR",
    "RECORDED_SCHEMA",
    "RESULT_FILE",
    "RUN_MARKERS",
    "STATE_FILE",
    "TENSORBOARD_DIR",
    "TMP_SUFFIX",
    "constant_literals",
    "constant_metadata",
    "empty_history",
    "fsync_path",
    "is_library_temporary",
    "list_parts",
    "order_metadata",
    "order_of",
    "part_number",
    "part_path",
    "part_tag",
    "part_temporary_path",
    "replace_atomically",
    "scan_history",
    "schema_difference",
    "shared_constants",
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
# Where the merge moves history.parts/ in one rename once history.parquet holds its parts, before
# deleting it: a live reader of history.parts/ sees every part or none (rundir.merge).
PARTS_GONE_DIR = "history.parts.merged.torchinstruments-tmp"
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
# The columns later versions added, each nullable with a meaning in rows that lack it: `attempt`
# null in rows of versions before it, `population` null for this rank's own tensor (all that
# versions before it measured). A part or history.parquet of such a version is read with them
# null (`scan_history`), so `finalize` or a continued run merges a directory it wrote whole.
LATER_COLUMNS = ("population", "attempt")

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
# A part's Parquet metadata entry: JSON `{column: value}` for the columns whose every row holds
# the same value (null: every row null), so the merge streams them as literals instead of reading
# them (`rundir.merge`). Only types whose equality is identity: integers (not `timestamp`),
# strings, booleans, lists of integers, and any column that is all null; never `value` (0.0 and
# -0.0 compare equal). Absent in parts without such columns, or of a version before it.
CONSTANT_KEY = "torchinstruments.constant"

_PART_RE = re.compile(r"^part-(\d+)\.parquet$")


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
    """A lazy scan of history files, taken literally (never as glob patterns); the columns a
    file of an earlier version lacks (`LATER_COLUMNS`, see `schema_difference`) read as null."""
    return pl.scan_parquet(paths, schema=HISTORY_SCHEMA, glob=False, missing_columns="insert")


def schema_difference(schema: pl.Schema) -> str | None:
    """None when a file of `schema` reads as history: the history schema, or an earlier
    version's (without some of `LATER_COLUMNS`); else what differs, column by column."""
    said = []
    extra = [name for name in schema if name not in HISTORY_SCHEMA]
    if extra:
        said.append(
            f"columns this version does not know (a newer torchinstruments wrote it?): {extra}"
        )
    missing = [n for n in HISTORY_SCHEMA if n not in schema and n not in LATER_COLUMNS]
    if missing:
        said.append(f"columns missing: {missing}")
    said += [
        f"{name} is {dtype}, not {HISTORY_SCHEMA[name]}"
        for name, dtype in schema.items()
        if name in HISTORY_SCHEMA and dtype != HISTORY_SCHEMA[name]
    ]
    return "; ".join(said) or None


# history.parquet's Parquet layout (`sink_history`). Polars (2.1) compresses each page on its own
# and picks the encodings itself (no option chooses one: `value` (Float64) is always PLAIN, the
# integer columns and strings dictionary-encoded per row group; no delta or byte-stream-split
# encoding). A sample repeats most of the previous one's values (counts, zero fractions, layers
# that no longer change), and the codec finds those repeats only inside one page, so a row group
# whose every column is one page (HISTORY_PAGE_BYTES holds a row group of up to 102 bytes a row)
# pays for a new value once per row group. `timestamp` (one per tensor, shared by its metrics)
# is a dictionary of the group's distinct times plus one run per tensor whose key counts up.
# HISTORY_ROW_GROUP_ROWS is over 9 * 2**16: a group of the default profile's rows then holds
# more than 2**16 tensors, whose keys take 3 bytes instead of 2, and brotli compresses those runs
# to about 1.1 bytes a tensor against 1.8 (measured; zstd does worse with wider keys).
# Measured on bench/removal.py's `chain` (1 M rows, 18k series), bytes per row: Polars' defaults
# 1.49; zstd, 2**17-row groups, 4 MiB pages 1.26; zstd, 2**18 rows, 16 MiB pages 1.08; brotli
# level 5, 2**18 rows 0.98 (value 0.62, timestamp 0.33); 2**19 rows 0.89 (0.54, 0.33); 655,360
# rows, what is written now, 0.85 (0.54, 0.28); its `deep` case (60 steps, 3.2 M rows): 1.53,
# 1.12, 1.02, 0.82, 0.68. Brotli levels 6 to 9 save under 2% more, level 10 about 10% for six
# times the CPU (4.3 s for the chain's merge against 0.8). Larger groups cost memory: the merge
# holds a row group while it encodes it (alone, reading every column: +190 MiB at 2**18, +275 at
# 2**19, +270..290 at 655,360), which the merge's literals for constant columns bring back to
# +170..190 (`rundir.merge`); readers decode a whole group whichever of its rows they read.
# Reordering the rows inside a sample (by series, by metric) moves the file by at most 6% with
# zstd and by nothing with brotli. docs/benchmarks.md has the figures.
HISTORY_ROW_GROUP_ROWS = 5 * 2**17
HISTORY_PAGE_BYTES = 2**26
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


def temporary_path(path: Path, tag: str = "") -> Path:
    """Where `path` is written before it is renamed into place: next to it, except a part's.

    A part's temporary is in the run directory, not in `history.parts/`: a live reader of that
    directory (`pl.read_parquet(run / "history.parts")`, which refuses a directory holding files
    of different extensions, or a glob that lists a name the rename just removed) then only ever
    sees completed parts. The same file system, so the rename stays atomic; the name ends in
    `TMP_SUFFIX`, so `finalize` deletes it after a crash. `tag` (when given) names the writer,
    so that two writers of one path never share a temporary (`part_temporary_path`).
    """
    name = f"{path.name}.{tag}" if tag else path.name
    if path.parent.name == PARTS_DIR and part_number(path) is not None:
        return path.parent.parent / f"{PARTS_DIR}-{name}{TMP_SUFFIX}"
    return path.with_name(name + TMP_SUFFIX)


def part_tag(attempt: int) -> str:
    """The temporary-name tag of the parts attempt `attempt` writes (`part_temporary_path`)."""
    return f"attempt-{attempt}"


def part_temporary_path(path: Path, attempt: int) -> Path:
    """Where attempt `attempt` writes part `path` before renaming it into place.

    One name per attempt, not per part: a part write that never returned (a stalled network
    file system) outlives its attempt once removal gave it up, and a run resumed in the same
    process right after may write a part of the same number. Were the name shared, the old
    write, when it returned, would open (truncating) and then delete the new one's temporary,
    or have its own bytes renamed into place by it.
    """
    return temporary_path(path, part_tag(attempt))


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


def order_of(
    metadata: dict[str, str],
) -> tuple[tuple[int, str] | None, tuple[int, str] | None] | None:
    """(first, last) HISTORY_ORDER key of a file whose Parquet key-value `metadata` says it is
    in that order, else None; (None, None) for a file without rows."""
    entry = metadata.get(ORDER_KEY)
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


def _constant_type(dtype: pl.DataType) -> bool:
    """Whether a column of `dtype` may be a constant of CONSTANT_KEY when it has no nulls."""
    if isinstance(dtype, pl.List):
        return dtype.inner in (pl.Int32(), pl.Int64())
    return dtype in (pl.Int32(), pl.Int64(), pl.String(), pl.Boolean())


def _holds_one_value(series: pl.Series) -> bool:
    """Whether a column of a `_constant_type` without nulls holds one value, by the cheapest test
    of its type: every part is checked on the training thread, where `n_unique` of each of its
    columns costs 1.5 ms for a part of 8,192 rows (0.4 of it the list `shape`'s), this 0.35."""
    if isinstance(series.dtype, pl.List):
        lengths = series.list.len()
        if lengths.min() != lengths.max():
            return False
        width = int(lengths[0])
        flat = series.explode().to_numpy()  # an inner null reads as NaN: never constant
        return width == 0 or bool((flat.reshape(-1, width) == flat[:width]).all())
    if series.dtype == pl.String():
        return bool((series == series[0]).all())
    return series.min() == series.max()


def constant_metadata(frame: pl.DataFrame) -> dict[str, str]:
    """`{CONSTANT_KEY: ...}` naming `frame`'s columns that hold one value in every row (or are
    all null); no entry when there are none or no rows."""
    constant: dict[str, object] = {}
    for series in frame.iter_columns() if frame.height else ():
        nulls = series.null_count()
        if nulls == frame.height:
            constant[series.name] = None
        elif not nulls and _constant_type(series.dtype) and _holds_one_value(series):
            value = series[0]
            constant[series.name] = value.to_list() if isinstance(value, pl.Series) else value
    return {CONSTANT_KEY: json.dumps(constant)} if constant else {}


def shared_constants(metadata: Sequence[dict[str, str]]) -> dict[str, object]:
    """The columns constant in every file whose Parquet metadata is in `metadata`, with the same
    value in all (CONSTANT_KEY): what is constant in those files concatenated. Empty when one of
    them has no such entry (a version before it, or no constant column)."""
    shared: dict[str, object] | None = None
    for entry in metadata:
        try:
            constant = json.loads(entry[CONSTANT_KEY])
        except (KeyError, ValueError):
            return {}
        if not isinstance(constant, dict):
            return {}
        if shared is None:
            shared = constant
        else:
            shared = {k: v for k, v in shared.items() if k in constant and constant[k] == v}
    return shared or {}


def constant_literals(constant: dict[str, object], schema: pl.Schema) -> dict[str, pl.Expr]:
    """Literals for `shared_constants`' columns, each of its column's type in `schema`; none when
    one is not a column of `schema` or not a value `constant_metadata` writes for its type."""
    literals = {}
    try:
        for name, value in constant.items():
            dtype = schema[name]
            if value is None:
                literal = pl.lit(None, dtype=dtype)
            elif not _constant_type(dtype):
                return {}
            else:  # a one-row Series, so a list is one value and the type is checked
                literal = pl.lit(pl.Series(name, [value], dtype=dtype, strict=True)).first()
            literals[name] = literal.alias(name)
    except (KeyError, TypeError, ValueError, pl.exceptions.PolarsError):
        return {}
    return literals


def replace_atomically(
    path: Path,
    write: Callable[[Path], None],
    rename: Callable[[Path, Path], None] = os.replace,
    tag: str = "",
) -> None:
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
        rename: puts the temporary in place (`os.replace`); the history writer's own refuses
            to once its run gave the write up (`rundir.writer`).
        tag: names the writer in the temporary's name (`temporary_path`).
    """
    tmp = temporary_path(path, tag)
    try:
        write(tmp)
        fsync_path(tmp)
        rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(path.parent)
    if tmp.parent != path.parent:
        fsync_path(tmp.parent)  # the temporary's name left that directory


def write_parquet_atomic(
    frame: pl.DataFrame,
    path: Path,
    metadata: dict[str, str] | None = None,
    rename: Callable[[Path, Path], None] = os.replace,
    tag: str = "",
) -> None:
    """Write `frame` (with Parquet key-value `metadata`) to `path` with `replace_atomically`."""
    replace_atomically(
        path, lambda tmp: frame.write_parquet(tmp, metadata=metadata or None), rename, tag
    )


def write_text_atomic(
    path: Path, text: str, rename: Callable[[Path, Path], None] = os.replace, tag: str = ""
) -> None:
    """Write UTF-8 `text` (with `\\n` line ends) to `path` with `replace_atomically`."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)

    replace_atomically(path, write, rename, tag)
