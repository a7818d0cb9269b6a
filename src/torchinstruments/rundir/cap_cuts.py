"""Samples cut at the memory cap: a sample that kept some rows and lost others is marked.

While history parts cannot be written, the writer (`rundir.writer`) drops the newest rows beyond
`max_buffered_rows`. A sample whose rows straddle that moment (the buffer filled in the middle of
its rows, or its forward was dropped and its backward kept once writes worked again) would look
like an ordinary sample with some layers or a signal missing. Design decision: the writer tells
`CapCuts` of every kept and dropped record, and the first time one sample has both, it gets one
marker row (`records.INTERRUPTED`, layer `""`, `reasons.dropped_at_cap`), which the writer
buffers beyond the cap. Each marker stands for kept rows already in the buffer, so markers add
at most as many rows as the cap, in practice one or two per failure episode (the samples at its
edges). The cost: three short deques of the latest sample ids, looked at per record appended.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence

from torchinstruments import reasons
from torchinstruments.records import INTERRUPTED, Measurement, MetricValue

__all__ = ["CapCuts"]

# How many of the latest samples are remembered as kept, dropped and marked: the samples whose
# rows reach the writer interleaved (a forward's, then its backward's) are far fewer.
RECENT_SAMPLES = 16


class CapCuts:
    """The latest samples with rows kept, with rows dropped at the cap, and those marked.

    Args:
        cap: `max_buffered_rows` in force, named in the marker's reason.
    """

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._kept: deque[int] = deque(maxlen=RECENT_SAMPLES)
        self._dropped: deque[tuple[int, str]] = deque(maxlen=RECENT_SAMPLES)  # with the signal
        self._marked: deque[int] = deque(maxlen=RECENT_SAMPLES)

    def noted(
        self,
        sample_id: int,
        signal: str,
        kept: bool,
        measurements: Sequence[Measurement],
        index: int,
    ) -> Measurement | None:
        """Rows of this sample and signal were kept (or dropped); the sample's marker row when
        it now has both for the first time, built from `measurements[index]` (built only then:
        a block's measurement is made on access), else None."""
        if kept:
            if not self._kept or self._kept[-1] != sample_id:
                self._kept.append(sample_id)
            dropped = next((s for i, s in self._dropped if i == sample_id), None)
        else:
            if not self._dropped or self._dropped[-1][0] != sample_id:
                self._dropped.append((sample_id, signal))
            dropped = signal if sample_id in self._kept else None
        if dropped is None or sample_id in self._marked:
            return None
        self._marked.append(sample_id)
        return _marker(measurements[index], dropped, self._cap)


def _marker(row: Measurement, signal: str, cap: int) -> Measurement:
    """The marker row of a sample cut at the cap: `row`'s sample facts, layer `""`."""
    return dataclasses.replace(
        row,
        timestamp_us=time.time_ns() // 1000,
        layer="",
        module_type="",
        call_index=0,
        signal=signal,
        tensor_path="",
        shape=None,
        dtype="",
        metrics=(INTERRUPTED,),
        values=(MetricValue(None, reasons.dropped_at_cap(cap)),),
        placement=None,
        mesh_coordinate=None,
        population=None,
    )
