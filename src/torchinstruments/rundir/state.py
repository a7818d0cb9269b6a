"""The run's state: one machine-readable file, `.state.json`, next to `.lock` in the run directory.

Design decision: what a run is (`RunInfo`), how far it got (`Status`), what it saw (`RunCounts`)
and what it is missing (problems, the loss ledger) live in one frozen `RunState`, written as
strict JSON with `replace_atomically` whenever it changes (at injection, at removal, at
`finalize`). index.md is rendered from a `RunState` and never read back; `finalize` and the
command line read this file. The cost: two files say the same thing, so the page is always
written after the state, from the very object that was just written.

Reading: `read_state(directory)` reads this file only. Readers of any directory call
`rundir.recovery.load_state`, which also converts the directories of versions before this file
(the one place that knows the old index.md); that keeps every version check out of this module.

The file (`SCHEMA_VERSION` 1):

    {"schema_version": 1, "status": "complete", "run": {RunInfo fields, HistoryConfig's inline},
     "counts": {"root_forwards", "samples", "backward_samples", "layer_samples": {name: n},
                "train_forwards", "eval_forwards", "unobserved_eval_forwards",
                "unobserved_setup_forwards", "bypassed_by", "no_grad_samples"} | null,
     "counts_recovered": false, "interrupted": false, "rows_recorded": 1234 | null,
     "problems": [...], "live_problems": [...], "losses": [{LostRows fields}], "notes": [...],
     "marks": [{SampleMark fields}], "marks_total": 0, "removed_in_flight": [...],
     "run_info_recovered": false, "migrated_from": null,
     "attempts": [{AttemptCounts fields}], "events_without_rows": [...], ...}

`train_forwards` and `eval_forwards` (in `counts` and in each attempt: what each sampler's
schedule counted), and `unobserved_eval_forwards` / `unobserved_setup_forwards` (in `counts`:
what a trainer callback passed through unobserved) were added without a new schema version: a
file written before them has none, which reads as null, "unknown" (a continued run then falls
back to the rule before them, `rundir.attempts`, and index.md never says "never called").
`bypassed_by` (in `counts`: what built a module that ran the model's layers past the observer,
bypass.py) was added the same way: absent reads as null, nothing found; so was `continued_by`
(in each attempt: how it continued the run, `rundir.attempt_states`): absent reads as null,
unknown, which `show` says as "continued" alone.

`status` is written for readers and never read back: it is derived from the other fields
(`RunState.status`), so the file cannot contradict itself.

Extending it (other issues add fields here, and only here):

1. Add a field with a default to `RunState` (or to `LostRows` in `rundir.ledger`,
   `RunCounts`, `RunInfo`); a field
   of JSON scalars, or a tuple of them, is written and read without further code, and a file
   without the field reads as the default. A field of another type gets one line in `_ENCODE`
   below. Reading checks every value against the field's annotation (`_decode_value`), so the
   annotation is the schema: a wrong-typed value is a one-line `StateTypeError` naming it.
2. Render it in `rundir.index_page` if a reader of index.md should see it.
3. Bump `SCHEMA_VERSION` only for a change an older reader would misread (a field whose meaning
   changes); an added field is not one: older readers ignore keys they do not know.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import RunCounts, RunInfo, ScaleSpan
from torchinstruments.rundir.attempts import AttemptCounts
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    INDEX_FILE,
    PARTS_DIR,
    STATE_FILE,
    write_text_atomic,
)
from torchinstruments.rundir.ledger import LostRows
from torchinstruments.rundir.marks import SampleMark
from torchinstruments.rundir.shell import json_on_one_line

SCHEMA_VERSION = 1


class Status(enum.StrEnum):
    """How far a run got; the first thing index.md and `torchinstruments show` say."""

    IN_PROGRESS = "in progress"  # injected, not removed (or its process died before removal ended)
    COMPLETE = "complete"  # history.parquet holds every row the run recorded
    INTERRUPTED = "interrupted"  # finalized after its process died: its last flush may be lost
    INCOMPLETE = "incomplete"  # something is missing; `problems` and `losses` say what


@dataclass(frozen=True)
class RunState:
    """Everything a run directory says about its run, in one record.

    Attributes:
        run: what the run is.
        counts: how much it saw; None while it is in progress.
        counts_recovered: True when `counts` were rebuilt from history (lower bounds).
        interrupted: True when the process ended without `remove_observer` (finalize after a
            crash): rows of its last flush interval may be missing, their number unknown.
        rows_recorded: rows the live run recorded, when known (written at removal);
            history.parquet is checked against it.
        problems: why the finished run is incomplete, one sentence each (as of its last finish).
        live_problems: the part of `problems` the live run reported and no later `finalize` can
            check again (a TensorBoard failure); every later finish keeps them.
        losses: the loss ledger, rows recorded but not written.
        notes: what the run said about itself after injection (configuration notes known at
            injection are `run.notes`).
        run_info_recovered: True when `run` was rebuilt from history (no readable state).
        migrated_from: the file of an older version this state was converted from, if any.
        marks: the first marked samples in history (`rundir.marks`: a root forward that
            raised, or a sample only partly written before the process died), as of the last
            finish; `marks_total` counts every marked sample (each once, however many marker
            rows it has).
        removed_in_flight: the samples that were in flight (their forward or backward running)
            when `remove_observer` was called, as the live run saw them, over all attempts:
            what index.md's state line is decided by.
        attempts: one entry per process that wrote the run (`rundir.attempts`; more than one
            when it was continued with `resume=True`), with its own counts.
        events_without_rows: after a kill, the first forward_index values (at most 20) the
            run's TensorBoard events hold a sample at but history has no row of (rows that
            died in memory); `events_without_rows_total` counts them all.
        mark_samples: after a kill, the samples the run's id mark (`rundir.id_mark`) counts
            beyond those its rows and events show: begun, and the process died before anything
            of them reached the disk (`rundir.mark_counts`); the counts include them.
        dtype_changes: the first layers (at most 20) whose tensors had more than one dtype over
            the run (a model cast mid-run), each with its dtypes' samples
            (`rundir.dtype_spans`, as of the last finish); `dtype_changes_total` counts them.
        removal_step: while remove_observer finishes the run, the file it is writing (a name
            of `rundir.finish.FINISH_STEPS`), written as each step begins with the counts the
            live run ends with, or `LAST_PARTS` while its flush thread writes the last rows
            (before the counts are written; a kill there may lose rows still in memory); None
            before removal and once it finished. A directory whose process is gone with it set
            was killed during removal (from the merge on, after every row it recorded had
            reached history.parts/ or the loss ledger).
        loss_scales: with a `grad_scaler`, each sample's loss scale (spans, as
            `RunCounts.loss_scales`) as last saved: by the flush thread while the run lives
            (`rundir.live_scales`), then by each finish as its counts have them; a finish that
            rebuilds the counts from history (after a kill) takes them from here.
        left_behind: what the last finish's merge could not delete of the parts it merged (a
            folder without write permission), one sentence each: a second copy of rows
            history.parquet holds, disk space and no missing row (as of the last finish).
    """

    run: RunInfo
    counts: RunCounts | None = None
    counts_recovered: bool = False
    interrupted: bool = False
    rows_recorded: int | None = None
    problems: tuple[str, ...] = ()
    live_problems: tuple[str, ...] = ()
    losses: tuple[LostRows, ...] = ()
    notes: tuple[str, ...] = ()
    run_info_recovered: bool = False
    migrated_from: str | None = None
    marks: tuple[SampleMark, ...] = ()
    marks_total: int = 0
    removed_in_flight: tuple[int, ...] = ()
    attempts: tuple[AttemptCounts, ...] = ()
    events_without_rows: tuple[int, ...] = ()
    events_without_rows_total: int = 0
    mark_samples: int = 0
    dtype_changes: tuple[str, ...] = ()
    dtype_changes_total: int = 0
    removal_step: str | None = None
    left_behind: tuple[str, ...] = ()
    loss_scales: tuple[ScaleSpan, ...] = ()

    @property
    def layer_counts_unknown(self) -> bool:
        """Whether the per-layer counts say nothing: rebuilt from history after the process
        died, and no output row of any layer had reached the disk. Samples can still be known
        then (TensorBoard events prove them), but not which layers ran in them."""
        return self.counts is not None and self.counts_recovered and not self.counts.layer_samples

    @property
    def status(self) -> Status:
        """In progress without counts or while removal finishes the run; incomplete with a
        problem or a loss; else interrupted when the process died before removal; else
        complete."""
        if self.counts is None or self.removal_step is not None:
            return Status.IN_PROGRESS
        if self.problems or self.losses:
            return Status.INCOMPLETE
        if self.interrupted:
            return Status.INTERRUPTED
        return Status.COMPLETE


# The removal step before the finish's (`RunState.removal_step`): the flush thread writing the
# last rows to history.parts/. A kill there may lose rows still in memory, unlike a later one.
LAST_PARTS = f"{PARTS_DIR}/"


def removal_doing(step: str) -> str:
    """What removal was doing at `step` (a `RunState.removal_step`), in readers' words."""
    if step == LAST_PARTS:
        return f"writing its last rows to {PARTS_DIR}/"
    if step == HISTORY_FILE:
        return f"merging {PARTS_DIR}/ into {HISTORY_FILE}"
    # index.md is written before the state file says the run is finished (`finish_run`)
    if step == INDEX_FILE:
        return f"writing {INDEX_FILE} and the final {STATE_FILE}"
    return f"writing {step}"


# How the note begins that `finalize` adds to a run killed during removal (`killed_in_removal`).
KILLED_IN_REMOVAL = "remove_observer did not finish the run"


def killed_in_removal(step: str) -> str:
    """The note `finalize` adds to a run whose process died at removal's `step`: from the
    merge on, its rows and counts were all written before, so the finish completes it; during
    the last flush, rows still in memory may be lost and the counts are rebuilt."""
    return f"{KILLED_IN_REMOVAL}: {kill_cost(step, 'removal')}"


def kill_cost(step: str, finisher: str) -> str:
    """What a kill during a finish's `step` did and may have cost, `finisher` naming that finish
    ("removal", or "that finish" for one at the process's exit: `cut_finish`)."""
    said = (
        f"its process was killed or crashed while {removal_doing(step)} (or {finisher} gave "
        "that write up on a file system that stopped answering); "
    )
    if step == LAST_PARTS:
        return said + (
            "rows it still held in memory may be missing (at most one flush interval's worth), "
            "and `finalize` merged every row it had written and rebuilt the counts from "
            "history (lower bounds)"
        )
    return said + (
        f"every row it recorded had reached {PARTS_DIR}/ or the loss ledger before, and "
        f"`finalize` completed the run from the counts {finisher} had written"
    )


# `RunInfo.history`'s fields sit in the run object itself, as they did before RunInfo held the
# HistoryConfig (`"run": {..., "buffer_rows": 65536, "window": 10, ...}`): the file is unchanged.
_HISTORY_KEYS = tuple(f.name for f in fields(HistoryConfig))


def _encode_run(run: RunInfo) -> dict[str, Any]:
    out = _encode_fields(
        run,
        {
            "output_dir": lambda p: Path(p).as_posix(),
            "layers": lambda ls: [{"name": li.name, "module_type": li.module_type} for li in ls],
        },
    )
    history = out.pop("history")
    out.update((name, getattr(history, name)) for name in _HISTORY_KEYS)
    return out


def decode_run_info(data: Mapping[str, Any]) -> RunInfo:
    """A `RunInfo` from its JSON object (the state file's `run`), every value checked by type.

    Raises:
        ValueError: if a field without a default is missing or a value has the wrong type (the
            message names the field, e.g. `run.window`).
    """
    return _decode_value(data, RunInfo, "run")


def _decode_run(value: Any, where: str) -> RunInfo:
    """The run object: `_HISTORY_KEYS` make its `HistoryConfig` (named `run.window` and so on),
    the other keys its own fields."""
    if not isinstance(value, dict):
        raise _wrong(where, value, RunInfo)
    own = {key: item for key, item in value.items() if key not in _HISTORY_KEYS}
    history = _decode_fields(HistoryConfig, value, where)
    return _decode_fields(RunInfo, own, where, {"history": history})


def _encode_spans(spans: tuple[ScaleSpan, ...]) -> list[dict[str, Any]]:
    return [_encode_fields(span, {}) for span in spans]


def _encode_counts(counts: RunCounts | None) -> dict[str, Any] | None:
    if counts is None:
        return None
    return _encode_fields(counts, {"layer_samples": dict, "loss_scales": _encode_spans})


# Fields of RunState that are not JSON scalars or tuples of them (decoding needs no table: the
# fields' type annotations say what each value must be, see `_decode_value`).
_ENCODE: dict[str, Callable[[Any], Any]] = {
    "run": _encode_run,
    "counts": _encode_counts,
    "losses": lambda losses: [_encode_fields(loss, {}) for loss in losses],
    "marks": lambda marks: [_encode_fields(mark, {}) for mark in marks],
    "attempts": lambda attempts: [_encode_fields(a, {}) for a in attempts],
    "loss_scales": _encode_spans,
}


def _encode_fields(obj: Any, special: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """A dataclass as a JSON object: tuples become lists, `special` fields are converted."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name in special:
            value = special[f.name](value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


class StateTypeError(ValueError):
    """A value of the state file has the wrong type; the message is one line naming the field."""


def _type_name(hint: Any) -> str:
    """How an error names the expected type: `int`, `str or null`, `list of str`."""
    if hint is type(None):
        return "null"
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    if origin is not None:  # Mapping[str, int]
        key, value = typing.get_args(hint)
        return f"an object of {_type_name(key)} to {_type_name(value)}"
    if dataclasses.is_dataclass(hint):
        return f"an object ({hint.__name__})"
    return {Path: "str", float: "number"}.get(hint, getattr(hint, "__name__", str(hint)))


def _wrong(where: str, value: Any, hint: Any) -> StateTypeError:
    shown = json.dumps(value, ensure_ascii=False, allow_nan=True, default=repr)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return StateTypeError(f"{STATE_FILE}: field {where!r} is {shown}, expected {_type_name(hint)}")


def _decode_value(value: Any, hint: Any, where: str) -> Any:
    """`value` (parsed JSON) as the Python value of type `hint`, checked all the way down.

    Why by type and not by trust: a value edited by hand or written by another tool (`"1080"`
    for an int, `"text"` for a list) would otherwise fail far from here (a traceback in
    `finalize` after the merge, or a string split into characters). Booleans are never
    numbers here, and a number is never a string.

    Raises:
        StateTypeError: naming the field (`where`, e.g. `counts.layer_samples['fc']`).
    """
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        kinds = [option for option in options if option is not type(None)]
        if len(kinds) == 1:  # `X | None`: X's own error names the inner field
            return _decode_value(value, kinds[0], where)
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode_value(value, option, where)
            except StateTypeError:
                continue
        raise _wrong(where, value, hint)
    origin = typing.get_origin(hint)
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1]
        if not isinstance(value, list):
            raise _wrong(where, value, hint)
        return tuple(_decode_value(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is not None:  # Mapping[str, int]
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise _wrong(where, value, hint)
        return {
            _decode_value(k, key_hint, where): _decode_value(v, value_hint, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if hint is RunInfo:
        return _decode_run(value, where)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _wrong(where, value, hint)
        return _decode_fields(hint, value, where)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:  # finite: json.loads reads NaN and Infinity, which we never write
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
        value = float(value) if ok else value
    elif hint is str or hint is Path:
        ok = isinstance(value, str)
        value = Path(value) if ok and hint is Path else value
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise _wrong(where, value, hint)
    return value


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    """`cls`'s annotations, resolved once per class. Why: `typing.get_type_hints` compiles every
    string annotation again on each call, and a state holds a record per layer: reading the
    state file of a 3,000-layer run took about 0.25 s, mostly that (a parent's index.md reads
    every rank's)."""
    return typing.get_type_hints(cls)


def _decode_fields(
    cls: Any, data: Mapping[str, Any], where: str, decoded: Mapping[str, Any] | None = None
) -> Any:
    """`cls` from a JSON object: missing fields take their default, unknown keys are ignored,
    every value is checked against the field's annotation (`_decode_value`); `decoded` gives
    fields already decoded.

    Raises:
        StateTypeError: a value of the wrong type, a missing field, or a value `cls` refuses
            (e.g. `window` 0), naming the field.
    """
    hints = _field_hints(cls)
    values: dict[str, Any] = dict(decoded or {})
    for f in fields(cls):
        name = f"{where}.{f.name}" if where else f.name
        if f.name in values:
            continue
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise StateTypeError(f"{STATE_FILE}: field {name!r} is missing")
            continue
        values[f.name] = _decode_value(data[f.name], hints[f.name], name)
    try:
        return cls(**values)
    except ValueError as error:  # a check of the record itself (HistoryConfig's bounds)
        said = str(error)  # such a check's message names its field first: `window must be ...`
        named = [(said.find(f.name), f.name) for f in fields(cls) if f.name in said.split()]
        found = min(named)[1] if named else None
        name = ".".join(part for part in (where, found) if part) or "the file"
        raise StateTypeError(f"{STATE_FILE}: field {name!r}: {said}") from None


def encode_state(state: RunState) -> str:
    """The state file's text: strict JSON (no NaN), UTF-8, one key per line."""
    data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "status": state.status.value}
    data.update(_encode_fields(state, _ENCODE))
    return json_on_one_line(json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False)) + "\n"


class NewerStateError(ValueError):
    """The state file was written by a newer torchinstruments (a schema this one cannot read)."""


def decode_state(text: str) -> RunState:
    """A `RunState` from the state file's text.

    Raises:
        NewerStateError: if its schema version is newer than `SCHEMA_VERSION`.
        StateTypeError: if a field is missing or a value has the wrong type (one line that
            names the field).
        ValueError: if it is not a state file (bad JSON, no schema version).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{STATE_FILE} is not JSON ({error})") from error
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int):
        raise ValueError(f"{STATE_FILE} has no schema_version (not a state file)")
    if data["schema_version"] > SCHEMA_VERSION:
        raise NewerStateError(
            f"{STATE_FILE} has schema version {data['schema_version']}, newer than this "
            f"torchinstruments reads ({SCHEMA_VERSION}); use the version that wrote the run"
        )
    return _decode_fields(RunState, data, "")


def write_state(
    directory: Path,
    state: RunState,
    rename: Callable[[Path, Path], None] = os.replace,
    tag: str = "",
) -> None:
    """Write `directory/.state.json` atomically (`replace_atomically`, with its `rename` and
    temporary-name `tag`)."""
    write_text_atomic(directory / STATE_FILE, encode_state(state), rename, tag)


def read_state(directory: Path) -> RunState:
    """The state in `directory/.state.json`.

    Raises:
        FileNotFoundError: if the directory has no state file (see `rundir.recovery.load_state`).
        NewerStateError: if a newer version wrote it.
        ValueError: if it is malformed.
    """
    try:
        text = (directory / STATE_FILE).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{STATE_FILE} is not UTF-8 ({error})") from error
    return decode_state(text)


__all__ = [
    "KILLED_IN_REMOVAL",
    "LAST_PARTS",
    "SCHEMA_VERSION",
    "LostRows",
    "NewerStateError",
    "RunState",
    "StateTypeError",
    "Status",
    "decode_run_info",
    "decode_state",
    "encode_state",
    "kill_cost",
    "killed_in_removal",
    "read_state",
    "removal_doing",
    "write_state",
]
