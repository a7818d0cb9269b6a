"""Run-directory safety: the run lock, the output-directory check, and crash recovery.

Design decision: a live run holds an exclusive `fcntl.flock` on `<dir>/.lock` for its whole life.
The kernel drops the lock when the process dies, even on SIGKILL, so "lock free" means exactly
"no live writer": no PID files, no staleness heuristics. The cost: it relies on POSIX advisory
locks (Linux, macOS; not Windows, and unreliable on some network file systems), and the `.lock`
file stays in the directory (deleting a lock file races with a process that just opened it).

`finalize` turns an interrupted directory into a complete one with the same code the live run
uses at removal: merge the completed parts (unreadable ones are left in place and reported),
then result.json and index.md from history.parquet and the RunInfo embedded in index.md. Counts
after a crash are lower bounds read from history: root_forwards = max forward_index + 1,
samples = distinct sample_ids, backward_samples = distinct sample_ids with an output_gradient.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import polars as pl

from torchinstruments.history import (
    HISTORY_FILE,
    HISTORY_SCHEMA,
    MERGE_TMP_DIR,
    PARTS_DIR,
    TMP_SUFFIX,
    HistoryConfig,
    merge_history,
)
from torchinstruments.index_page import (
    INDEX_FILE,
    index_is_complete,
    read_run_info,
    write_index,
)
from torchinstruments.records import OUTPUT_GRADIENT, LayerInfo, RunCounts, RunInfo
from torchinstruments.summary import RESULT_FILE, write_result

LOCK_FILE = ".lock"
RUN_MARKERS = (PARTS_DIR, HISTORY_FILE, RESULT_FILE, INDEX_FILE)


class RunLockedError(RuntimeError):
    """The run directory is locked by a live process."""


class RunLock:
    """An exclusive, non-blocking `flock` on `directory/.lock`, held for the life of a run.

    Args:
        directory: the run's output directory (created by `acquire` if missing).

    Example:
        >>> lock = RunLock(Path("stats"))
        >>> lock.acquire()  # doctest: +SKIP
        >>> lock.release()  # doctest: +SKIP
    """

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock; idempotent for the holder.

        Raises:
            RunLockedError: if another open file description (another process) holds it.
        """
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"{self.path.parent} is in use by a live process{holder}: a run is still "
                "writing there. Wait for it to end (remove_observer) or stop it first."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (no-op if not held)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """` (pid N)` from the lock file, or "" if unknown."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().strip())
        return f" (pid {pid})"
    return ""


def check_output_dir(path: Path) -> None:
    """Refuse an output directory that already holds a run.

    Args:
        path: the intended output directory (it may not exist yet).

    Raises:
        FileExistsError: if it contains history.parts/, history.parquet, result.json or index.md.
    """
    path = Path(path)
    found = [name for name in RUN_MARKERS if (path / name).exists()]
    if found:
        raise FileExistsError(
            f"output_dir={str(path)!r} already holds a run ({', '.join(found)}). Pass a new "
            "output_dir, or move or delete the old run; if that run was interrupted, "
            f"`python -m torchinstruments finalize {path}` completes it first."
        )


@dataclass(frozen=True)
class FinalizeReport:
    """What `finalize` did."""

    directory: Path
    history: Path
    rows: int
    merged_parts: int
    unreadable_parts: tuple[tuple[Path, str], ...]
    removed_temporaries: tuple[Path, ...]
    counts: RunCounts
    run_info_recovered: bool


def _remove_temporaries(directory: Path) -> list[Path]:
    """Delete leftovers of interrupted atomic writes (safe: the caller holds the lock)."""
    removed = []
    candidates = list(directory.glob(f"*{TMP_SUFFIX}"))
    if (directory / PARTS_DIR).is_dir():
        candidates += list((directory / PARTS_DIR).glob(f"*{TMP_SUFFIX}"))
    for p in candidates:
        if p.is_file():
            p.unlink()
            removed.append(p)
    if (directory / MERGE_TMP_DIR).is_dir():
        shutil.rmtree(directory / MERGE_TMP_DIR)
        removed.append(directory / MERGE_TMP_DIR)
    return removed


def recovered_counts(history: Path) -> RunCounts:
    """Lower-bound counts read from a history.parquet (see the module docstring)."""
    lf = pl.scan_parquet(history, schema=HISTORY_SCHEMA)
    row = lf.select(
        root_forwards=(pl.col("forward_index").max() + 1).fill_null(0),
        samples=pl.col("sample_id").n_unique(),
        backward_samples=pl.col("sample_id").filter(pl.col("signal") == OUTPUT_GRADIENT).n_unique(),
    ).collect(engine="streaming")
    return RunCounts(*(int(row[name].item()) for name in row.columns))


def _fallback_run_info(directory: Path, history: Path) -> RunInfo:
    """A RunInfo rebuilt from history alone when index.md is missing or unreadable."""
    layers = (
        pl.scan_parquet(history, schema=HISTORY_SCHEMA)
        .group_by("layer")
        .agg(pl.col("module_type").last())
        .sort("layer")
        .collect(engine="streaming")
    )
    default = HistoryConfig()
    return RunInfo(
        output_dir=directory,
        library_version="unknown",
        torch_version="unknown",
        model_class="unknown",
        layers=tuple(LayerInfo(r["layer"], r["module_type"]) for r in layers.iter_rows(named=True)),
        focus_layers=(),
        sampler="unknown (index.md was missing; layers rebuilt from history)",
        metrics=(),
        rank=None,
        world_size=None,
        rank_policy="unknown",
        capture_direct_forwards=False,
        buffer_rows=default.buffer_rows,
        window=default.window,
        started_at="unknown",
    )


def finalize(directory: Path) -> FinalizeReport:
    """Complete an interrupted run directory: merge parts, write result.json and index.md.

    A directory that needs nothing (no parts, index.md already complete) only gets result.json
    recomputed; its index.md, with the exact counts of the live run, is kept.
    Safe to run again: parts already in history.parquet are not merged twice, unreadable parts
    stay in place (and are reported with a `RuntimeWarning`).

    Args:
        directory: the run's output directory.

    Returns:
        A `FinalizeReport` (the documented contract is only that it completes the directory).

    Raises:
        FileNotFoundError: if `directory` holds no run (no history.parts/ nor history.parquet).
        RunLockedError: if a live process holds the run lock.
    """
    directory = Path(directory)
    if not (directory / PARTS_DIR).is_dir() and not (directory / HISTORY_FILE).exists():
        raise FileNotFoundError(
            f"{directory} holds no run: neither {PARTS_DIR}/ nor {HISTORY_FILE} exists"
        )
    with RunLock(directory):
        removed = _remove_temporaries(directory)
        merged = merge_history(directory)
        try:
            run = read_run_info(directory)
            run_recovered = False
        except (OSError, ValueError):
            run = _fallback_run_info(directory, merged.path)
            run_recovered = True
        counts = recovered_counts(merged.path)
        write_result(directory, run.layers, run.window)
        if run_recovered or merged.merged_parts or not index_is_complete(directory):
            write_index(directory, run, counts, recovered=True)
    for path, reason in merged.unreadable_parts:
        warnings.warn(
            f"torchinstruments finalize: part {path} is unreadable and was left in place: {reason}",
            RuntimeWarning,
            stacklevel=2,
        )
    return FinalizeReport(
        directory=directory,
        history=merged.path,
        rows=merged.rows,
        merged_parts=len(merged.merged_parts),
        unreadable_parts=merged.unreadable_parts,
        removed_temporaries=tuple(removed),
        counts=counts,
        run_info_recovered=run_recovered,
    )


__all__ = [
    "FinalizeReport",
    "RunLock",
    "RunLockedError",
    "check_output_dir",
    "finalize",
    "recovered_counts",
]
