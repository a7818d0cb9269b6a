"""The live history writer: a buffer of recorded rows and atomic Parquet parts.

Design decision: during training, measurements go into a buffer (`columns.ColumnBuffer`: the
observer's blocks as they are, other measurements as DataFrame chunks) and leave it as one Parquet
part per `buffer_rows` rows, written under a temporary name in the run directory (never inside
`history.parts/`, so a live reader of it sees completed parts only) and renamed into place.
Per-sample work does not depend on how much history was already written (a block is kept,
not converted, until a part takes it), and a reader (or a crash) never sees a half-written part.
The cost: rows not yet in a part live in memory and are lost if the process dies.

Loss on a crash is bounded by time, not rows: a part is also written once the oldest buffered row
is `flush_seconds / 2` old, so every row measured more than `flush_seconds` before a crash is in a
part (the half interval of slack absorbs a slow part write or a busy CPU). The age is that of
the oldest row still buffered: each buffered record (a sample's rows of one signal) keeps when
its first row was measured, and after a part the oldest record left sets the age. Rows appended
while a part was written are therefore due half an interval after they were measured, not at
once: with the age of the rows the part took, a run sampled continuously wrote tiny parts back
to back (hundreds in seconds) after its first time-triggered part, instead of one per half
interval. The time bound comes before the row bound: once the oldest row is due, every
buffered row goes in as few parts as fit, full chunks still waiting included (a part may then
hold more than `buffer_rows` rows), so a small `buffer_rows` writing part after part behind
the rows still keeps to `flush_seconds`. A row-count trigger
alone bounds nothing in time: at the default sampling of one sample per minute, 8,192 rows (the
default before 65,536) were about 90 minutes of history held only in memory.

Design decision: the time trigger runs on a daemon thread (`rundir.flush_timer.FlushTimer`), not
on the training path. A check at each sample or root forward only runs while the model is called, so a run that
stops sampling (a long evaluation of another model, a stalled data loader, a hang before the
crash) would keep its buffer in memory without bound. The thread sleeps on a queue until the
oldest buffered row is due (no periodic wake-ups; an idle run costs nothing), so the cost is one
idle thread per run, one `SimpleQueue.put` per sample, and a lock around the buffer (uncontended
except while a part is written). The price on disk is more, smaller parts: at the defaults and one
sample per minute, one part per sample, 1,440 parts a day (bench/merge_parts.py measures what
that costs the merge).

Design decision: the run directory's writer (`chunks_elsewhere`) has that thread write the full
`buffer_rows` chunks too, so a sampled step never waits for a disk: a part of 8,192 rows took the
training thread about 13 ms (its frame 4, its metadata 1.5, Polars' writing and three fsyncs
6.5), once every 27 steps of bench/sampled.py's MLP sampled at every step, or six times a step
for a 3,000-layer model. Most of that is paid per part, not per row, which is why the default
part is 65,536 rows (`HistoryConfig`). No part is written on the training thread: the run's
first forward and backward rows, written at once, are handed to that thread too, and waited for
a bounded time (`sinks.directory`); a step that finds the buffer full waits for that thread to
make room, at most half a flush interval (`_make_room`): a part write that has not returned by
then (a stalled network file system) counts as failing, so the step goes on and the rows beyond
the cap are dropped and counted. One writer at a time (`_writing`); the buffer's lock
is held while a part's rows become a frame and while they leave the buffer, never while it is
written, so appends go on meanwhile (after them).

Bounded memory when writes fail: rows that could not be written stay buffered and are retried
(at the next chunk boundary, after half a flush interval, at removal), up to the cap that
`rundir.held_rows` keeps (beyond it the newest rows are dropped and counted). A retry writes the
whole backlog in as few parts as fit (one part, or halves of it when one part does not fit), not
in `buffer_rows` pieces: one large part compresses better, so a nearly full disk takes more rows.

A sample's rows can straddle a part boundary. Each part records in its Parquet metadata
(`SPLIT_RECORD_KEY`) the record its last rows belong to when the rest of that record is still in
memory, so after a SIGKILL `finalize` can tell a sample that is only partly on disk. It also
records its order (`layout.ORDER_KEY`) and the columns that hold one value in all its rows
(`layout.CONSTANT_KEY`, about 0.35 ms for 8,192 rows), which the merge streams as literals.

Merging the parts into history.parquet is not this module's job: see `rundir.merge`, called by
the one end-of-run routine in `rundir.finish`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import polars as pl

from torchinstruments.history_config import HistoryConfig
from torchinstruments.notices import warn
from torchinstruments.records import Measurement, MeasurementBlock
from torchinstruments.rundir.buffered_records import SPLIT_RECORD_KEY
from torchinstruments.rundir.held_rows import HeldRows
from torchinstruments.rundir.layout import (
    PARTS_DIR,
    constant_metadata,
    list_parts,
    order_metadata,
    part_number,
    part_path,
    part_tag,
    write_parquet_atomic,
)
from torchinstruments.rundir.ledger import LostRows
from torchinstruments.rundir.part_write import PartLanding, write_until_it_ends
from torchinstruments.rundir.shell import error_said
from torchinstruments.rundir.write_notices import (
    kept_rows_given_up,
    part_failed_warning,
)

__all__ = [
    "SPLIT_RECORD_KEY",
    "HistoryWriter",
]


class HistoryWriter:
    """Appends measurements to the buffer and writes parts by size and by age.

    A part is written when the buffer holds `buffer_rows` rows (by the appending thread, or with
    `chunks_elsewhere` by the caller of `write_due`: the run's `FlushTimer`) or when its oldest
    row is `flush_seconds / 2` old (by the `FlushTimer`, through `seconds_until_due`).
    Nothing raised while writing a part reaches the caller: an `OSError` or a Polars error (disk
    full, permission) is reported once as a `RuntimeWarning`, the rows stay in the buffer (up to
    `max_buffered_rows`; newer rows are dropped and counted in `losses`) and are retried at the
    next chunk boundary, after half a flush interval, and at `close()`. A row whose fields cannot
    be stored (a shape that is not ints, a value that is not a number) is stored with a null
    shape or a null value and a reason, never blocking the rows around it.

    Thread-safe: `append` (training thread), `write_due` (flush thread) and `flush` (flush
    thread, signal handler's thread, `close`): one lock for the buffer, one for part writers.

    Args:
        directory: the run's output directory; `history.parts/` is created inside it.
        config: buffer size, memory cap, flush interval and summary window.
        attempt: the `attempt` column of every row (this process's attempt, `rundir.attempts`).
        first_part: the number of the first part (a continued run's parts follow the merged
            ones).
        chunks_elsewhere: full chunks are left to `write_due` (`seconds_until_due` says they
            are due at once) instead of being written by `append`.

    Example:
        >>> writer = HistoryWriter(Path("stats"), HistoryConfig(buffer_rows=65536))
        >>> writer.append(sample_record.measurements)  # doctest: +SKIP
        >>> writer.close()  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        directory: Path,
        config: HistoryConfig,
        *,
        attempt: int = 0,
        first_part: int = 0,
        chunks_elsewhere: bool = False,
    ) -> None:
        self._directory = directory
        self._config = config
        self._chunks_elsewhere = chunks_elsewhere
        self._attempt = pl.lit(attempt, dtype=pl.Int32()).alias("attempt")
        self._tag = part_tag(attempt)  # its parts' temporary names (`layout.part_temporary_path`)
        (self._directory / PARTS_DIR).mkdir(parents=True, exist_ok=True)
        existing = [part_number(p) for p in list_parts(self._directory)]
        # after both the parts left here (an unreadable one `finalize` kept) and the merged ones:
        # a number history.parquet lists as merged would have this part deleted unread
        after = max((n for n in existing if n is not None), default=-1) + 1
        self._next_part = max(after, first_part)
        self._held = HeldRows(config.buffered_rows_cap)  # the buffer, its samples, the ledger
        self._lock = threading.Lock()  # the buffer and the counts; never held while writing
        self._room = threading.Condition(self._lock)  # notified when a part write ends
        # Wakes the thread that writes full chunks (with `chunks_elsewhere`; its owner sets it).
        self.wake_writer: Callable[[], None] | None = None
        self._writing = threading.Lock()  # one part writer at a time; taken before `_lock`
        self._landing = PartLanding()  # a part's rename and its rows leaving; before `_lock`
        self.writing_part: Path | None = None  # the part whose write is in progress (read only)
        self._rows_written = 0
        self._retry_at = config.buffer_rows
        self._retry_after = 0.0  # monotonic; no timed retry before it after a failed write
        self._error: str | None = None
        self._failing = False  # between a failed part write and the next successful one
        self._saved_version = 0  # the ledger version last written into the run state
        self._save_after = 0.0  # monotonic; no new attempt to save the ledger before it
        self._warned = False
        self._closed = False

    @property
    def directory(self) -> Path:
        """The run's output directory."""
        return self._directory

    @property
    def rows_produced(self) -> int:
        """Rows recorded so far (one per metric of each measurement), dropped ones included."""
        return self._held.rows_produced

    @property
    def rows_written(self) -> int:
        """Rows that are in completed parts on disk."""
        return self._rows_written

    @property
    def rows_buffered(self) -> int:
        """Rows in memory, not yet in a part."""
        return len(self._held.buffer)

    @property
    def losses(self) -> tuple[LostRows, ...]:
        """The loss ledger: rows recorded but not written (dropped at the cap, or unwritable at
        `close`), as sample ranges with their reasons."""
        with self._lock:
            return self._held.ledger.entries

    @property
    def rows_lost(self) -> int:
        """Rows in `losses`."""
        with self._lock:
            return self._held.ledger.rows

    @property
    def failing_error(self) -> str | None:
        """Why part writes fail now (`Type: message`), None while they work."""
        return self._error if self._failing else None

    @property
    def last_error(self) -> str | None:
        """The last part-write failure (`Type: message`), or None if every write succeeded."""
        return self._error

    def append(self, measurements: Sequence[Measurement]) -> None:
        """Buffer one row per metric of each measurement; write full chunks as parts.

        Beyond `max_buffered_rows` buffered rows a measurement's rows are dropped and counted in
        `losses` (`rundir.held_rows`).

        Args:
            measurements: the measurements of one sample (a `MeasurementBlock`, as the observer
                records them, or any sequence of them).

        Raises:
            RuntimeError: if the writer was closed.
        """
        if self._closed:
            raise RuntimeError("HistoryWriter.append() after close(); create a new writer")
        if not measurements:
            return
        start: int | None = 0
        due = False
        while start is not None:
            with self._lock:
                if isinstance(measurements, MeasurementBlock):
                    start = self._held.add_block(
                        measurements, start, failing=self._failing, error=self._error
                    )
                else:
                    start = self._held.add_measurements(
                        measurements, start, failing=self._failing, error=self._error
                    )
                due = len(self._held.buffer) >= self._retry_at
            if start is not None:  # full while writes work: room first, the whole backlog
                self._make_room()
        if due and not self._chunks_elsewhere:
            with self._writing:
                self._write_chunks()

    def unsaved_losses(self, *, now: bool = False) -> tuple[int, tuple[LostRows, ...]] | None:
        """`(version, losses)` when the ledger changed since it was last saved and parts can be
        written again (so the run state probably can too), or at once with `now`; else None,
        always once closed (the run's final state holds them)."""
        with self._lock:
            ledger = self._held.ledger
            if ledger.version == self._saved_version or self._closed:
                return None
            if not now and (self._failing or time.monotonic() < self._save_after):
                return None
            return ledger.version, ledger.entries

    def losses_saved(self, version: int) -> None:
        """The ledger as of `version` is in the run state."""
        with self._lock:
            self._saved_version = max(self._saved_version, version)

    def losses_not_saved(self) -> None:
        """Saving the ledger failed: try again after half a flush interval."""
        with self._lock:
            self._save_after = time.monotonic() + self._config.flush_seconds / 2

    def seconds_until_due(self) -> float | None:
        """Seconds until the buffered rows must be written, or the loss ledger saved (<= 0:
        now); None when there is nothing to do."""
        now = time.monotonic()
        save = None
        if self._held.ledger.version != self._saved_version and not self._failing:
            save = self._save_after - now
        if self._chunks_elsewhere and len(self._held.buffer) >= self._retry_at:
            return 0.0  # a full chunk waits (`write_due`)
        due = self._aged_in(now)
        if due is None:
            return save
        return due if save is None else min(due, save)

    def _aged_in(self, now: float) -> float | None:
        """Seconds from `now` until the buffered rows are due by age (<= 0: due), None when
        nothing is buffered: the oldest half a flush interval old, not before a retry is."""
        oldest = self._held.oldest
        if oldest is None:
            return None
        return max(oldest + self._config.flush_seconds / 2, self._retry_after) - now

    def flush(self) -> None:
        """Write every row buffered now in as few parts as fit; failures warn, never raise."""
        with self._writing:
            self._write_backlog()

    def _make_room(self) -> None:
        """`append`'s turn when the buffer is full while writes work: with `chunks_elsewhere`,
        the flush thread is woken (`wake_writer`) and waited for at most half a flush interval.
        If it made no room by then, writes count as failing, so the rows beyond the cap are
        dropped and counted instead of the step waiting without end; the next part written
        ends the episode, as any write does. Never written here: a part write in progress that
        has not returned (a file system that stopped answering) would block this thread too,
        and so would one of its own where the flush thread is stuck in another write (the
        run state, `sinks.directory`). Without `chunks_elsewhere` this thread writes itself."""
        if not self._chunks_elsewhere:
            self.flush()
            return
        if self.wake_writer is not None:
            self.wake_writer()
        seconds = self._config.flush_seconds / 2
        with self._room:
            written = self._rows_written
            if self._room.wait_for(
                lambda: self._failing or self._rows_written != written, timeout=seconds
            ):
                return
            busy = self.writing_part is not None
            self._error = (
                f"a part write had not returned after {seconds:g} s"
                if busy
                else f"the flush thread had written no part after {seconds:g} s"
            )
            self._failing = True

    def write_due(self) -> bool:
        """Write what is due, on the thread that calls it (with `chunks_elsewhere`, the flush
        thread): full `buffer_rows` chunks once they wait, then every buffered row once the
        oldest is half a flush interval old. Once it is, the chunks still waiting go with it,
        in as few parts as fit: chunk after chunk, a small `buffer_rows` (1) fell behind rows
        recorded faster than parts are written (a fixed cost each), and the oldest waited
        without bound, lost to a SIGKILL long after `flush_seconds`. Whether more than full
        chunks was due (the time bound's turn). Failures warn, never raise."""
        with self._writing:
            chunks = len(self._held.buffer) >= self._retry_at
            if chunks:
                self._write_chunks(stop=self._aged)
            if self._aged():
                self._write_backlog()
                return True
            return not chunks  # nothing buffered was due: the loss ledger's turn

    def _aged(self) -> bool:
        """Whether the buffered rows are due by age (`_aged_in`)."""
        due = self._aged_in(time.monotonic())
        return due is not None and due <= 0

    def give_up(self, why: str, wait_s: float) -> bool:
        """Write no part from now on (`why`: one that hangs); `close` counts the rows left as
        not written, for that reason (`rundir.part_write.PartLanding.give_up`)."""
        return self._landing.give_up(why, wait_s)

    def close(self, *, write: bool = True) -> bool:
        """Write every buffered row; the writer takes no rows afterwards.

        Args:
            write: False where the last write ran on another thread (`FlushTimer.finish`) or
                was given up (`give_up`): one here would block on a stalled file system.

        Returns:
            True when every row produced is in a part on disk. False when some could not be
            written (already warned): rows still buffered are then counted in `losses`, and
            `last_error` (or the reason given to `give_up`) says why.
        """
        if self._closed:
            return not len(self._held.buffer) and not self._held.ledger.rows
        self._closed = True
        if write and self._landing.given_up is None:  # else `_writing` is held for good
            self.flush()
        with self._lock:
            ids = self._held.buffer.sample_range()
            if ids is not None:
                failed = f"the last attempt to write them failed ({self._error})"
                why = self._landing.given_up or failed
                if self._held.drop_reason is not None:  # no longer "kept and retried"
                    self._held.ledger.reword(
                        self._held.drop_reason, kept_rows_given_up(self._held.drop_reason)
                    )
                self._held.ledger.end_episode()
                self._held.ledger.add(
                    len(self._held.buffer), ids[0], ids[1], f"not written at removal: {why}"
                )
            return not self._held.ledger.rows

    def _write_chunks(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Write full `buffer_rows` chunks; stop at the first failure, or once `stop` says
        (`write_due`: the rows are due by age, and the whole backlog goes at once). The caller
        holds `_writing`."""
        size = self._config.buffer_rows
        while len(self._held.buffer) >= size:
            if stop() or not self._write_part(size):
                return
        self._retry_at = size

    def _write_backlog(self) -> bool:
        """Write the rows buffered now (those appended meanwhile wait) in as few parts as fit:
        all at once, else halves (down to 1/64 of them); stop at the first size that fails. The
        caller holds `_writing`."""
        left = rows = len(self._held.buffer)
        smallest = max(1, rows // 64)
        while left:
            rows = min(rows, left)
            if self._write_part(rows):
                left -= rows
                continue
            if rows <= smallest:
                return False
            rows = max(smallest, rows // 2)
        self._retry_at = self._config.buffer_rows
        return True

    def _write_part(self, n: int) -> bool:
        """Write the first `n` buffered rows as the next part; False (warned once) on failure.

        The caller holds `_writing`. The rows become a frame under `_lock`, the part is written
        without it (the training thread appends meanwhile, after them), and they leave the
        buffer under it as the part lands (`rundir.part_write`), never before: whatever is
        raised on the way (BaseException included), the buffer still holds them, and they are
        written once. What is raised, and what is tried again, is `write_until_it_ends`'s: any
        exception but the user's Ctrl-C counts as a failed write (warned once, retried later),
        so nothing raised here ends the flush thread or reaches the training step. After
        `give_up` nothing is written.
        """
        number = self._next_part  # only this writer moves it on
        path = part_path(self._directory, number)
        if self._landing.given_up is not None:
            return False
        written = functools.partial(self._written, n, number)
        rename = functools.partial(self._landing.rename, written=written)
        self.writing_part = path
        try:
            return write_until_it_ends(
                path,
                functools.partial(self._write_frame, n, path, rename),
                written,
                functools.partial(self._failed, path),
            )
        finally:
            self.writing_part = None

    def _write_frame(self, n: int, path: Path, rename: Callable[[Path, Path], None]) -> None:
        """Write the first `n` buffered rows to `path` (put in place by `rename`); the buffer
        keeps them until then."""
        with self._lock:
            frame = self._held.buffer.frame(n)
            split = self._held.records.split_metadata(n)
        frame = frame.with_columns(self._attempt)
        metadata = order_metadata(frame) | constant_metadata(frame) | split
        write_parquet_atomic(frame, path, metadata=metadata, rename=rename, tag=self._tag)

    def _failed(self, path: Path, exc: BaseException) -> None:
        """A part write failed: report once, retry after half a flush interval (none after
        `give_up`: the run was finished without it)."""
        if self._landing.given_up is not None:
            return
        with self._lock:
            self._error = error_said(exc)  # a loss reason and a warning quote it
            self._failing = True
            self._report(path, exc)
            self._retry_at = len(self._held.buffer) + self._config.buffer_rows
            self._retry_after = time.monotonic() + self._config.flush_seconds / 2
            self._room.notify_all()

    def _written(self, n: int, number: int) -> None:
        """The first `n` buffered rows are in part `number`: they leave the buffer (once)."""
        with self._lock:
            if number != self._next_part:
                return  # counted as it landed
            self._held.buffer.drop(n)
            self._held.records.consume(n)
            self._next_part += 1
            self._rows_written += n
            self._failing = False
            self._held.ledger.end_episode()
            self._held.drop_reason = None
            # The oldest row left, not the oldest before the part: rows appended while it was
            # written would otherwise inherit its age and be due at once, part after tiny part.
            self._held.oldest = self._held.records.oldest() if len(self._held.buffer) else None
            self._room.notify_all()

    def _report(self, path: Path, exc: BaseException) -> None:
        """Warn once per writer about a failed part write."""
        if self._warned:
            return
        self._warned = True
        warn(part_failed_warning(path, exc, self._config.buffered_rows_cap))
