"""The end of a run: one routine for removal and for crash recovery (`finalize`).

Design decision: `finish_run` is the only code that turns a directory of parts into a finished
run (merge, result.json, index.md), and both `remove_observer` (through `DirectorySink.close`)
and `torchinstruments finalize` call it, so recovery is the same code the library runs at removal.
Its error policy is single: nothing it does raises for a disk or Polars failure; each failure
becomes a line in `FinishReport.problems`, index.md lists those lines and says "complete" only
when there are none, and the caller reports them (a warning at removal, stderr in the CLI). A
failing result.json never prevents history.parquet, and a failing merge leaves the parts in place
for a later `finalize`.

"Complete" means history.parquet holds every row the run recorded. The live run knows that
number and embeds it in index.md at removal; a crashed run never reached removal, so `finalize`
cannot know how many rows it still held in memory (at most one flush interval's worth) and calls
the directory "interrupted", never "complete".

After a crash the counts are lower bounds read from history: root_forwards = max forward_index +
1, samples = distinct sample_ids, backward_samples = distinct sample_ids with an output_gradient,
and per layer the distinct sample_ids with an output row (a call whose output held no tensor
leaves no row, so only the live observer counts it).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from torchinstruments.records import OUTPUT, OUTPUT_GRADIENT, LayerInfo, RunCounts, RunInfo
from torchinstruments.rundir.index_page import (
    index_is_complete,
    read_rows_recorded,
    read_run_info,
    write_index,
)
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    MERGE_TMP_DIR,
    PARTS_DIR,
    is_library_temporary,
    list_parts,
    scan_history,
)
from torchinstruments.rundir.lock import RunLock
from torchinstruments.rundir.merge import MergeResult, merge_history
from torchinstruments.rundir.shell import command_line
from torchinstruments.rundir.summary import write_result
from torchinstruments.rundir.writer import HistoryConfig


@dataclass(frozen=True)
class FinishReport:
    """What finishing a run did, and what is missing from it.

    Attributes:
        directory: the run directory.
        merge: the merge's result, or None when the merge failed.
        counts: the counts written into index.md.
        problems: why the run is incomplete; empty when history.parquet holds every row the run
            recorded and result.json and index.md were written.
        removed_temporaries: library temporaries deleted by `finalize`.
        run_info_recovered: True when index.md's run info was unreadable and rebuilt from history.
        interrupted: True when the run never reached removal (its process died): rows of its
            last flush interval may be missing, and their number is unknown.
    """

    directory: Path
    merge: MergeResult | None
    counts: RunCounts
    problems: tuple[str, ...]
    removed_temporaries: tuple[Path, ...] = ()
    run_info_recovered: bool = False
    interrupted: bool = False

    @property
    def complete(self) -> bool:
        """Whether the run directory holds everything the run recorded."""
        return not self.problems


def finish_run(
    directory: Path,
    run: RunInfo,
    counts: RunCounts | None,
    *,
    unwritten: str | None = None,
    problems: Sequence[str] = (),
    rows_recorded: int | None = None,
    interrupted: bool = False,
    rewrite_index: bool = True,
) -> FinishReport:
    """Merge the parts, write result.json and index.md; never raises for disk or Polars errors.

    Args:
        directory: the run directory (absolute, used literally).
        run: what the run is.
        counts: the live run's counts, or None after a crash (then recovered from history).
        unwritten: why rows the run recorded never reached a part, or None if none were lost.
        problems: other failures already known (e.g. TensorBoard events), listed in index.md.
        rows_recorded: rows the run recorded, when known; history.parquet is checked against it.
        interrupted: the process ended without removal (see the module docstring).
        rewrite_index: False keeps an existing complete index.md (finalize of a finished run).

    Returns:
        A `FinishReport`; `problems` is empty exactly when the run is complete.
    """
    found: list[str] = [] if unwritten is None else [unwritten]
    found += problems
    merge: MergeResult | None = None
    try:
        merge = merge_history(directory)
    except (OSError, pl.exceptions.PolarsError) as error:
        found.append(
            f"merging {PARTS_DIR}/ into {HISTORY_FILE} failed ({type(error).__name__}: {error}); "
            "the parts are kept: run "
            f"`{command_line('python', '-m', 'torchinstruments', 'finalize', directory)}`"
        )
    recovered = counts is None
    if counts is None:
        counts = _recovered_counts(directory)
    if merge is not None:
        found += [
            f"history part {path.name} is unreadable and was left in place ({reason}); its rows "
            "are not in history.parquet"
            for path, reason in merge.unreadable_parts
        ]
        if rows_recorded is not None and unwritten is None and merge.rows < rows_recorded:
            found.append(
                f"{HISTORY_FILE} holds {merge.rows} of the {rows_recorded} rows this run "
                f"recorded; {rows_recorded - merge.rows} rows are missing"
            )
        try:
            write_result(directory, run.layers, run.window, counts.layer_samples)
        except (OSError, pl.exceptions.PolarsError, ValueError) as error:
            found.append(f"result.json could not be written ({type(error).__name__}: {error})")
    if rewrite_index or found:
        try:
            write_index(
                directory,
                run,
                counts,
                recovered=recovered,
                problems=found,
                interrupted=interrupted,
                rows_recorded=rows_recorded,
            )
        except OSError as error:
            found.append(f"index.md could not be written ({type(error).__name__}: {error})")
    return FinishReport(directory, merge, counts, tuple(found), interrupted=interrupted)


def finalize(directory: Path) -> FinishReport:
    """Complete an interrupted run directory: merge parts, write result.json and index.md.

    Safe to run again: parts already in history.parquet are not merged twice, unreadable parts stay
    in place (and are listed in `problems`). A finished run only gets result.json recomputed; its
    index.md, with the exact counts of the live run, is kept. Only files the library created are
    deleted (temporaries ending in `.torchinstruments-tmp`).

    Args:
        directory: the run's output directory.

    Returns:
        A `FinishReport`.

    Raises:
        FileNotFoundError: if `directory` holds no run (no history.parts/ nor history.parquet).
        RunLockedError: if a live process holds the run lock.
    """
    directory = Path(directory).expanduser().absolute()
    if not (directory / PARTS_DIR).is_dir() and not (directory / HISTORY_FILE).is_file():
        raise FileNotFoundError(
            f"{directory} holds no run: neither {PARTS_DIR}/ nor {HISTORY_FILE} exists"
        )
    with RunLock(directory):
        removed = _remove_temporaries(directory)
        keep_index = index_is_complete(directory) and not list_parts(directory)
        rows_recorded = read_rows_recorded(directory)
        try:
            run, recovered = read_run_info(directory), False
        except (OSError, ValueError):
            run, recovered = _fallback_run_info(directory), True
        report = finish_run(
            directory,
            run,
            None,
            rows_recorded=rows_recorded,
            interrupted=rows_recorded is None and not keep_index,
            rewrite_index=recovered or not keep_index,
        )
    return FinishReport(
        report.directory,
        report.merge,
        report.counts,
        report.problems,
        tuple(removed),
        recovered,
        report.interrupted,
    )


def _remove_temporaries(directory: Path) -> list[Path]:
    """Delete leftovers of the library's interrupted atomic writes (the caller holds the lock)."""
    removed = []
    candidates = list(directory.iterdir())
    if (directory / PARTS_DIR).is_dir():
        candidates += list((directory / PARTS_DIR).iterdir())
    for path in candidates:
        if path.is_file() and is_library_temporary(path):
            path.unlink()
            removed.append(path)
    if (directory / MERGE_TMP_DIR).is_dir():
        shutil.rmtree(directory / MERGE_TMP_DIR)
        removed.append(directory / MERGE_TMP_DIR)
    return removed


def _recovered_counts(directory: Path) -> RunCounts:
    """Lower-bound counts read from history.parquet (zero when there is none)."""
    history = directory / HISTORY_FILE
    if not history.is_file():
        return RunCounts(0, 0, 0)
    try:
        row = (
            scan_history(history)
            .select(
                root_forwards=(pl.col("forward_index").max() + 1).fill_null(0),
                samples=pl.col("sample_id").n_unique(),
                backward_samples=pl.col("sample_id")
                .filter(pl.col("signal") == OUTPUT_GRADIENT)
                .n_unique(),
            )
            .collect(engine="streaming")
        )
        per_layer = (
            scan_history(history)
            .filter(pl.col("signal") == OUTPUT)
            .group_by("layer")
            .agg(samples=pl.col("sample_id").n_unique())
            .collect(engine="streaming")
        )
    except (OSError, pl.exceptions.PolarsError):
        return RunCounts(0, 0, 0)
    return RunCounts(
        *(int(row[name].item()) for name in row.columns),
        layer_samples={r["layer"]: int(r["samples"]) for r in per_layer.iter_rows(named=True)},
    )


def _fallback_run_info(directory: Path) -> RunInfo:
    """A RunInfo rebuilt from history alone when index.md is missing or unreadable."""
    layers: list[LayerInfo] = []
    history = directory / HISTORY_FILE
    sources = [history] if history.is_file() else list_parts(directory)
    if not sources:
        sources = []
    try:
        frame = (
            scan_history(sources)
            .group_by("layer")
            .agg(pl.col("module_type").last())
            .sort("layer")
            .collect(engine="streaming")
        )
        layers = [LayerInfo(r["layer"], r["module_type"]) for r in frame.iter_rows(named=True)]
    except (OSError, pl.exceptions.PolarsError):
        pass  # no readable history: the page lists no layers, and history says the rest
    default = HistoryConfig()
    return RunInfo(
        output_dir=directory,
        library_version="unknown",
        torch_version="unknown",
        model_class="unknown",
        layers=tuple(layers),
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


__all__ = ["FinishReport", "finalize", "finish_run"]
