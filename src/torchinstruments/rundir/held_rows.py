"""The rows a history writer holds until a part takes them, under the memory cap.

Bounded memory when writes fail: rows that could not be written stay buffered and are retried
(at the next chunk boundary, after half a flush interval, at removal), but at most
`max_buffered_rows` of them (about 57 bytes a row as the observer records them, `uv run
bench/many_layers.py --buffer-memory`; at most ~175 for other measurements: ~7 to 22 MiB at the
default). Beyond the cap the *newest* rows are dropped, each counted in the loss ledger (`rundir.ledger`) with its sample and
why. Newest, not oldest: the buffered rows are the oldest unwritten ones, contiguous with what
is already on disk, so the history keeps one gap per failure episode whose first sample is
known; dropping costs nothing on the training thread (no list is shifted), and when the disk
frees, everything still buffered lands. A sample that keeps some rows and loses others is
marked (`rundir.cap_cuts`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torchinstruments.notices import warn
from torchinstruments.records import Measurement, MeasurementBlock
from torchinstruments.rundir.buffered_records import BufferedRecords
from torchinstruments.rundir.cap_cuts import CapCuts
from torchinstruments.rundir.columns import ColumnBuffer
from torchinstruments.rundir.ledger import LossLedger
from torchinstruments.rundir.write_notices import cap_drop_reason, cap_drop_warning

__all__ = ["HeldRows"]


class HeldRows:
    """The buffered rows, which samples they belong to, and the loss ledger: rows taken while
    they fit under the cap, the newest dropped and counted beyond it (see the module docstring).

    Not thread-safe: the writer (`rundir.writer.HistoryWriter`) calls it under its lock, and
    reads and resets its fields there (a part taking rows, the end of a failure episode).

    Args:
        cap: the most rows held (`HistoryConfig.buffered_rows_cap`); markers of cut samples go
            beyond it.
    """

    def __init__(self, cap: int) -> None:
        self.buffer = ColumnBuffer()
        self.records = BufferedRecords()  # which samples the buffered rows belong to
        self.ledger = LossLedger()
        self.rows_produced = 0  # rows recorded, dropped ones included
        # monotonic time at which the oldest buffered row was measured (its record's `since`);
        # None when empty
        self.oldest: float | None = None
        self.drop_reason: str | None = None  # the current episode's, fixed at its first drop
        self._cap = cap
        self._cuts = CapCuts(cap)  # samples cut at the cap, to mark
        self._warned_drop = False

    def add_block(
        self, block: MeasurementBlock, start: int, *, failing: bool, error: str | None
    ) -> int | None:
        """A block's tensors from `start`: in as few chunks as the cap allows; where
        the buffer is full while writes work, the tensor to go on from once there is room, else
        None."""
        cap = self._cap
        k = len(block.metrics)
        total = len(block)
        while start < total:
            size = len(self.buffer)
            fit = min(total - start, (cap - size) // k) if k else total - start
            if fit <= 0 and size and not failing:  # only a very large sample got here
                return start
            if fit <= 0:
                self.rows_produced += (total - start) * k
                self._drop((total - start) * k, block.sample_id, error)
                self._mark_cut(self._cuts.noted(block.sample_id, block.signal, False, block, start))
                return None
            rows = self.buffer.add_block(block, start, start + fit)
            self.rows_produced += rows
            self._note_rows(block.sample_id, block.signal, rows, block.timestamps_us[start])
            self._mark_cut(self._cuts.noted(block.sample_id, block.signal, True, block, start))
            start += fit
        return None

    def add_measurements(
        self,
        measurements: Sequence[Measurement],
        start: int,
        *,
        failing: bool,
        error: str | None,
    ) -> int | None:
        """Plain measurements from `start`, one by one against the cap; the
        accepted ones become one chunk. Where the buffer is full while writes work, the
        measurement to go on from once there is room, else None.

        The chunk is built (a Polars call, where a KeyboardInterrupt can land) before anything
        is counted, so an interrupted append leaves the buffer and its counts as they were."""
        cap = self._cap
        size = len(self.buffer)  # kept by hand, with the accepted rows not yet in a chunk
        accepted: list[Measurement] = []
        dropped: list[Measurement] = []
        going_on: int | None = None
        for index in range(start, len(measurements)):
            m = measurements[index]
            k = len(m.metrics)
            if size + k > cap and size and not failing:  # only a very large sample
                going_on = index
                break
            if size + k > cap:
                dropped.append(m)
                continue
            accepted.append(m)
            size += k
        self.buffer.add_measurements(accepted)
        for m in accepted:
            self.rows_produced += len(m.metrics)
            self._note_rows(m.sample_id, m.signal, len(m.metrics), m.timestamp_us)
            self._mark_cut(self._cuts.noted(m.sample_id, m.signal, True, (m,), 0))
        for m in dropped:
            self.rows_produced += len(m.metrics)
            self._drop(len(m.metrics), m.sample_id, error)
            self._mark_cut(self._cuts.noted(m.sample_id, m.signal, False, (m,), 0))
        return going_on

    def _mark_cut(self, marker: Measurement | None) -> None:
        """Buffer the marker row of a sample cut at the cap (`rundir.cap_cuts`), beyond the
        cap."""
        if marker is not None:
            self.buffer.add_measurements([marker])
            self.rows_produced += 1
            self._note_rows(marker.sample_id, marker.signal, 1, marker.timestamp_us)

    def _note_rows(self, sample_id: int, signal: str, rows: int, first_us: int) -> None:
        """Count `rows` more buffered rows of this sample and signal, the first measured at
        wall time `first_us` (for a part's split record, and the age of the oldest buffered row)."""
        self.records.note(sample_id, signal, rows, first_us)
        if self.oldest is None:
            self.oldest = self.records.oldest()

    def _drop(self, rows: int, sample_id: int, error: str | None) -> None:
        """Count one measurement's rows as lost at the memory cap."""
        cap = self._cap
        if self.drop_reason is None:
            self.drop_reason = cap_drop_reason(cap, error)
        self.ledger.add(rows, sample_id, sample_id, self.drop_reason)
        if not self._warned_drop:
            self._warned_drop = True
            warn(cap_drop_warning(cap, error))
