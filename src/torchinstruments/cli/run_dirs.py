"""Finding run directories on disk for the readers: a parent's `rank-NNN/` children, and the runs
below a directory that holds none itself (what a user who passed a parent of runs meant).

Design decision: these only look around, to name what the user may have meant; a directory that
cannot be listed or examined (no permission, removed meanwhile, a `/proc` entry) is passed over,
so a command given `/`, a home or a shared folder says what it found instead of ending in a
traceback.
"""

from __future__ import annotations

import re
from pathlib import Path

from torchinstruments.rundir.layout import HISTORY_FILE, PARTS_DIR, STATE_FILE

RANK_DIR = re.compile(r"^rank-(\d+)$")
# What marks a run directory: any one of these files.
_RUN_FILES = (HISTORY_FILE, PARTS_DIR, STATE_FILE)


def _is_dir(path: Path) -> bool:
    """`path.is_dir()`, False where the OS refuses to say (no permission)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _children(directory: Path) -> list[Path]:
    """The entries of `directory`, sorted; none when it cannot be listed."""
    try:
        return sorted(directory.iterdir())
    except OSError:
        return []


def _holds_run(directory: Path) -> bool:
    """Whether `directory` holds a run's state file, history or parts."""
    try:
        return any((directory / name).exists() for name in _RUN_FILES)
    except OSError:
        return False


def rank_directories(directory: Path) -> list[Path]:
    """`rank-NNN/` subdirectories of `directory` (a `rank_policy="all"` run), sorted."""
    if not _is_dir(directory):
        return []
    return [p for p in _children(directory) if RANK_DIR.match(p.name) and _is_dir(p)]


def runs_below(directory: Path, depth: int = 3) -> list[Path]:
    """Run directories (holding a state file, history or parts) up to `depth` levels below
    `directory`, sorted (symbolic links not followed, unreadable directories passed over)."""
    found: list[Path] = []
    level = [directory]
    for _ in range(depth):
        level = sorted(c for d in level for c in _children(d) if _is_dir(c) and not c.is_symlink())
        found += [child for child in level if _holds_run(child)]
        level = [c for c in level if c not in found]
    return sorted(found)


__all__ = ["RANK_DIR", "rank_directories", "runs_below"]
