"""How index.md's ready queries read a run's history files: the one text both pages print.

Design decision: a run's page (`page_queries`) and a parent of rank runs' page (`page_ranks`)
read a run's history with the same functions, printed from here, so a rank read through the
parent's page gets exactly the rows its own page reads: history.parquet once finished; while
live or after a crash, its completed parts; while a continued run's attempt runs (or after it
was killed), history.parquet for the earlier attempts and the parts for this one (`attempt`
tells them apart); parts history.parquet already holds (its metadata lists them) never twice;
a part `finalize` left in place left out, and named as the block runs (never silently). Before
a run's first part, `history_of` raises `NoPartYet`, a SystemExit (the run's own page stops
saying so), which the parent's page catches to name that rank as left out rather than read it
as no rows.
"""

from __future__ import annotations

from torchinstruments.rundir.layout import HISTORY_FILE, PARTS_DIR
from torchinstruments.rundir.merge import MERGED_PARTS_KEY
from torchinstruments.rundir.page_sections import quoted as _q

__all__ = ["history_functions"]


def history_functions() -> str:
    """The text of `NoPartYet`, `history_of`, `merged_parts` and `readable` (module docstring),
    for a setup block that has imported `Path` and `polars as pl`."""
    return f'''class NoPartYet(SystemExit):
    """A run that has not written its first part yet: nothing to read, for now."""


def history_of(directory: Path) -> pl.LazyFrame:
    """A run's history: {HISTORY_FILE} once finished; while live (or after a crash), every
    completed part, read now (removal takes the parts away once {HISTORY_FILE} holds them). A
    continued run's attempt has both while it runs: {HISTORY_FILE} holds the earlier attempts,
    the parts its own rows (its removal merges them in; `attempt` tells them apart here)."""
    merged = directory / {_q(HISTORY_FILE)}
    for _ in range(5):
        files = sorted((directory / {_q(PARTS_DIR)}).glob("part-*.parquet"))
        held = merged_parts(merged)  # read after the listing: removal deletes them after it
        files = [f for f in files if not (f.stem[5:].isdigit() and int(f.stem[5:]) in held)]
        if not files and merged.exists():
            return pl.scan_parquet(merged, glob=False)
        if not files:
            raise NoPartYet(
                f"{{directory}}: no part written yet (the run's first sample writes the first "
                "part right after it is taken); run this block again later"
            )
        try:
            parts = readable(files, merged)
        except FileNotFoundError:  # removal merged them into {HISTORY_FILE} meanwhile
            continue
        if not merged.exists():
            return pl.concat(parts).lazy()
        live = pl.concat(parts) if parts else None
        if live is None or live["attempt"].min() is None:  # damaged parts, or from before attempts
            return pl.scan_parquet(merged, glob=False)
        first = live["attempt"].min()
        earlier = pl.scan_parquet(merged, glob=False).filter(
            pl.col("attempt").is_null() | (pl.col("attempt") < first)  # null: before attempts
        )
        return pl.concat([earlier, live.lazy()])
    raise SystemExit(f"{{directory}}: its history kept moving; run this block again")


def merged_parts(merged: Path) -> set[int]:
    """The part numbers {HISTORY_FILE} holds (its metadata lists them, e.g. "0-41,43"): while
    removal deletes those parts, the ones still there are not read twice."""
    if not merged.exists():
        return set()
    said = pl.read_parquet_metadata(merged).get({_q(MERGED_PARTS_KEY)}, "")
    numbers = set()
    for span in filter(None, said.split(",")):
        first, _, last = span.partition("-")
        numbers.update(range(int(first), int(last or first) + 1))
    return numbers


def readable(files: list[Path], merged: Path) -> list[pl.DataFrame]:
    """The parts' rows, leaving out, and naming, a part `finalize` left in place (index.md
    names it too): damaged, or of another version (columns other than {HISTORY_FILE}'s)."""
    columns = list(pl.read_parquet_schema(merged)) if merged.exists() else None
    frames = []
    for file in files:
        try:
            frame = pl.read_parquet(file, glob=False)
        except pl.exceptions.PolarsError as error:
            print(f"left out: {{file}}: unreadable ({{type(error).__name__}}); its rows are not read")
            continue
        if columns is None or frame.columns == columns:
            frames.append(frame)
        else:
            print(f"left out: {{file}}: not {HISTORY_FILE}'s columns; its rows are not read")
    return frames'''
