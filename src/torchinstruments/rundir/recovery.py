"""The state of any run directory: its state file, an older version's index.md, or its history.

Design decision: `load_state` is the one reader every consumer (`finalize`, the command line)
goes through, and this module is the one place that knows what older directories look like, so
no page parser exists anywhere else. A directory has, in order of preference:

1. `.state.json` (`rundir.state`), the record this version writes;
2. else the index.md of a version before the state file, which embedded the run info as a JSON
   block between `<!-- torchinstruments:run-info:begin/end -->` and the state as a marker
   comment. Only those machine-written markers are read (plain string search, no pattern), never
   the prose: the run info, the state marker and the rows-recorded marker. The counts are not
   read from the page; they are rebuilt from history (lower bounds), so `finalize` renders the
   page of such a run with recovered counts;
3. else nothing: `fallback_run_info` rebuilds what it can: the selected layers from result.json's
   catalog (written at inject, in traversal order, every selected layer, run or not) when it is
   readable, else from history (`finalize` of a directory whose state file and index.md were
   deleted).

After a crash the counts are lower bounds read from history (`recovered_counts`): root_forwards
= max forward_index + 1, samples = distinct sample_ids, backward_samples = distinct sample_ids
with an output_gradient (and no_grad_samples those whose forward ran with grad disabled, which
tell a 0 of them known: `rundir.gradient_counts`), and per layer the distinct sample_ids with an
output row (a call whose output held no tensor leaves no row, so only the live observer counts
it).

`state_to_finish` is what `finalize` starts from: the directory's state as `load_state` reads it,
with what a finish recomputes cleared (its problems; counts an earlier finish rebuilt), and a
kill during removal said in its notes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import polars as pl

from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import OUTPUT, OUTPUT_GRADIENT, LayerInfo, RunCounts, RunInfo
from torchinstruments.rundir.attempts import IN_PROGRESS, IN_REMOVAL, AttemptCounts, attempt_notes
from torchinstruments.rundir.cut_finish import cut_unremoved_note, unremoved_note
from torchinstruments.rundir.gradient_counts import no_grad_samples
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    INDEX_FILE,
    RESULT_FILE,
    STATE_FILE,
    list_parts,
    scan_history,
)
from torchinstruments.rundir.marks import is_mark
from torchinstruments.rundir.shell import error_said
from torchinstruments.rundir.state import (
    LAST_PARTS,
    NewerStateError,
    RunState,
    Status,
    decode_run_info,
    killed_in_removal,
    read_state,
)

# The machine-written markers of index.md before the state file (version 0.1.0 and earlier).
_OLD_RUN_INFO_BEGIN = "<!-- torchinstruments:run-info:begin -->"
_OLD_RUN_INFO_END = "<!-- torchinstruments:run-info:end -->"
_OLD_ROWS_RECORDED = "<!-- torchinstruments:rows-recorded:"
_OLD_STATE = "<!-- torchinstruments:state:{} -->"


def load_state(directory: Path) -> RunState | None:
    """The state of `directory`: its state file, else converted from an older index.md.

    Returns:
        The state, or None when the directory has neither (see `fallback_run_info`).

    Raises:
        NewerStateError: if a newer torchinstruments wrote the state file.
        ValueError: if the state file, or the older index.md's run-info block, is malformed.
        OSError: if a file exists but cannot be read.
    """
    if (directory / STATE_FILE).is_file():
        return read_state(directory)
    if (directory / INDEX_FILE).is_file():
        return _state_from_old_index(directory)
    return None


def _state_from_old_index(directory: Path) -> RunState | None:
    """The state of a directory written before the state file; None if its index.md has none."""
    try:
        text = (directory / INDEX_FILE).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{INDEX_FILE} is not UTF-8 ({error})") from error
    _, begin, rest = text.partition(_OLD_RUN_INFO_BEGIN)
    block, end, _ = rest.partition(_OLD_RUN_INFO_END)
    if not begin or not end:
        return None  # not a page this library wrote: nothing to convert
    block = block.strip().removeprefix("```json").removesuffix("```")
    try:
        data = json.loads(block)
    except json.JSONDecodeError as error:
        raise ValueError(f"{INDEX_FILE}'s run-info block is not JSON ({error})") from error
    if not isinstance(data, dict):
        raise ValueError(f"{INDEX_FILE}'s run-info block is not a JSON object")
    try:
        run = decode_run_info(data)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{INDEX_FILE}'s run-info block is malformed ({error})") from error
    finished = any(
        _OLD_STATE.format(name) in text for name in ("complete", "incomplete", "interrupted")
    )
    return RunState(
        run,
        counts=recovered_counts(directory) if finished else None,
        counts_recovered=finished,
        interrupted=_OLD_STATE.format("interrupted") in text,
        rows_recorded=_old_rows_recorded(text),
        migrated_from=INDEX_FILE,
    )


def _old_rows_recorded(text: str) -> int | None:
    """The rows-recorded marker of an older index.md (written at removal), if any."""
    _, found, rest = text.partition(_OLD_ROWS_RECORDED)
    number, closed, _ = rest.partition(" -->")
    return int(number) if found and closed and number.isdigit() else None


def recovered_counts(directory: Path) -> RunCounts:
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
                no_grad_samples=no_grad_samples(),
            )
            .collect(engine="streaming")
        )
        per_layer = (
            scan_history(history)
            .filter(pl.col("signal") == OUTPUT, ~is_mark())  # a marker names a layer that raised
            .group_by("layer")
            .agg(samples=pl.col("sample_id").n_unique())
            .collect(engine="streaming")
        )
    except (OSError, pl.exceptions.PolarsError):
        return RunCounts(0, 0, 0)
    root_forwards, samples, backward_samples, no_grad = (int(v) for v in row.row(0))
    return RunCounts(
        root_forwards,
        samples,
        backward_samples,
        layer_samples={r["layer"]: int(r["samples"]) for r in per_layer.iter_rows(named=True)},
        no_grad_samples=no_grad,
    )


# Where `fallback_run_info` found the layers, as its sampler text says (the state file keeps
# that text, so a later reader of the state says the same).
LAYERS_FROM_CATALOG = f"read from {RESULT_FILE}'s catalog"
LAYERS_FROM_HISTORY = "rebuilt from history"


def recovered_layers(run: RunInfo) -> str:
    """`LAYERS_FROM_CATALOG` or `LAYERS_FROM_HISTORY`: where a recovered run's layers came from."""
    return LAYERS_FROM_CATALOG if LAYERS_FROM_CATALOG in run.sampler else LAYERS_FROM_HISTORY


def _catalog_layers(directory: Path) -> list[LayerInfo] | None:
    """The selected layers of result.json (the catalog inject writes, or the summaries removal
    writes; both list every selected layer in traversal order), or None when it is missing,
    unreadable or lists none."""
    try:
        records = json.loads((directory / RESULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(records, list) or not records:
        return None
    layers = []
    for record in records:
        if not isinstance(record, dict):
            return None
        name, module_type = record.get("layer"), record.get("module_type")
        if not isinstance(name, str) or not isinstance(module_type, str):
            return None
        layers.append(LayerInfo(name, module_type))
    return layers


# Why a run's settings are unknown: its state file gone or unreadable, and no index.md of a
# version before the state file (which held them) in its place. A current index.md is there
# but is rendered from the state, never read back: "index.md missing" was untrue beside it.
NO_SETTINGS = (
    f"{STATE_FILE} missing or unreadable, and no {INDEX_FILE} of an older version to read the "
    "settings from"
)


def fallback_run_info(directory: Path) -> RunInfo:
    """A RunInfo rebuilt from result.json's catalog and history, when the directory says
    nothing readable of it otherwise (no state file, no index.md)."""
    catalog = _catalog_layers(directory)
    if catalog is not None:
        return _unknown_run_info(directory, catalog, LAYERS_FROM_CATALOG)
    layers: list[LayerInfo] = []
    history = directory / HISTORY_FILE
    sources = [history] if history.is_file() else list_parts(directory)
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
    return _unknown_run_info(directory, layers, LAYERS_FROM_HISTORY)


def _unknown_run_info(directory: Path, layers: list[LayerInfo], found: str) -> RunInfo:
    """A RunInfo of `layers` (`found`: where they came from) and every other setting unknown."""
    return RunInfo(
        output_dir=directory,
        library_version="unknown",
        torch_version="unknown",
        model_class="unknown",
        layers=tuple(layers),
        focus_layers=(),
        sampler=f"unknown ({NO_SETTINGS}; layers {found})",
        metrics=(),
        rank=None,
        world_size=None,
        rank_policy="unknown",
        capture_direct_forwards=False,
        history=HistoryConfig(),
        started_at="unknown",
    )


def state_to_finish(directory: Path) -> RunState:
    """What `finalize` starts from: the directory's state, with what a later finish recomputes
    cleared (problems; counts that were already lower bounds), or one rebuilt from history."""
    unreadable: tuple[str, ...] = ()
    try:
        previous = load_state(directory)
    except NewerStateError:
        raise
    except (OSError, ValueError) as error:
        previous = None
        unreadable = (f"the run's state could not be read ({error_said(error)})",)
    if previous is None:
        return RunState(
            fallback_run_info(directory),
            interrupted=True,
            notes=unreadable,
            run_info_recovered=True,
        )
    killed_at = previous.removal_step  # killed during removal: its counts are the live run's
    notes, attempts = previous.notes, previous.attempts
    counts = previous.counts if _counts_written(previous) else None
    unremoved = None if killed_at is None else unremoved_note(notes, attempts)
    if unremoved is not None and killed_at is not None:  # no remove_observer: its note says so
        notes = _cut_note(notes, unremoved, killed_at)
        if counts is not None:
            counts = dataclasses.replace(
                counts, notes=_cut_note(counts.notes, unremoved, killed_at)
            )
    elif killed_at is not None:
        notes = (*notes, *_removal_note(attempts, killed_in_removal(killed_at)))
    removing = unremoved is None and killed_at == LAST_PARTS
    if removing and attempts and attempts[-1].ended == IN_PROGRESS:
        # remove_observer ran: its attempt closes as killed during removal, never as one that
        # ended without it
        attempts = (*attempts[:-1], dataclasses.replace(attempts[-1], ended=IN_REMOVAL))
    return dataclasses.replace(
        previous,
        attempts=attempts,
        counts=counts,
        # killed in removal's last flush: rows still in memory may be lost, as in any kill
        interrupted=previous.interrupted
        or (previous.status is Status.IN_PROGRESS and killed_at in (None, LAST_PARTS)),
        problems=(),
        notes=notes,
        removal_step=None,
        left_behind=(),
    )


def _counts_written(previous: RunState) -> bool:
    """Whether a finish keeps `previous`'s counts: those its last attempt's process wrote at
    removal (exact, or lower bounds only for earlier attempts that were killed), not those an
    earlier finish rebuilt from history after a kill, which are rebuilt again."""
    if not previous.counts_recovered:
        return True
    return bool(previous.attempts) and not previous.attempts[-1].counts_recovered


def _cut_note(notes: tuple[str, ...], unremoved: str, step: str) -> tuple[str, ...]:
    """`notes` with the note of a finish without remove_observer (`unremoved`) said as one that
    a kill cut at removal's `step` (`rundir.cut_finish`): never "finished" beside "cut"."""
    cut = cut_unremoved_note(unremoved, step)
    return tuple(cut if note == unremoved else note for note in notes)


def _removal_note(attempts: tuple[AttemptCounts, ...], note: str) -> tuple[str, ...]:
    """The note of a kill during removal, naming its attempt (the last) once the run has more
    than one: it speaks of that attempt, not of the whole run (`rundir.attempts`)."""
    if len(attempts) < 2:
        return (note,)
    return attempt_notes(attempts[-1].attempt, (note,))


__all__ = [
    "LAYERS_FROM_CATALOG",
    "LAYERS_FROM_HISTORY",
    "NO_SETTINGS",
    "fallback_run_info",
    "load_state",
    "recovered_counts",
    "recovered_layers",
    "state_to_finish",
]
