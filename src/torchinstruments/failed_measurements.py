"""Tensors whose measurement failed: warned once per layer and kind, and named in index.md.

A failure inside measurement (a custom reducer that raised, the default statistics failing, a
tensor subclass refusing a read) never breaks the user's step: the tensor's rows are null with
a reason (`reasons.error`: `reducer error: ...`, `statistics error: ...`, `measurement error:
...`), and the other tensors keep theirs. Those rows alone said nothing while the run went on,
and index.md only explained the reason's template: a reducer failing on every sample of one
layer looked like a run that had recorded it (design: never silent).

Design decision: the measurement code stays as it is (it runs per tensor, and measures many
tensors on paths that must not warn); the records are read where they are handed to the sinks
(`recording.Recording`'s emissions, forward and backward), one scan per record. The scan costs one
C-level count of the record's null reasons, which is all a record without any reason pays; only
a record holding reasons looks at their distinct texts, and only one holding a failure walks its
rows. Each (kind, layer) is warned once, with the error, for the first `SHOWN_KINDS` of them
(then one warning that more follow, in index.md); index.md gets one note per kind of failure
naming every layer (the first `_SHOWN`), its signals and metrics, and in how many samples. A
kind is the reason's source and error type (`reducer error: ValueError`), so an error whose
message changes with each tensor is still one kind; the note quotes the first reason seen.
Samples are counted per (kind, layer, signal) as changes of sample id, so a sample whose
gradients came in two backward passes with another sample's between counts twice (rare).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

from torchinstruments.capture import WarnOnce
from torchinstruments.notices import SHOWN_KINDS
from torchinstruments.reasons import MODIFIED_INPUT_END, NO_VALUE
from torchinstruments.records import Measurement, MeasurementBlock, SampleRecord
from torchinstruments.rundir.ranges import listed
from torchinstruments.rundir.shell import (
    code_span,
    layer_span,
    literal_if_unclear,
    literal_span,
    repr_if_unclear,
)

__all__ = ["FAILURE_PREFIXES", "FailedMeasurements"]

# The reasons of a failure inside measurement (`reasons.error`), as opposed to a tensor that has
# no value to give (empty, no finite entries): those are the tensor's, and explained in index.md.
# A custom reducer that returned what cannot be a metric (`reasons.reducer_returned`,
# `reducer_value`, `reducer_tensor_*`: a string, the whole tensor) failed too: its null rows
# were said nowhere else; so did one that left out a metric its `metrics` names
# (`reasons.reducer_left_out`), and one that wrote into its argument (`reasons.MODIFIED_INPUT_END`:
# its kind is its whole reason, which names it; the measurer warned once per reducer, so its layers
# are named in index.md, not warned again). Not `reasons.NO_VALUE`: the built-in reducers give no
# value for an empty tensor, which is the tensor's.
FAILURE_PREFIXES = (
    "reducer error: ",
    "statistics error: ",
    "measurement error: ",
    _UNUSABLE := "reducer returned ",
    _LEFT_OUT := "reducer left out ",
)
# The kinds of those (their texts name a metric, a type or a shape that differ per tensor).
_UNUSABLE_KIND = "reducer returned a value that cannot be a metric"
_LEFT_OUT_KIND = "reducer left out a metric its metrics name"


def _is_failure(reason: str | None) -> TypeGuard[str]:
    """Whether a null row's `reason` is a failure inside measurement (see FAILURE_PREFIXES)."""
    if reason is None or reason == NO_VALUE:
        return False
    return reason.startswith(FAILURE_PREFIXES) or reason.endswith(MODIFIED_INPUT_END)


def _kind(reason: str) -> str:
    """A failure's kind: its source and error type (`reducer error: ValueError`)."""
    if reason.startswith(_UNUSABLE):
        return _UNUSABLE_KIND
    if reason.startswith(_LEFT_OUT):
        return _LEFT_OUT_KIND
    if reason.endswith(MODIFIED_INPUT_END):
        return reason
    return ": ".join(reason.split(": ", 2)[:2])


# How many layers one kind's note names before it says how many more.
_SHOWN = 20


@dataclass(slots=True)
class _Tally:
    """One layer's failures of one kind on one signal: its metrics and samples so far."""

    metrics: dict[str, None] = field(default_factory=dict)  # an ordered set
    samples: int = 0
    latest: int = -1


class FailedMeasurements:
    """The failures inside measurement that records show, per kind, layer and signal.

    Args:
        warn_once: warns `(key, message)` once per key (the observer's).
        extra_keys: the reducers that returned keys beyond their metrics, which are not
            recorded (`Measurer.extra_keys`, live: name -> (metrics, quoted keys)); index.md
            names them in one note.
    """

    def __init__(
        self,
        warn_once: WarnOnce,
        extra_keys: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] | None = None,
    ) -> None:
        self._warn_once = warn_once
        self._extra_keys = extra_keys if extra_keys is not None else {}
        self._lock = threading.Lock()  # `notes` is read by the flush thread
        self._first: dict[str, str] = {}  # kind -> its first reason, in the order seen
        self._tallies: dict[tuple[str, str, str], _Tally] = {}  # (kind, layer, signal)
        self._warned: set[tuple[str, str]] = set()  # (kind, layer)

    def scan(self, records: Iterable[SampleRecord], extra: Sequence[Measurement] = ()) -> None:
        """Take note of the failures in `records` and in the rows `extra` (a sample's global
        and marker rows); warn about each (kind, layer) first seen. Never raises."""
        try:
            for record in records:
                rows = record.measurements
                if type(rows) is MeasurementBlock:
                    self._scan_block(rows)
                else:
                    self._scan_rows(rows)
            if extra:
                self._scan_rows(extra)
        except Exception:  # telling of failures must never add one to the user's step
            return

    def _scan_block(self, block: MeasurementBlock) -> None:
        """A block's failures; nothing beyond one count of its null reasons where it has none."""
        why = block.reasons
        if why.count(None) == len(why):
            return
        failed = {r for r in set(why) if _is_failure(r)}
        if not failed:
            return
        k = len(block.metrics)
        for index, reason in enumerate(why):
            if reason is not None and reason in failed:
                layer, metric = block.layers[index // k], block.metrics[index % k]
                self._add(reason, layer, block.signal, metric, block.sample_id)

    def _scan_rows(self, rows: Sequence[Measurement]) -> None:
        """Rows one by one (a record with marker or global rows, a sink's own sequence)."""
        for row in rows:
            for name, value in zip(row.metrics, row.values, strict=True):
                reason = value.reason
                if _is_failure(reason):
                    self._add(reason, row.layer, row.signal, name, row.sample_id)

    def _add(self, reason: str, layer: str, signal: str, metric: str, sample_id: int) -> None:
        """Count one failed metric of one tensor; warn the first time its (kind, layer) fails."""
        kind = _kind(reason)
        with self._lock:
            self._first.setdefault(kind, reason)
            tally = self._tallies.setdefault((kind, layer, signal), _Tally())
            tally.metrics.setdefault(metric)
            if tally.latest != sample_id:
                tally.latest = sample_id
                tally.samples += 1
            if reason.endswith(MODIFIED_INPUT_END):  # warned by the measurer, once per reducer
                return
            new = (kind, layer) not in self._warned
            self._warned.add((kind, layer))
            count = len(self._warned)
        if not new or count > SHOWN_KINDS + 1:
            return
        if count == SHOWN_KINDS + 1:
            self._warn_once(
                "failed_measurements:more",
                f"more layers than the first {SHOWN_KINDS} warned about could not be measured; "
                "index.md names them, and their rows are null with the error as the reason",
            )
            return
        self._warn_once(
            f"failed_measurements:{kind}:{layer}",
            f"layer {layer or '<root>'!r} could not be measured ({signal} of sample {sample_id}, "
            f"metric {metric!r}): {literal_if_unclear(reason)}; its rows are null with that "
            "reason (warned once per layer and kind of error; index.md counts them)",
        )

    def notes(self) -> tuple[str, ...]:
        """index.md's notes: one per kind of failure, naming its layers, signals, metrics and
        sample counts."""
        with self._lock:
            first = dict(self._first)
            tallies = [
                (key, list(tally.metrics), tally.samples) for key, tally in self._tallies.items()
            ]
        notes = []
        for kind, reason in first.items():
            per_layer: dict[str, list[str]] = {}
            for (of, layer, signal), metrics, samples in tallies:
                if of == kind:
                    said = f"{signal}: {', '.join(metrics)} in {_samples(samples)}"
                    per_layer.setdefault(layer, []).append(said)
            shown = [f"{layer_span(layer)} ({'; '.join(s)})" for layer, s in per_layer.items()]
            why = literal_span(kind) + (
                "" if kind == reason else f", first as {literal_span(reason)}"
            )
            notes.append(
                f"Not measured ({why}) in {len(shown)} "
                f"layer{'' if len(shown) == 1 else 's'}: those metrics are null with the error as "
                f"the reason (the other metrics and tensors keep their own rows): "
                f"{listed(shown, _SHOWN)}."
            )
        extra = _extra_keys_note(dict(self._extra_keys))
        return tuple(notes) if extra is None else (*notes, extra)


def _extra_keys_note(
    extra_keys: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]],
) -> str | None:
    """index.md's note on the reducers that returned keys beyond their metrics, or None."""
    if not extra_keys:
        return None
    said = [
        f"{literal_span(name)} returned {', '.join(map(_key_span, keys))} beyond its metrics "
        f"{', '.join(literal_span(metric) for metric in metrics)}"
        for name, (metrics, keys) in extra_keys.items()
    ]
    return (
        f"Not recorded: {len(said)} custom reducer{'' if len(said) == 1 else 's'} returned keys "
        f"beyond {'its' if len(said) == 1 else 'their'} `metrics`, which only names what is "
        f"recorded (name a key there to record it): {listed(said, _SHOWN)}."
    )


def _key_span(key: str) -> str:
    """A key a reducer returned, quoted already (`repr`), in a code span; a repr that is not
    printable text (an object's own, with a line break) as its literal. The `... (n more)` that
    ends a long list stays prose."""
    if key.startswith("... (") and key.endswith(" more)"):
        return key
    return code_span(repr_if_unclear(key))


def _samples(count: int) -> str:
    """`1 sample`, `3 samples`."""
    return f"{count} sample{'' if count == 1 else 's'}"
