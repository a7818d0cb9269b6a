"""Who rewrites the parent page of rank runs, and when, without a rank waiting on the others.

Design decision: every rank rewrites the parent's index.md at the end of its own finish
(`rundir.page_ranks`), reading every rank's state. Taking the parent's lock in turn made that
quadratic: on a job of N ranks finishing together, the last rank's `remove_observer` waited for
N renders of N states each (about 2 s a render at 1,024 small ranks, 0.1 s a rank for a
3,000-layer model's state file: tens of minutes). Instead a rank asks for a rewrite and returns:

- It writes a fresh token into `PARENT/.index.again` (after its own final state is written),
  then tries the lock on `PARENT/.index.lock` without blocking. Held: the holder renders again
  for it, and this rank returns at once.
- The holder reads the token, renders and writes the page, releases the lock, and reads the
  token again. Changed: a rank asked after the render began, so it takes the lock again
  (without blocking) and renders again; if another process took it first, that one read the
  token after the ask, so its render includes the asking rank.

So the page written last has seen the final state of every rank that finished before it, no
rank waits on another's render, and a holder renders once per wave of finishes, reading again
only the states that changed (`page_ranks.StateCache`). No clock is compared (ranks on several
hosts share the directory), only tokens. `finalize PARENT` waits for the lock instead, so the
page it names is written when it returns. Where `fcntl` is missing (Windows), every rewrite
renders, unlocked: the last writer's page may be a little old.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from torchinstruments.rundir.layout import INDEX_FILE, write_text_atomic
from torchinstruments.rundir.page_ranks import StateCache, render_parent_index

__all__ = ["PARENT_AGAIN", "PARENT_LOCK", "write_parent_index"]

PARENT_LOCK = ".index.lock"
PARENT_AGAIN = ".index.again"


def write_parent_index(parent: Path, *, wait: bool = False) -> Path:
    """Have the parent's index.md rewritten from every rank's state (see the module): by this
    process, or, when another holds the parent's lock and `wait` is false, by that one."""
    parent = Path(parent)
    path = parent / INDEX_FILE
    fcntl = _fcntl()
    if fcntl is None:
        write_text_atomic(path, render_parent_index(parent))
        return path
    _ask(parent)
    cache = StateCache()
    while True:
        with _locked(parent, fcntl, wait) as taken:
            if not taken:
                return path  # its holder reads the token after its render, and renders again
            asked = _token(parent)
            write_text_atomic(path, render_parent_index(parent, cache))
        again = _token(parent)
        if again is None or again == asked:
            return path
        wait = False  # asked again during the render: once more, unless another took it


def _ask(parent: Path) -> None:
    """A fresh token in `PARENT_AGAIN`: a render that begins after this sees the asking rank.
    Its temporary is named by the token: ranks ask at once."""
    token = secrets.token_hex(8)
    write_text_atomic(parent / PARENT_AGAIN, token, tag=token)


def _token(parent: Path) -> str | None:
    """The latest token; None if unreadable (an I/O error): no more rounds are told apart."""
    try:
        return (parent / PARENT_AGAIN).read_text(encoding="utf-8")
    except OSError:
        return None


@contextlib.contextmanager
def _locked(parent: Path, fcntl: ModuleType, wait: bool) -> Iterator[bool]:
    """The parent's lock, held inside the block; False (not held) if another process holds it
    and `wait` is false."""
    with open(parent / PARENT_LOCK, "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _fcntl() -> ModuleType | None:
    try:
        import fcntl
    except ImportError:
        return None
    return fcntl
