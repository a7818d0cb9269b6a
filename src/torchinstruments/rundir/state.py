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

    {"schema_version": 1, "status": "complete", "run": {RunInfo fields},
     "counts": {"root_forwards", "samples", "backward_samples", "layer_samples": {name: n}} | null,
     "counts_recovered": false, "interrupted": false, "rows_recorded": 1234 | null,
     "problems": [...], "live_problems": [...], "losses": [{LostRows fields}], "notes": [...],
     "marks": [{SampleMark fields}], "marks_total": 0,
     "run_info_recovered": false, "migrated_from": null}

`status` is written for readers and never read back: it is derived from the other fields
(`RunState.status`), so the file cannot contradict itself.

Extending it (other issues add fields here, and only here):

1. Add a field with a default to `RunState` (or to `LostRows` in `rundir.ledger`,
   `RunCounts`, `RunInfo`); a field
   of JSON scalars, or a tuple of them, is written and read without further code, and a file
   without the field reads as the default. A field of another type gets one line in `_ENCODE` and
   `_DECODE` below.
2. Render it in `rundir.index_page` if a reader of index.md should see it.
3. Bump `SCHEMA_VERSION` only for a change an older reader would misread (a field whose meaning
   changes); an added field is not one: older readers ignore keys they do not know.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from torchinstruments.records import LayerInfo, RunCounts, RunInfo
from torchinstruments.rundir.layout import STATE_FILE, write_text_atomic
from torchinstruments.rundir.ledger import LostRows
from torchinstruments.rundir.marks import SampleMark

SCHEMA_VERSION = 1


class Status(enum.StrEnum):
    """How far a run got; the first thing index.md and `torchinstruments show` say."""

    IN_PROGRESS = "in progress"  # injected, not removed (or its process died before removal)
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
            finish; `marks_total` counts them all.
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

    @property
    def status(self) -> Status:
        """In progress without counts; incomplete with a problem or a loss; else interrupted
        when the process died before removal; else complete."""
        if self.counts is None:
            return Status.IN_PROGRESS
        if self.problems or self.losses:
            return Status.INCOMPLETE
        if self.interrupted:
            return Status.INTERRUPTED
        return Status.COMPLETE


def _encode_run(run: RunInfo) -> dict[str, Any]:
    return _encode_fields(
        run,
        {
            "output_dir": lambda p: Path(p).as_posix(),
            "layers": lambda ls: [{"name": li.name, "module_type": li.module_type} for li in ls],
        },
    )


def decode_run_info(data: Mapping[str, Any]) -> RunInfo:
    """A `RunInfo` from its JSON object (the state file's `run`).

    Raises:
        ValueError: if a field without a default is missing or a value has the wrong shape.
    """
    return _decode_fields(
        RunInfo,
        data,
        {
            "output_dir": Path,
            "layers": lambda ls: tuple(LayerInfo(d["name"], d["module_type"]) for d in ls),
        },
    )


def _encode_counts(counts: RunCounts | None) -> dict[str, Any] | None:
    if counts is None:
        return None
    return _encode_fields(counts, {"layer_samples": dict})


def _decode_counts(data: Mapping[str, Any] | None) -> RunCounts | None:
    if data is None:
        return None
    return _decode_fields(
        RunCounts, data, {"layer_samples": lambda m: {str(k): int(v) for k, v in m.items()}}
    )


# Fields of RunState that are not JSON scalars or tuples of them: (encode, decode).
_ENCODE: dict[str, Callable[[Any], Any]] = {
    "run": _encode_run,
    "counts": _encode_counts,
    "losses": lambda losses: [_encode_fields(loss, {}) for loss in losses],
    "marks": lambda marks: [_encode_fields(mark, {}) for mark in marks],
}
_DECODE: dict[str, Callable[[Any], Any]] = {
    "run": decode_run_info,
    "counts": _decode_counts,
    "losses": lambda items: tuple(_decode_fields(LostRows, d, {}) for d in items),
    "marks": lambda items: tuple(_decode_fields(SampleMark, d, {}) for d in items),
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


def _decode_fields(cls: Any, data: Mapping[str, Any], special: Mapping[str, Callable]) -> Any:
    """`cls` from a JSON object: missing fields take their default, unknown keys are ignored."""
    if not isinstance(data, Mapping):
        raise ValueError(f"expected a JSON object for {cls.__name__}, got {data!r}")
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"{cls.__name__} field {f.name!r} is missing")
            continue
        value = data[f.name]
        if f.name in special and value is not None:
            value = special[f.name](value)
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def encode_state(state: RunState) -> str:
    """The state file's text: strict JSON (no NaN), UTF-8, one key per line."""
    data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "status": state.status.value}
    data.update(_encode_fields(state, _ENCODE))
    return json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False) + "\n"


class NewerStateError(ValueError):
    """The state file was written by a newer torchinstruments (a schema this one cannot read)."""


def decode_state(text: str) -> RunState:
    """A `RunState` from the state file's text.

    Raises:
        NewerStateError: if its schema version is newer than `SCHEMA_VERSION`.
        ValueError: if it is not a state file (bad JSON, a missing field, a wrong shape).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{STATE_FILE} is not JSON ({error})") from error
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int):
        raise ValueError(f"{STATE_FILE} has no schema_version")
    if data["schema_version"] > SCHEMA_VERSION:
        raise NewerStateError(
            f"{STATE_FILE} has schema version {data['schema_version']}, newer than this "
            f"torchinstruments reads ({SCHEMA_VERSION}); use the version that wrote the run"
        )
    try:
        return _decode_fields(RunState, data, _DECODE)
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{STATE_FILE} is malformed ({type(error).__name__}: {error})") from error


def write_state(directory: Path, state: RunState) -> None:
    """Write `directory/.state.json` atomically (`replace_atomically`)."""
    write_text_atomic(directory / STATE_FILE, encode_state(state))


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
    "SCHEMA_VERSION",
    "LostRows",
    "NewerStateError",
    "RunState",
    "Status",
    "decode_run_info",
    "decode_state",
    "encode_state",
    "read_state",
    "write_state",
]
