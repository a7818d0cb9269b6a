"""The history parts a finished run left beside its history.parquet because no reader can use them.

Design decision: a merge (removal or `finalize`) leaves in place a part Parquet cannot read (cut
short by a copy or a crash of the machine) or whose columns are not history's (a newer
version's), and says so in that run's own state. Readers of a parent of rank runs (its index.md,
`show PARENT`, `finalize PARENT`) name those parts per rank from the files themselves: a part is
left out exactly when it is still there, whatever the state file says. Only parts beside
history.parquet are checked (rare; a footer read each), never a live run's every part.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    PARTS_DIR,
    list_parts,
    part_number,
    schema_difference,
)
from torchinstruments.rundir.merge import merged_part_numbers

__all__ = ["left_out_parts", "left_out_said", "part_unreadable", "parts_beside"]


def part_unreadable(path: Path) -> bool:
    """Whether Parquet cannot read `path`'s footer, or its columns are not history's (a part of
    a newer version `finalize` left in place); a part gone meanwhile (merged) is not."""
    try:
        schema = pl.read_parquet_schema(path)
    except FileNotFoundError:
        return False
    except (OSError, pl.exceptions.PolarsError):
        return True
    return schema_difference(pl.Schema(schema)) is not None


def parts_beside(directory: Path, history: Path) -> list[Path]:
    """The parts in `directory` that its `history` (history.parquet) does not hold.

    Raises:
        OSError, polars.exceptions.PolarsError: `history`'s metadata cannot be read.
    """
    merged = merged_part_numbers(history)
    return [p for p in list_parts(Path(directory)) if part_number(p) not in merged]


def left_out_parts(directory: Path) -> tuple[Path, ...]:
    """The parts beside `directory`'s history.parquet that it does not hold and no reader can
    read: their rows are in no history, count or query. Empty without a history.parquet (a live
    or killed run's parts are its history) or when history.parquet itself cannot be read."""
    history = Path(directory) / HISTORY_FILE
    if not history.is_file():
        return ()
    try:
        beside = parts_beside(directory, history)
    except (OSError, pl.exceptions.PolarsError):
        return ()
    return tuple(p for p in beside if part_unreadable(p))


def left_out_said(parts: tuple[Path, ...], counts_recovered: bool | None) -> str:
    """What every reader of a parent says of a rank's `left_out_parts`, after "rank N: ": the
    files, and that their rows are in no history or reader and, where the rank's counts were
    rebuilt after a kill (`counts_recovered`), perhaps in none of its counts (partial)."""
    several = len(parts) > 1
    names = ", ".join(f"{PARTS_DIR}/{p.name}" for p in parts)
    if counts_recovered:
        counts = "its counts, rebuilt after its process died, are lower bounds that may leave them out (partial)"
    elif counts_recovered is None:
        counts = "its counts are unknown"
    else:
        counts = "its counts, its live run's, include those samples"
    return (
        f"{len(parts)} history part{'s' * several} left out, unreadable (cut short, or of "
        f"another version), left in place: {names}; {'their' if several else 'its'} rows are in "
        f"neither its {HISTORY_FILE} nor any query or command; {counts}"
    )
