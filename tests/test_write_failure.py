"""When parts cannot be written: memory stays under the cap, and every lost row is counted.

The history writer keeps at most `max_buffered_rows` rows while writes fail, drops the newest
beyond that, and counts each dropped row in the loss ledger with its sample and reason; when
writes work again, everything still buffered lands, in as few parts as fit. Write failures are
injected by replacing the writer's one write function; a real small file system is in
`test_small_filesystem.py`.
"""

from __future__ import annotations

import errno
import json
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import (
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    reasons,
    remove_observer,
)
from torchinstruments.records import Measurement, MetricValue
from torchinstruments.rundir import writer as writer_module
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.layout import list_parts
from torchinstruments.rundir.ledger import LossLedger, LostRows, missing_samples, uncovered
from torchinstruments.rundir.state import Status, read_state
from torchinstruments.rundir.writer import SPLIT_RECORD_KEY, HistoryWriter

METRICS = ("mean", "std", "p50")


def measurement(sample: int, signal: str = "output") -> Measurement:
    """Three rows of sample `sample`."""
    return Measurement(
        sample_id=sample,
        forward_index=sample,
        timestamp_us=int(time.time() * 1e6),
        rank=None,
        layer="fc",
        module_type="Linear",
        call_index=0,
        signal=signal,
        tensor_path="",
        shape=(2,),
        dtype="float32",
        mode="train",
        grad_enabled=True,
        metrics=METRICS,
        values=tuple(MetricValue(float(sample)) for _ in METRICS),
    )


class Disk:
    """The writer's write function, failing with ENOSPC while `full` (or above `fits` rows)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self.fits: int | None = None  # the largest frame that still fits, when set
        self.room: int | None = None  # rows that still fit in all, when set (then it is full)
        self.attempts: list[int] = []
        self._real = writer_module.write_parquet_atomic
        monkeypatch.setattr(writer_module, "write_parquet_atomic", self.write)

    def write(
        self, frame: pl.DataFrame, path: Path, metadata: dict[str, str] | None = None, **kw: Any
    ) -> None:
        self.attempts.append(frame.height)
        if self.full or (self.fits is not None and frame.height > self.fits):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        if self.room is not None:
            if frame.height > self.room:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            self.room -= frame.height
        self._real(frame, path, metadata, **kw)


def part_samples(directory: Path) -> list[list[int]]:
    """The sample ids of each part, in part order."""
    return [pl.read_parquet(p)["sample_id"].to_list() for p in list_parts(directory)]


@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@pytest.mark.usefixtures("quiet")
def test_beyond_the_cap_the_newest_rows_are_dropped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = Disk(monkeypatch)
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=4, max_buffered_rows=10))
    disk.full = True
    buffered = []
    for sample in range(30):
        writer.append([measurement(sample)])
        buffered.append(writer.rows_buffered)
    assert max(buffered) == 9  # three samples of three rows; a fourth would pass the cap
    assert writer.rows_produced == 90
    (loss,) = writer.losses
    assert (loss.rows, loss.first_sample_id, loss.last_sample_id) == (81, 3, 29)
    assert "max_buffered_rows=10" in loss.reason
    assert "No space left on device" in loss.reason
    disk.full = False
    writer.flush()  # what the flush thread does after half a flush interval
    assert part_samples(tmp_path) == [[0, 0, 0, 1, 1, 1, 2, 2, 2]]  # one part, not three
    for sample in range(30, 33):  # writes work again: nothing is dropped
        writer.append([measurement(sample)])
    disk.full = True
    for sample in range(33, 40):
        writer.append([measurement(sample)])
    assert not writer.close()
    first, second, at_removal = writer.losses
    assert first == loss  # a successful write ended the first episode
    # 32 (one row still buffered), 33-35 fill the cap again; 36-39 are dropped
    assert (second.rows, second.first_sample_id, second.last_sample_id) == (12, 36, 39)
    assert (at_removal.rows, at_removal.first_sample_id, at_removal.last_sample_id) == (10, 32, 35)
    assert "not written at removal" in at_removal.reason
    assert writer.rows_lost == writer.rows_produced - writer.rows_written == 103


@pytest.mark.usefixtures("quiet")
def test_the_backlog_lands_in_as_few_parts_as_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = Disk(monkeypatch)
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=4, max_buffered_rows=64))
    disk.full = True
    for sample in range(12):
        writer.append([measurement(sample)])
    assert writer.rows_buffered == 36
    disk.full, disk.fits = False, 20
    disk.attempts.clear()
    writer.flush()
    assert disk.attempts == [36, 18, 18]  # all at once did not fit; two halves did
    assert writer.rows_buffered == 0
    assert [len(p) for p in part_samples(tmp_path)] == [18, 18]
    assert writer.close()
    assert writer.losses == ()


def test_a_part_that_ends_inside_a_sample_names_it(tmp_path: Path) -> None:
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=4))
    writer.append([measurement(0)])
    writer.append([measurement(1)])  # rows 4-6 of the buffer: the part holds one of them
    writer.append([measurement(1, "output_gradient")])  # then 2 + 3 rows: a part of 4 again
    metadata = [pl.read_parquet_metadata(p).get(SPLIT_RECORD_KEY) for p in list_parts(tmp_path)]
    assert [None if m is None else json.loads(m) for m in metadata] == [
        {"sample_id": 1, "signal": "output", "rows_in_parts": 1, "rows": 3},
        {"sample_id": 1, "signal": "output_gradient", "rows_in_parts": 2, "rows": 3},
    ]
    assert writer.close()


def test_the_ledger_merges_an_episode_and_stays_bounded() -> None:
    ledger = LossLedger()
    for sample in range(100):
        ledger.add(9, sample, sample, "disk full")
    ledger.end_episode()
    ledger.add(3, 200, 200, "disk full")
    assert ledger.entries == (LostRows(900, 0, 99, "disk full"), LostRows(3, 200, 200, "disk full"))
    for episode in range(200):
        ledger.end_episode()
        ledger.add(1, 300 + episode, 300 + episode, f"reason {episode}")
    assert len(ledger.entries) == 64
    assert ledger.rows == 900 + 3 + 200
    assert ledger.entries[-1].last_sample_id == 499
    assert "ledger keeps at most 64 entries" in ledger.entries[-1].reason


def test_missing_samples_are_the_gaps_in_the_sample_ids() -> None:
    assert missing_samples([0, 1, 5, 6, 9], None) == [(2, 4), (7, 8)]
    assert missing_samples([0, 1, 5], 8) == [(2, 4), (6, 7)]
    assert missing_samples([], 3) == [(0, 2)]
    assert missing_samples([0, 1, 2], 3) == []
    losses = [LostRows(5, 3, 4, "x"), LostRows(1, 8, 8, "y")]
    assert uncovered([(2, 4), (6, 9)], losses) == [(2, 2), (6, 7), (9, 9)]


SAMPLES_FAILING = 1_000  # ten times the cap of 100 samples: 900 samples dropped
ROWS_PER_SAMPLE = 9  # one Linear, forward only, default metrics


def test_a_write_error_and_a_run_directory_holding_an_escape_are_written_as_literals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warning and the loss reason quote the error by index.md's rule: a write error that
    quotes a path raw (as Polars' do), in a run directory named with an escape and a line
    break, left both in the warning and in every later loss reason, index.md's included."""
    directory = tmp_path / "run\x1b[2J\nx"
    directory.mkdir()

    def failing(frame: pl.DataFrame, path: Path, *args: Any, **kw: Any) -> None:
        raise pl.exceptions.ComputeError(f"cannot write {path}")

    monkeypatch.setattr(writer_module, "write_parquet_atomic", failing)
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=3, max_buffered_rows=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sample in range(3):
            writer.append([measurement(sample)])
        writer.close()
    said = [str(w.message) for w in caught]
    assert said[0].startswith("torchinstruments could not write history part '")
    assert "('ComputeError: cannot write " in said[0]
    loss = writer.losses[0]
    assert "because history parts could not be written ('ComputeError: cannot write " in (
        loss.reason
    )
    assert all(text.isprintable() for text in [*said, *(lost.reason for lost in writer.losses)])


def test_writes_failing_for_ten_times_the_cap_keep_memory_under_the_cap_and_count_every_row(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    disk = Disk(monkeypatch)
    writers: list[HistoryWriter] = []
    buffered: list[int] = []
    real_append = HistoryWriter.append

    def watched_append(self: HistoryWriter, measurements: Any) -> None:
        real_append(self, measurements)
        if not writers:
            writers.append(self)
        buffered.append(self.rows_buffered)

    monkeypatch.setattr(HistoryWriter, "append", watched_append)
    cap = 100 * ROWS_PER_SAMPLE
    model = nn.Linear(2, 2)
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=90, max_buffered_rows=cap, flush_seconds=1.0),
    )
    x = torch.randn(1, 2)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(50):  # samples 0-49: written
            model(x)
        wait_until(lambda: writers[0].rows_buffered == 0)  # (a timer flush may cut a part short)
        disk.full = True
        for _ in range(SAMPLES_FAILING):  # 50-149 buffered (the cap), 150-1049 dropped
            model(x)
        assert max(buffered) == cap
        disk.full = False  # the flush thread retries every flush_seconds / 2
        wait_until(lambda: writers[0].rows_buffered == 0)  # everything buffered lands
        # and the ledger is saved: the state file, then index.md
        wait_until(lambda: "with rows lost so far" in index_text(run_dir))
        (live,) = read_state(run_dir).losses
        for _ in range(30):  # 1050-1079: written as usual
            model(x)
        remove_observer(model)
    assert max(buffered) == cap
    messages = [str(w.message) for w in caught]
    assert sum("could not write history part" in m for m in messages) == 1
    assert sum("newer rows are dropped and counted" in m for m in messages) == 1
    dropped = (SAMPLES_FAILING - 100) * ROWS_PER_SAMPLE
    history = pl.read_parquet(run_dir / "history.parquet")
    kept = [*range(150), *range(50 + SAMPLES_FAILING, 80 + SAMPLES_FAILING)]
    assert sorted(history["sample_id"].unique()) == kept
    assert history.height == len(kept) * ROWS_PER_SAMPLE
    assert writers[0].rows_produced == history.height + dropped
    (loss,) = writers[0].losses
    last_dropped = 49 + SAMPLES_FAILING
    assert (loss.rows, loss.first_sample_id, loss.last_sample_id) == (dropped, 150, last_dropped)
    assert live == loss
    assert read_state(run_dir).losses == (loss,)
    sentence = (
        f"{dropped:,} rows of samples 150-{last_dropped} were recorded but not written: dropped"
    )
    for _ in ("after removal", "after finalize"):
        index = index_text(run_dir)
        assert "**State: INCOMPLETE.**" in index
        assert sentence in index
        assert read_state(run_dir).status is Status.INCOMPLETE
        finalize(run_dir)


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll `condition` (the flush thread's work) until it holds; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the flush thread did not get there"
        time.sleep(0.02)


def index_text(directory: Path) -> str:
    return (directory / "index.md").read_text("utf-8")


def test_finalize_names_the_sample_gaps_no_ledger_explains(tmp_path: Path) -> None:
    """A crashed run with no state file: the gap in the sample ids is all that is left."""
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=30))
    for sample in [*range(10), *range(20, 30)]:  # samples 10-19 never reached a part
        writer.append([measurement(sample)])
    writer.flush()
    report = finalize(tmp_path)
    assert report.state.status is Status.INCOMPLETE
    (gap,) = [p for p in report.problems if "no loss ledger entry covers them" in p]
    assert gap.startswith("no row of samples 10-19 is in history.parquet")
    assert gap in index_text(tmp_path)


def test_the_sample_gaps_of_a_long_job_are_found_without_its_ids_in_python(
    tmp_path: Path,
) -> None:
    """Every finish of a run once killed looks for sample gaps: over 200,000 sample ids (two
    gaps, one a loss ledger entry explains) it holds no list of them (tracemalloc sees Python
    objects, where the ids alone would be over 5 MB)."""
    import tracemalloc

    from test_index_page import run_info

    from torchinstruments.rundir.history_checks import unexplained_gaps
    from torchinstruments.rundir.state import RunState

    ids = [i for i in range(200_000) if not 1_000 <= i < 1_005 and i != 150_000]
    pl.DataFrame({"sample_id": ids}, schema={"sample_id": pl.Int64}).write_parquet(
        tmp_path / "history.parquet"
    )
    state = RunState(run_info(tmp_path), losses=(LostRows(1, 150_000, 150_000, "disk full"),))
    tracemalloc.start()
    try:
        (gap,) = unexplained_gaps(tmp_path / "history.parquet", state, [])
        held = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert gap.startswith("no row of samples 1000-1004 is in history.parquet")
    assert held < 1_000_000, held


@pytest.mark.usefixtures("quiet")
def test_a_sample_cut_short_at_the_memory_cap_is_marked_and_said_in_index(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = Disk(monkeypatch)
    disk.full = True
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))  # 27 rows a signal
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        # room for sample 0's output rows and one of its three gradients
        history_config=HistoryConfig(buffer_rows=40, max_buffered_rows=27 + 9 + 4),
    )
    model(torch.randn(2, 3)).sum().backward()  # sample 0: two of its gradients dropped
    model(torch.randn(2, 3)).sum().backward()  # sample 1: dropped whole (the ledger's gap)
    disk.full = False
    remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet")
    marks = history.filter(pl.col("metric") == "interrupted")
    assert marks.select("sample_id", "signal", "layer", "value").rows() == [
        (0, "output_gradient", "", None)
    ]
    reason = marks["unavailable_reason"][0]
    assert reason == reasons.dropped_at_cap(40)
    gradients = history.filter(
        pl.col("signal") == "output_gradient", pl.col("metric") != "interrupted"
    )
    assert gradients["layer"].unique().to_list() == ["2"]  # the one that fit
    assert history["sample_id"].unique().to_list() == [0]
    state = read_state(run_dir)
    assert state.status is Status.INCOMPLETE
    assert state.marks_total == 1
    index = index_text(run_dir)
    assert "## Interrupted samples" in index
    assert f"- sample 0: `{reason}`" in index


@pytest.mark.usefixtures("quiet")
def test_a_sample_whose_forward_was_dropped_and_backward_kept_is_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = Disk(monkeypatch)
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=4, max_buffered_rows=10))
    disk.full = True
    for sample in range(4):  # 0-2 buffered, 3's output rows dropped at the cap
        writer.append([measurement(sample)])
    disk.full = False
    writer.flush()
    writer.append([measurement(3, "output_gradient")])  # kept: sample 3 is partial
    writer.append([measurement(4)])
    writer.append([measurement(4, "output_gradient")])  # an ordinary sample
    assert writer.close() is False  # the dropped rows are in the ledger
    rows = pl.concat([pl.read_parquet(p) for p in list_parts(tmp_path)])
    marks = rows.filter(pl.col("metric") == "interrupted")
    assert marks.select("sample_id", "signal", "forward_index", "value").rows() == [
        (3, "output", 3, None)
    ]
    assert marks["unavailable_reason"][0] == reasons.dropped_at_cap(10)
    assert writer.rows_produced == writer.rows_written + writer.rows_lost


@pytest.mark.usefixtures("quiet")
def test_a_sample_marked_twice_is_counted_once(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = Disk(monkeypatch)
    disk.full = True
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))  # 27 rows a signal
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=32, max_buffered_rows=32),
    )
    y = model(torch.randn(2, 3))  # its 27 output rows fit

    def remove(grad: torch.Tensor) -> None:  # after the last layer's gradient arrived
        disk.full = False
        remove_observer(model)

    y.register_hook(remove)
    y.sum().backward()  # that gradient's rows are dropped at the cap, the removal marker kept
    marks = pl.read_parquet(run_dir / "history.parquet").filter(pl.col("metric") == "interrupted")
    assert sorted(marks["unavailable_reason"].to_list()) == sorted(
        [reasons.dropped_at_cap(32), reasons.removed_during("backward")]
    )
    assert marks["sample_id"].to_list() == [0, 0]
    state = read_state(run_dir)
    assert state.marks_total == 1
    assert state.removed_in_flight == (0,)
    index = index_text(run_dir)
    assert "1 sample(s) are marked:" in index
    assert index.count("\n- sample 0: `interrupted: ") == 2


@pytest.mark.usefixtures("quiet")
def test_a_sample_only_partly_written_at_removal_is_marked_and_said_in_index(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = Disk(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))  # 27 rows a signal
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=10_000, flush_seconds=600.0),
    )
    for _ in range(5):  # samples 0-4; 1-4 wait in memory for removal (after the first rows)
        model(torch.randn(2, 3)).sum().backward()
    disk.room = 101  # at removal, part of the backlog fits: it ends inside sample 2's gradients
    remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet")
    gradients = history.filter(pl.col("sample_id") == 2, pl.col("signal") == "output_gradient")
    marks = gradients.filter(pl.col("metric") == "interrupted")
    assert marks["unavailable_reason"].to_list() == [
        reasons.unwritten_at_removal("output_gradient", 19, 27)
    ]
    assert gradients.height == 19 + 1  # what reached the disk, and the mark
    assert history.filter(pl.col("metric") == "interrupted")["sample_id"].to_list() == [2]
    state = read_state(run_dir)
    assert state.status is Status.INCOMPLETE
    assert state.marks_total == 1
    assert f"- sample 2: `{marks['unavailable_reason'][0]}`" in index_text(run_dir)
    disk.room = None
    finalize(run_dir)  # the space is back: the mark is there once
    again = pl.read_parquet(run_dir / "history.parquet").filter(pl.col("metric") == "interrupted")
    assert again["sample_id"].to_list() == [2]
