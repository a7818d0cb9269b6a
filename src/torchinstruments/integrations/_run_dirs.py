"""Which run directory a trainer fit writes: a fresh one, the last one, or a checkpoint's.

Design decision: a callback without `output_dir` writes under the trainer's own directory, which
is often reused (no logger version, `overwrite_output_dir`), so each fit takes the first free
`torchinstruments`, `torchinstruments-2`, ... there, and a fit resumed from a checkpoint continues
the last one holding a run (or the run the checkpoint names, when this process can continue it).
"Holds a run" is this rank's run under the rank policy, or one laid out for the other policy. Kept
apart from `_fit` (the fit's life: inject, notes, removal) because choosing a directory reads only
the disk, never the trainer or the model.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

from torchinstruments.distributed import place_rank
from torchinstruments.rundir.layout import RUN_MARKERS
from torchinstruments.rundir.output_dir import check_rank_layout
from torchinstruments.rundir.shell import literal_span

__all__ = ["RUN_NAME", "fresh_run_directory", "last_run_directory", "why_not_continued"]

RUN_NAME = "torchinstruments"


def _run_directories(parent: Path, rank_policy: str) -> Iterator[tuple[Path, bool]]:
    """`parent/torchinstruments`, `-2`, `-3`, ... in order, each with whether it holds a run
    (this rank's); endless, so a caller stops at the first free one."""
    for number in itertools.count(1):
        candidate = parent / (RUN_NAME if number == 1 else f"{RUN_NAME}-{number}")
        written = place_rank(candidate, rank_policy).directory
        yield candidate, _taken(candidate, written)


def _taken(candidate: Path, written: Path) -> bool:
    """Whether this rank's run directory `written` (in `candidate`) holds a run, or
    `candidate` holds one laid out for the other rank placement (`check_rank_layout`)."""
    if any((written / marker).exists() for marker in RUN_MARKERS):
        return True
    try:
        check_rank_layout(candidate, written)
    except FileExistsError:
        return True
    return False


def fresh_run_directory(parent: Path, rank_policy: str) -> Path:
    """`parent/torchinstruments`, or `-2`, `-3`, ... : the first whose run (this rank's) is free.

    A trainer's log directory is often reused (no logger version, `overwrite_output_dir`), and
    a run needs a directory of its own.
    """
    return next(
        candidate for candidate, taken in _run_directories(parent, rank_policy) if not taken
    )


def why_not_continued(run: Path, rank_policy: str) -> str | None:
    """Why this process cannot continue the run in `run` (None: it can): it holds no run (this
    rank's), or this process cannot write there; as index.md's notes say it (the directory a
    code span of its literal)."""
    written = place_rank(run, rank_policy).directory
    if not any((written / marker).exists() for marker in RUN_MARKERS):
        return f"{literal_span(str(written))} holds no run"
    if not os.access(written, os.W_OK | os.X_OK):
        return f"this process cannot write {literal_span(str(written))}"
    return None


def last_run_directory(parent: Path, rank_policy: str) -> Path:
    """The last `parent/torchinstruments[-N]` holding a run (this rank's), which a fit resumed
    from a checkpoint continues; `parent/torchinstruments` when none does."""
    found = parent / RUN_NAME
    for candidate, taken in _run_directories(parent, rank_policy):
        if not taken:
            break
        found = candidate
    return found
