"""History writer and merge: columnar buffer, atomic parts, exact schema, bounded-memory merge."""

from __future__ import annotations

import dataclasses
import errno
import json
import time
import warnings
from itertools import pairwise
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import Measurement, MetricValue
from torchinstruments.rundir import merge as merge_module
from torchinstruments.rundir import writer as writer_module
from torchinstruments.rundir.layout import CONSTANT_KEY, HISTORY_SCHEMA, ORDER_KEY, list_parts
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.writer import HistoryWriter

EXPECTED_SCHEMA = {
    "sample_id": pl.Int64,
    "forward_index": pl.Int64,
    "timestamp": pl.Datetime("us", "UTC"),
    "rank": pl.Int32,
    "layer": pl.String,
    "module_type": pl.String,
    "call_index": pl.Int32,
    "signal": pl.String,
    "tensor_path": pl.String,
    "shape": pl.List(pl.Int64),
    "dtype": pl.String,
    "placement": pl.String,
    "mesh_coordinate": pl.List(pl.Int64),
    "step": pl.Int64,
    "mode": pl.String,
    "grad_enabled": pl.Boolean,
    "metric": pl.String,
    "value": pl.Float64,
    "unavailable_reason": pl.String,
    "population": pl.String,
    "attempt": pl.Int32,
}


def measurement(sample: int, layer: str, signal: str = "output", call: int = 0) -> Measurement:
    """A measurement with three metrics, one of them unavailable."""
    return Measurement(
        sample_id=sample,
        forward_index=2 * sample + 1,
        timestamp_us=1_700_000_000_000_000 + sample,
        rank=None,
        layer=layer,
        module_type="Linear",
        call_index=call,
        signal=signal,
        tensor_path="[0]" if call else "",
        shape=(4, sample % 3 + 1),
        dtype="float32",
        mode="train",
        grad_enabled=True,
        metrics=("mean", "std", "p50"),
        values=(
            MetricValue(sample + 0.5),
            MetricValue(None, "empty tensor"),
            MetricValue(-float(sample)),
        ),
        placement="Shard(1)" if layer == "b" else None,  # a DTensor's rows
        mesh_coordinate=(sample % 2,) if layer == "b" else None,
        step=None if sample % 4 == 3 else 10 * sample,  # a loop's steps, some unset
    )


def run_samples(writer: HistoryWriter, samples: int) -> list[Measurement]:
    """Forward of sample s, then (like a real loop) the backward of s arrives after it."""
    produced = []
    for s in range(samples):
        fwd = [measurement(s, "b"), measurement(s, "a"), measurement(s, "a", call=1)]
        bwd = [
            measurement(s, "a", "output_gradient", call=1),
            measurement(s, "a", "output_gradient"),
        ]
        writer.append(fwd)
        writer.append(bwd)
        produced += fwd + bwd
    return produced


def expected_rows(measurements: list[Measurement]) -> list[tuple]:
    """The rows the writer must produce, built directly from the records."""
    rows = []
    for m in measurements:
        for name, v in zip(m.metrics, m.values, strict=True):
            rows.append(
                (
                    *(m.sample_id, m.forward_index, m.timestamp_us, m.rank, m.layer, m.module_type),
                    *(m.call_index, m.signal, m.tensor_path, list(m.shape or ()), m.dtype),
                    m.placement,
                    None if m.mesh_coordinate is None else list(m.mesh_coordinate),
                    m.step,
                    *(m.mode, m.grad_enabled, name, v.value, v.reason),
                    m.population,
                    0,  # attempt: a writer's rows are its process's, the first attempt's here
                )
            )
    return rows


def as_rows(frame: pl.DataFrame) -> list[tuple]:
    ts = frame["timestamp"].dt.epoch("us")
    return [(*row[:2], t, *row[3:]) for row, t in zip(frame.rows(), ts.to_list(), strict=True)]


def row_key(row: tuple) -> tuple:
    """HISTORY_ORDER: sample_id, then signal (write order breaks ties)."""
    return (row[0], row[7])


def in_write_order(rows: list[tuple], expected: list[tuple]) -> bool:
    """Whether `rows` keep the writer's order among rows of equal (sample_id, signal)."""
    position = {repr(row): i for i, row in enumerate(expected)}
    pairs = [(row_key(row), position[repr(row)]) for row in rows]
    return all(a[1] < b[1] for a, b in pairwise(pairs) if a[0] == b[0])


def run_interleaved(writer: HistoryWriter, samples: int) -> list[Measurement]:
    """Two forwards, then both backwards (gradient accumulation): parts are out of order."""
    produced = []
    for s in range(0, samples, 2):
        fwd = [[measurement(t, "b"), measurement(t, "a")] for t in (s, s + 1)]
        bwd = [[measurement(t, "a", "output_gradient")] for t in (s, s + 1)]
        for batch in (*fwd, *bwd):
            writer.append(batch)
            produced += batch
    return produced


def test_config_validation_names_field_value_and_rule() -> None:
    with pytest.raises(ValueError, match=r"^buffer_rows must be an int >= 1, got 0$"):
        HistoryConfig(buffer_rows=0)
    with pytest.raises(ValueError, match=r"^window must be an int >= 1, got True$"):
        HistoryConfig(window=True)
    with pytest.raises(ValueError, match=r"^window must be an int >= 1, got 2\.5$"):
        HistoryConfig(window=2.5)  # type: ignore[arg-type]


def test_the_default_part_size_yields_to_a_smaller_memory_cap_and_a_passed_one_does_not() -> None:
    """Parts of 65,536 rows by default; a memory cap below that (valid with the 8,192 default
    before) makes the default part the cap, while a part size passed on purpose is checked."""
    assert HistoryConfig().buffer_rows == 65_536
    assert type(HistoryConfig().buffer_rows) is int
    assert HistoryConfig() == HistoryConfig(buffer_rows=65_536)
    assert HistoryConfig(max_buffered_rows=20_000).buffer_rows == 20_000
    assert HistoryConfig(max_buffered_rows=200_000).buffer_rows == 65_536
    with pytest.raises(
        ValueError, match=r"^max_buffered_rows must be None or an int >= buffer_rows"
    ):
        HistoryConfig(buffer_rows=65_536, max_buffered_rows=20_000)
    with pytest.raises(ValueError, match=r"^max_buffered_rows must be an int >= 1, got 'x'$"):
        HistoryConfig(max_buffered_rows="x")  # type: ignore[arg-type]


@pytest.mark.parametrize("buffer_rows", [1, 7, 8192])
def test_rows_written_equal_rows_produced_and_merge_is_sorted(
    tmp_path: Path, buffer_rows: int
) -> None:
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=buffer_rows))
    produced = run_samples(writer, 40)
    expected = expected_rows(produced)
    writer.flush()
    assert writer.rows_produced == len(expected) == writer.rows_written
    parts = list_parts(tmp_path)
    frames = [pl.read_parquet(p) for p in parts]
    assert all(f.height <= buffer_rows for f in frames)
    assert all(dict(f.schema) == EXPECTED_SCHEMA for f in frames)
    concatenated = pl.concat(frames)
    assert sorted(as_rows(concatenated), key=repr) == sorted(expected, key=repr)

    assert writer.close()
    assert merge_history(tmp_path).path == tmp_path / "history.parquet"
    merged = pl.read_parquet(tmp_path / "history.parquet")
    assert dict(merged.schema) == EXPECTED_SCHEMA
    rows = as_rows(merged)
    assert sorted(rows, key=repr) == sorted(expected, key=repr)
    keys = [row_key(r) for r in rows]
    assert keys == sorted(keys)
    assert in_write_order(rows, expected)
    assert not (tmp_path / "history.parts").exists()


def test_big_append_is_split_into_parts(tmp_path: Path) -> None:
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=4))
    writer.append([measurement(0, f"l{i}") for i in range(10)])  # 30 rows
    sizes = [pl.read_parquet(p).height for p in list_parts(tmp_path)]
    assert sizes == [4] * 7
    assert writer.rows_buffered == 2
    writer.flush()
    assert writer.rows_written == 30


def test_empty_history_has_exact_schema(tmp_path: Path) -> None:
    assert HistoryWriter(tmp_path, HistoryConfig()).close()
    frame = pl.read_parquet(merge_history(tmp_path).path)
    assert frame.height == 0
    assert dict(frame.schema) == EXPECTED_SCHEMA
    assert dict(HISTORY_SCHEMA) == EXPECTED_SCHEMA


def test_range_batched_merge_equals_single_sort(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(merge_module, "MERGE_BATCH_ROWS", 37)
    history_writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=11))
    produced = run_interleaved(history_writer, 30)
    history_writer.close()
    assert any(not read_order_entry(p) for p in list_parts(tmp_path))  # the sorting path
    merge_history(tmp_path)
    rows = as_rows(pl.read_parquet(tmp_path / "history.parquet"))
    assert rows == sorted(expected_rows(produced), key=row_key)  # a stable sort of write order
    merged = tmp_path / "history.parquet"
    assert constant_entry(merged) == constant_by_hand(merged)  # what the concatenation names


def read_order_entry(path: Path) -> str | None:
    return pl.read_parquet_metadata(path).get(ORDER_KEY)


def test_parts_in_order_are_concatenated_as_written(tmp_path: Path) -> None:
    history_writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=11))
    produced = run_samples(history_writer, 30)
    history_writer.close()
    parts = list_parts(tmp_path)
    assert all(read_order_entry(p) for p in parts)
    concatenated = as_rows(pl.concat([pl.read_parquet(p) for p in parts]))
    merge_history(tmp_path)
    merged = tmp_path / "history.parquet"
    assert as_rows(pl.read_parquet(merged)) == concatenated == expected_rows(produced)
    assert json.loads(read_order_entry(merged) or "") == {
        "first": [0, "output"],
        "last": [29, "output_gradient"],
    }


def constant_by_hand(path: Path) -> dict[str, object]:
    """The columns of a file whose rows all hold one Python value (None: all null), from its
    rows; a non-null `value` or `timestamp` is never named (-0.0 == 0.0 in Python too)."""
    frame = pl.read_parquet(path)
    found = {}
    for name in frame.columns:
        values = {repr(v) for v in frame.get_column(name).to_list()}
        if len(values) == 1 and (name not in ("value", "timestamp") or values == {"None"}):
            found[name] = frame.get_column(name).to_list()[0]
    return found


def constant_entry(path: Path) -> dict[str, object] | None:
    entry = pl.read_parquet_metadata(path).get(CONSTANT_KEY)
    return None if entry is None else json.loads(entry)


def test_parts_and_history_name_their_constant_columns(tmp_path: Path) -> None:
    history_writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=11))
    produced = run_samples(history_writer, 30)
    history_writer.close()
    parts = list_parts(tmp_path)
    entries = [constant_entry(p) for p in parts]
    assert entries == [constant_by_hand(p) for p in parts]
    # Every part holds rows of several metrics and values: those are never named.
    assert not {"metric", "value"} & {k for e in entries for k in e or {}}
    assert any(e and e.get("sample_id") is not None for e in entries)  # some parts: one sample
    merge_history(tmp_path)
    merged = tmp_path / "history.parquet"
    assert as_rows(pl.read_parquet(merged)) == expected_rows(produced)
    # The merged file names what is constant in all of it (here rank, module_type, dtype,
    # mode, grad_enabled, population, attempt), so a later merge into it streams them too.
    assert constant_entry(merged) == constant_by_hand(merged)
    assert set(constant_by_hand(merged)) == {
        *("rank", "module_type", "dtype", "mode", "grad_enabled", "population", "attempt"),
    }


def test_a_part_without_order_metadata_is_sorted_into_place(tmp_path: Path) -> None:
    history_writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=11))
    produced = run_samples(history_writer, 6)
    history_writer.close()
    # A part from a writer that does not record its order (an older version): same rows.
    first = list_parts(tmp_path)[0]
    pl.read_parquet(first).write_parquet(first)
    assert read_order_entry(first) is None
    merge_history(tmp_path)
    rows = as_rows(pl.read_parquet(tmp_path / "history.parquet"))
    assert rows == sorted(expected_rows(produced), key=row_key)


def test_disk_full_warns_once_keeps_rows_and_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer_module.write_parquet_atomic
    failing = {"left": 5}

    def flaky(frame: pl.DataFrame, path: Path, **kwargs: object) -> None:
        if failing["left"] > 0:
            failing["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(frame, path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_module, "write_parquet_atomic", flaky)
    history_writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        produced = run_samples(history_writer, 30)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "history.parts" in messages[0]
    assert "No space left" in messages[0]
    assert failing["left"] == 0
    assert history_writer.close()
    rows = as_rows(pl.read_parquet(merge_history(tmp_path).path))
    assert history_writer.rows_written == history_writer.rows_produced == len(rows)
    assert sorted(rows, key=repr) == sorted(expected_rows(produced), key=repr)


def test_close_with_unwritable_rows_reports_them_and_keeps_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    history_writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=3))
    run_samples(history_writer, 2)
    written = history_writer.rows_written

    def broken(frame: pl.DataFrame, path: Path, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(writer_module, "write_parquet_atomic", broken)
    with pytest.warns(RuntimeWarning, match="Permission denied"):
        history_writer.append([measurement(5, "a")])
    assert not history_writer.close()
    assert history_writer.rows_buffered == history_writer.rows_produced - written > 0
    assert list_parts(tmp_path)


def test_merge_after_crash_between_rename_and_part_removal_has_no_duplicates(
    tmp_path: Path,
) -> None:
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=5))
    produced = run_samples(writer, 6)
    writer.flush()
    parts = list_parts(tmp_path)
    saved = {p: p.read_bytes() for p in parts}
    merge_history(tmp_path)
    for p, data in saved.items():  # as if the process died before deleting the parts
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data)
    # and one part the merged file does not hold yet
    late = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=100))
    extra = [measurement(99, "z")]
    late.append(extra)
    late.flush()
    merge_history(tmp_path)
    rows = as_rows(pl.read_parquet(tmp_path / "history.parquet"))
    assert sorted(rows, key=repr) == sorted(expected_rows(produced + extra), key=repr)
    assert list_parts(tmp_path) == []


def test_full_chunks_left_elsewhere_are_written_by_write_due_without_blocking_appends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `chunks_elsewhere` `append` writes no part: the chunks are due at once, and
    `write_due` (the flush thread's call) writes them, holding the buffer's lock only around
    the write, so an append made while a part is being written returns at once."""
    import threading

    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=4), chunks_elsewhere=True)
    writer.append([measured_now(0, f"l{i}") for i in range(10)])  # 30 rows
    assert list_parts(tmp_path) == []
    assert writer.seconds_until_due() == 0.0
    writing, release = threading.Event(), threading.Event()
    original = writer_module.write_parquet_atomic

    def held(frame: pl.DataFrame, path: Path, **kwargs: Any) -> None:
        writing.set()
        assert release.wait(10)
        original(frame, path, **kwargs)

    monkeypatch.setattr(writer_module, "write_parquet_atomic", held)
    flush_thread = threading.Thread(target=writer.write_due)
    flush_thread.start()
    assert writing.wait(10)
    writer.append([measured_now(1, "late")])  # returns while the part's write waits
    assert writer.rows_buffered == 33
    release.set()
    flush_thread.join(10)
    sizes = [pl.read_parquet(p).height for p in list_parts(tmp_path)]
    assert sizes == [4] * 8  # the late rows made the eighth chunk; the last row is not due
    assert writer.rows_buffered == 1
    assert writer.close()
    assert writer.rows_written == 33


def measured_now(sample: int, layer: str) -> Measurement:
    """`measurement`, measured now: not due by age for a flush interval."""
    return dataclasses.replace(measurement(sample, layer), timestamp_us=time.time_ns() // 1000)


def test_rows_due_by_age_go_at_once_with_the_full_chunks_before_them(tmp_path: Path) -> None:
    """Once the oldest buffered row is half a flush interval old, `write_due` writes every
    buffered row in one part, the full chunks waiting before it included: written chunk by
    chunk, a small buffer_rows fell behind rows recorded faster than parts are written, and
    a crash lost rows far older than flush_seconds."""
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=1), chunks_elsewhere=True)
    writer.append([measurement(0, f"l{i}") for i in range(10)])  # 30 rows, as old as 2023
    assert writer.write_due()  # the time bound's turn
    assert [pl.read_parquet(p).height for p in list_parts(tmp_path)] == [30]
    assert writer.rows_buffered == 0
    assert writer.close()


def test_a_sampled_step_leaves_its_full_chunks_to_the_flush_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An observed run's training thread writes no part: its first forward and backward rows
    are on disk when their step returns, written by the flush thread like every full chunk
    (a write on the training thread could block the step for good on a stalled disk), and no
    row is lost."""
    import threading

    import torch
    from torch import nn

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    writers: list[str] = []
    original = writer_module.write_parquet_atomic

    def named(frame: pl.DataFrame, path: Path, **kwargs: Any) -> None:
        writers.append(threading.current_thread().name)
        original(frame, path, **kwargs)

    monkeypatch.setattr(writer_module, "write_parquet_atomic", named)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    rows = 3 * 9 * 2  # three layers, nine metrics, output and gradient
    inject_observer(
        model,
        output_dir=tmp_path / "run",
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=rows),
    )
    output = model(torch.randn(2, 4))
    assert len(list_parts(tmp_path / "run")) == 1  # sample 0's forward rows, at once
    output.sum().backward()
    assert len(list_parts(tmp_path / "run")) == 2  # then its backward rows
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
    deadline = time.monotonic() + 60
    while len(writers) < 2 + 5 and time.monotonic() < deadline:  # a chunk a later sample
        time.sleep(0.005)
    assert len(writers) == 7
    assert all(name.startswith("torchinstruments flush") for name in writers)
    remove_observer(model)
    assert pl.read_parquet(tmp_path / "run" / "history.parquet").height == 6 * rows
