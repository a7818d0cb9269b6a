"""Who rewrites the parent page of rank runs, and when, without a rank waiting on the others.

Design decision: every rank rewrites the parent's index.md at the end of its own finish, and at
the start of its run where the page is already written (a restart; `rundir.page_ranks`), reading
every rank's state. Taking the parent's lock in turn made that
quadratic: on a job of N ranks finishing together, the last rank's `remove_observer` waited for
N renders of N states each (about 2 s a render at 1,024 small ranks, 0.1 s a rank for a
3,000-layer model's state file: tens of minutes). Instead a rank asks for a rewrite and returns:

- It appends a fresh token to `PARENT/.index.again` (after its own final state is written),
  then tries the lock on `PARENT/.index.lock` without blocking. Held: the holder renders again
  for it, and this rank returns at once.
- The holder empties the token file, reads it, renders and writes the page, releases the
  lock, and reads the token file again. Changed: a rank asked after the render began, so it
  takes the lock again (without blocking) and renders again; if another process took it
  first, that one emptied and read the file after the ask, so its render includes the asking
  rank. Emptying it under the lock loses no ask: a token it erases was appended before the
  render that follows reads any state.
- A render whose write fails (a full disk for a moment) is made again when a rank asked
  meanwhile, as any render: that rank returned counting on it. The error is raised only when
  the last render failed too.

The ask is one append, never a temporary renamed into place: a rank killed while asking (ranks
are killed, and restarted into the same directory) leaves nothing behind, where a temporary named
by its token (several ranks ask at once) stayed in the parent for good. The holder deletes such
temporaries that earlier versions left (`remove_ask_leftovers`): no process writes one now, so
none is a live writer's; `finalize PARENT` deletes them first and says which.

So the page written last has seen the final state of every rank that finished before it, no
rank waits on another's render, and a holder renders once per wave of finishes, reading again
only the states that changed (`page_ranks.StateCache`). No clock is compared (ranks on several
hosts share the directory), only the tokens. What no token can save is a holder that dies with
the lock (killed, or its process ending while its removal gave the write up): the ranks that
asked it meanwhile returned, so the page can be older than their own; the page says so wherever
it shows a rank not finished, and `finalize PARENT` rewrites it. `finalize PARENT` waits for the
lock instead, so the page it names is written when it returns. Where `fcntl` is missing
(Windows), every rewrite renders, unlocked: the last writer's page may be a little old.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from torchinstruments.notices import warn
from torchinstruments.rundir.finishing import Finishing
from torchinstruments.rundir.layout import INDEX_FILE, is_library_temporary, write_text_atomic
from torchinstruments.rundir.page_ranks import StateCache, render_parent_index
from torchinstruments.rundir.shell import error_said, literal_if_unclear, tool_command

__all__ = [
    "PARENT_AGAIN",
    "PARENT_LOCK",
    "remove_ask_leftovers",
    "rewrite_parent_index",
    "rewrite_parent_soon",
    "write_parent_index",
]

PARENT_LOCK = ".index.lock"
PARENT_AGAIN = ".index.again"


def write_parent_index(parent: Path, *, wait: bool = False) -> Path:
    """Have the parent's index.md rewritten from every rank's state (see the module): by this
    process, or, when another holds the parent's lock and `wait` is false, by that one.

    Raises:
        OSError: the page could not be written (by the last render this process made).
    """
    parent = Path(parent)
    path = parent / INDEX_FILE
    fcntl = _fcntl()
    if fcntl is None:
        write_text_atomic(path, render_parent_index(parent))
        return path
    _ask(parent)
    cache = StateCache()
    failed: OSError | None = None
    while True:
        with _locked(parent, fcntl, wait) as taken:
            if not taken:
                return path  # its holder read the tokens after the ask, and renders again
            asked = _taken_asks(parent)
            try:
                write_text_atomic(path, render_parent_index(parent, cache))
                failed = None
            except OSError as error:  # made again below if a rank asked meanwhile
                failed = error
        again = _token(parent)
        if again is None or again == asked:
            if failed is not None:
                raise failed
            return path
        wait = False  # asked again during the render: once more, unless another took it


def rewrite_parent_index(parent: Path) -> None:
    """`write_parent_index` for a rank (at its finish, or its restart into its directory); a
    failure is warned, since this rank's own directory is complete without it."""
    try:
        write_parent_index(parent)
    except OSError as error:
        warn(
            f"torchinstruments: the index.md of {parent} (all ranks) could not be written "
            f"({error_said(error)}); "
            f"`{tool_command('finalize', parent)}` writes it again"
        )


def _ask(parent: Path) -> None:
    """A fresh token appended to `PARENT_AGAIN`: a render that begins after this sees the
    asking rank. One write of a few bytes, no temporary: nothing is left if the rank is killed."""
    token = f"{secrets.token_hex(8)}\n".encode("ascii")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(parent / PARENT_AGAIN, flags, 0o644)
    try:
        os.write(fd, token)
    finally:
        os.close(fd)


def _taken_asks(parent: Path) -> str | None:
    """Under the lock, before a render: the leftovers removed, the asks so far erased (the
    render that follows sees every rank that made them), and what the file holds then."""
    remove_ask_leftovers(parent)
    with contextlib.suppress(OSError):  # unwritable: the file only grows, compared as before
        os.truncate(parent / PARENT_AGAIN, 0)
    return _token(parent)


def remove_ask_leftovers(parent: Path) -> list[Path]:
    """Delete the ask temporaries earlier versions of the library renamed into `PARENT_AGAIN`,
    left by ranks killed between the write and the rename (no process writes one now); those
    deleted, for `finalize PARENT` to say (one it cannot delete is tried again at each render)."""
    prefix = f"{PARENT_AGAIN}."
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for path in sorted(parent.iterdir()):
            if path.name.startswith(prefix) and is_library_temporary(path):
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed.append(path)
    return removed


def _token(parent: Path) -> str | None:
    """The asks the file holds; None if unreadable (an I/O error): no more rounds are told apart."""
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


def rewrite_parent_soon(directory: Path, *, continued: bool, wait_s: float) -> Finishing[None]:
    """A rank's run opened where its parent already has a page (a job restarted into the
    directory, or a rank that attaches after another finished): the page is rewritten now, or
    until this rank finishes it would tell the job before this one (a rank "complete" that runs
    again). A first job's ranks write none at their start: no page is there to be wrong, and the
    first rank to finish writes it. A `continued` rank (resume=True) writes it even where there
    is none: the finalize of its killed attempt at this start leaves the page to this render
    (`rundir.resume`), so a restarted rank renders it once, not twice. The render reads every
    rank's state (no rank waits on another's render, one render per wave of asks), which on a
    job of thousands of ranks of a big model takes long: it runs on a thread of its own, waited
    for `wait_s` at most (as the run's first rows are), then left to end by itself, so inject is
    never refused for it nor holds the training step long; the rank's finish waits for it before
    its own (`sinks.directory.DirectorySink._page_rendered`). Returns the render's thread."""

    def work(step: Callable[[str], None]) -> None:
        if continued or (directory.parent / INDEX_FILE).is_file():
            rewrite_parent_index(directory.parent)

    page = Finishing(work, lambda: None, f"torchinstruments ranks' page {directory.parent}")
    try:
        page.wait(lambda step: wait_s)
    except Exception as error:  # a render that raised: this rank's own run is whole without it
        warn(
            "torchinstruments: the index.md of "
            f"{literal_if_unclear(str(directory.parent))} (all ranks) could not be "
            f"rewritten ({error_said(error)})"
        )
    return page
