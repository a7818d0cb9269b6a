"""Which directories a run may be written to: `output_dir` expanded and made absolute once, and
refused at inject, naming the argument, where the run could never be written (an empty or
non-UTF-8 name, one too deep for PATH_MAX, a folder name over NAME_MAX, one below a symbolic link to nothing, an existing
file), where it already holds a run, or where it is laid out for the other rank placement.

Design decision: every refusal happens before anything is written, so a refused inject leaves
the directory as it was; the checks read the directory's names only (this module, like
`layout`, never imports torch: `torchinstruments finalize` runs without it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    PARTS_DIR,
    RUN_MARKERS,
    STATE_FILE,
    TENSORBOARD_DIR,
)

__all__ = ["check_output_dir", "check_rank_layout", "expand_user", "resolve_output_dir"]


def expand_user(path: str | os.PathLike[str], name: str) -> Path:
    """`path` with a leading `~` or `~user` expanded (`Path.expanduser`).

    Raises:
        ValueError: naming `name`, the value and what to do, when `~user` names no user on
            this machine (or the home directory cannot be determined), instead of
            `Path.expanduser`'s bare `RuntimeError`.
    """
    try:
        return Path(path).expanduser()
    except RuntimeError:
        text = os.fspath(path)
        head = str(text).split("/", 1)[0]
        raise ValueError(
            f"{name}={str(text)!r} starts with {head!r}, but no home directory is known for it "
            f"(no user {head[1:]!r} on this machine{', or no HOME' if head == '~' else ''}); "
            f"for a folder of that name pass './{text}', for a home directory a user that "
            "exists"
        ) from None


def resolve_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """The run directory as an absolute path with `~` expanded, fixed for the life of the run.

    Raises:
        ValueError: if `output_dir` is empty, or starts with `~name` for a user that does
            not exist.
        FileExistsError: if it names an existing file (not a directory).
        FileNotFoundError: if it or a folder above it is a symbolic link to nothing, or it is
            relative and the current directory was deleted.
        ValueError: if it is too long for the run's files below it (PATH_MAX), one of its
            folder names is too long for its file system (NAME_MAX), it is not valid UTF-8, or
            it holds a NUL character.
        TypeError: if it is a path object whose `__fspath__` raises or gives no str.
        ValueError: if it is inside another run's history.parts/ or tensorboard/ folder.
    """
    text = _path_text(output_dir)
    if not text.strip():
        raise ValueError(
            f"output_dir must name a directory, got {output_dir!r}; pass e.g. output_dir='stats'"
        )
    if "\x00" in text:  # `Path.exists` raised a bare "embedded null byte", naming nothing
        raise ValueError(
            f"output_dir={text!r} holds a NUL character (\\x00), which no file system path can "
            "hold; pass a directory path without it"
        )
    path = _absolute(expand_user(text, "output_dir"))
    _check_utf8(path)
    _check_length(path)  # first: a path over PATH_MAX makes `exists` itself raise
    _check_names(path)  # so does a folder name over NAME_MAX
    if path.exists() and not path.is_dir():
        raise FileExistsError(
            f"output_dir={str(path)!r} is an existing file, not a directory; pass a directory path"
        )
    _check_links(path)
    _check_not_in_run_folder(path)
    return path


def _check_not_in_run_folder(path: Path) -> None:
    """Refuse a run directory inside another run's `history.parts/` or `tensorboard/` folder:
    its files mixed with that run's (a live reader of the parts read the nested run's parts
    as its own, TensorBoard showed its events as the other run's), and the other run's
    removal, which takes its parts folder away, left it there, with this run in it."""
    for folder in path.parents:
        if folder.name in (PARTS_DIR, TENSORBOARD_DIR) and any(
            (folder.parent / marker).exists() for marker in _OWN_RUN_MARKERS
        ):
            raise ValueError(
                f"output_dir={str(path)!r} is inside {str(folder)!r}, the {folder.name}/ folder "
                f"of the run in {str(folder.parent)!r}, whose files it would mix with: pass an "
                "output_dir outside that run's folders"
            )


def _absolute(path: Path) -> Path:
    """`path` made absolute, refused naming output_dir where a relative one cannot be: the
    current directory was deleted (a cleanup job removed the folder the process runs in), and
    `Path.absolute` raised a bare FileNotFoundError naming no path."""
    try:
        return path.absolute()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"output_dir={str(path)!r} is relative, and the current directory it is relative "
            "to no longer exists (deleted after the process entered it): pass an absolute "
            "output_dir, or os.chdir to a directory that exists"
        ) from None


def _path_text(output_dir: str | os.PathLike[str]) -> str:
    """`os.fspath(output_dir)` as a str, refused naming output_dir where it is not one: a path
    object whose `__fspath__` gives bytes, gives neither str nor bytes, or raises (its bare
    error named neither the argument nor the object)."""
    try:
        text = os.fspath(output_dir)
    except Exception as error:
        raise TypeError(
            f"output_dir={output_dir!r}: os.fspath() of it raised {type(error).__name__}: "
            f"{error}; pass a str or a pathlib.Path"
        ) from error
    if not isinstance(text, str):
        raise TypeError(
            f"output_dir={output_dir!r} gives a {type(text).__name__} path ({text!r}), not a "
            "str: the run names its directory in UTF-8 text; pass a str or a pathlib.Path "
            "(os.fsdecode(path) decodes bytes)"
        )
    return text


# Room the run's own names take below the run directory: a rank's folder, then a file in a
# folder (`rank-000/tensorboard/events.out.tfevents.<time>.<host>.<pid>.<n>`, the parts'
# temporaries), bounded by one folder and one name of at most NAME_MAX (255) bytes each.
_NAMES_BELOW_RUN_BYTES = 2 * (1 + 255)


def _check_utf8(path: Path) -> None:
    """Refuse a run directory whose name holds bytes that are not UTF-8 (Python gives them as
    lone surrogates): the run writes its directory into strict UTF-8 files (the state file,
    index.md), so inject would fail half-way with a bare UnicodeEncodeError."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError as error:
        shown = os.fsencode(str(path)[max(0, error.start - 20) : error.end + 20])
        raise ValueError(
            f"output_dir holds bytes that are not UTF-8 ({shown!r}, position {error.start}); "
            "the run names its directory in UTF-8 files (index.md, .state.json): pass a "
            "directory whose path is valid UTF-8 (a symbolic link of such a name works)"
        ) from None


def _check_links(path: Path) -> None:
    """Refuse a run directory below a symbolic link that points nowhere, which mkdir would
    refuse at inject with a bare 'File exists' naming neither the argument nor the link."""
    for folder in (path, *path.parents):
        if folder.is_symlink() and not folder.exists():
            raise FileNotFoundError(
                f"output_dir={str(path)!r}: {str(folder)!r} is a symbolic link to "
                f"{os.readlink(folder)!r}, which does not exist; create that folder or pass "
                "another output_dir"
            )


def _check_length(path: Path) -> None:
    """Refuse a run directory so deep that the run's file paths would exceed the system's
    PATH_MAX: inject would succeed and then every part write fail (all rows in the ledger)."""
    limit = os.pathconf(path.anchor, "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
    length = len(os.fsencode(path))
    if length + _NAMES_BELOW_RUN_BYTES >= limit:
        raise ValueError(
            f"output_dir is {length} bytes long: the run's files below it (up to "
            f"{_NAMES_BELOW_RUN_BYTES} bytes more) would exceed this system's PATH_MAX of "
            f"{limit} bytes and could not be written; pass a shorter output_dir (it begins "
            f"{str(path)[:80]!r})"
        )


def _check_names(path: Path) -> None:
    """Refuse a run directory with a folder name longer than its file system allows (NAME_MAX,
    255 bytes on most): `Path.exists` itself raised a bare `OSError: File name too long`,
    naming neither the argument nor the folder. Each name is checked against the limit of the
    deepest existing folder above it, before anything reads a path holding it."""
    folder, inside = Path(path.anchor), True
    limit = _name_max(folder)
    for name in path.parts[1:]:
        length = len(os.fsencode(name))
        if length > limit:
            raise ValueError(
                f"output_dir has a folder name of {length} bytes, over this file system's "
                f"NAME_MAX of {limit} bytes, so the run could not be created there; pass an "
                f"output_dir with shorter folder names (the long one begins {name[:40]!r})"
            )
        if inside and _is_dir(folder / name):
            folder = folder / name
            limit = _name_max(folder)
        else:
            inside = False


def _is_dir(path: Path) -> bool:
    """`path.is_dir()`, False where it cannot be read (a folder above without search
    permission): the checks after this one say what is wrong there."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _name_max(folder: Path) -> int:
    """The longest file name, in bytes, that `folder`'s file system allows (255 where it does
    not say)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    except (OSError, ValueError):
        return 255


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
            "inject_observer, or to the Lightning or Hugging Face callback (a killed run is "
            "completed first, then sample_id continues); to "
            "start a new run, pass a new output_dir (or move the old run away)."
        )


_RANK_RUN_DIR = re.compile(r"^rank-\d+$")
_OWN_RUN_MARKERS = (PARTS_DIR, HISTORY_FILE, STATE_FILE)  # a parent of ranks has none of these


def check_rank_layout(output_dir: Path, directory: Path) -> None:
    """Refuse to write `directory` (this rank's run) where `output_dir` holds a run laid out
    the other way.

    rank_policy="all" writes `output_dir/rank-NNN/` and a parent page at `output_dir/index.md`;
    otherwise (rank_policy="rank0", a process without a rank at inject) the run is `output_dir`
    itself. A job restarted with the other placement found neither a run to continue nor one
    to refuse: a rank-NNN/ run started afresh inside a single run and wrote the parent page
    over that run's index.md; the other way, the refusal spoke of a run without history.

    Raises:
        FileExistsError: naming rank_policy, resume and a new output_dir as the ways on.
    """
    if directory != output_dir:
        found = [name for name in _OWN_RUN_MARKERS if (output_dir / name).exists()]
        if found:
            raise FileExistsError(
                f"output_dir={str(output_dir)!r} holds one process's run ({', '.join(found)}: "
                "written with rank_policy='rank0', or by a process that had no rank at "
                f"inject), so rank_policy='all' cannot put {directory.name}/ in it (its "
                "index.md would overwrite that run's). To continue that run (resume=True), "
                "inject with the rank_policy it was written with; to start a new run, pass a "
                "new output_dir."
            )
        return
    ranks = sorted(
        path.name
        for path in (output_dir.iterdir() if output_dir.is_dir() else ())
        if _RANK_RUN_DIR.match(path.name) and path.is_dir()
    )
    if ranks:
        shown = ", ".join(f"{name}/" for name in ranks[:3]) + (", ..." if len(ranks) > 3 else "")
        raise FileExistsError(
            f"output_dir={str(output_dir)!r} holds a multi-rank run ({shown}: written with "
            "rank_policy='all'), and this process would write output_dir itself "
            "(rank_policy='rank0', or no rank known at inject: neither an initialized process "
            "group nor torchrun's RANK and WORLD_SIZE). To continue it (resume=True), inject "
            "with rank_policy='all' on every rank, after init_process_group or under torchrun; "
            "to start a new run, pass a new output_dir."
        )
