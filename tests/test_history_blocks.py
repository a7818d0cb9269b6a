"""The observer's records (`MeasurementBlock`s) in the live history: the same rows as the
measurements they stand for, in parts of any size, past the memory cap, with bad cells.

A block waits in the history buffer as it is and becomes rows when a part takes it (all the
blocks a part covers at once); plain measurements become rows at once, one list per column.
Both must write exactly the same history.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import warnings
from pathlib import Path

import polars as pl
import pytest

from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import MeasurementBlock
from torchinstruments.rundir import writer as writer_module
from torchinstruments.rundir.layout import list_parts
from torchinstruments.rundir.writer import SPLIT_RECORD_KEY, HistoryWriter

METRICS = ("mean", "max", "zero_fraction")


def block(
    sample_id: int, tensors: int, signal: str = "output", metrics: tuple[str, ...] = METRICS
) -> MeasurementBlock:
    """A block whose fields vary per tensor (shapes, paths, nulls, placements)."""
    k = len(metrics)
    values: list[float | None] = [float(sample_id * 1000 + i) for i in range(tensors * k)]
    why: list[str | None] = [None] * (tensors * k)
    values[1], why[1] = None, "no finite entries"
    return MeasurementBlock(
        sample_id=sample_id,
        forward_index=sample_id + 10,
        signal=signal,
        rank=None if sample_id % 2 else 1,
        metrics=metrics,
        timestamps_us=tuple(1_700_000_000_000_000 + sample_id * 1000 + i for i in range(tensors)),
        layers=tuple(f"blocks.{i}" for i in range(tensors)),
        module_types=tuple("Linear" if i % 2 else "ReLU" for i in range(tensors)),
        call_indices=tuple(i % 3 for i in range(tensors)),
        tensor_paths=tuple("" if i % 4 else "[0]" for i in range(tensors)),
        shapes=tuple((4, i + 1) if i % 5 else None for i in range(tensors)),
        dtypes=("float32",) * tensors,
        modes=tuple("train" if i % 2 else "eval" for i in range(tensors)),
        grad_enabled=tuple(bool(i % 2) for i in range(tensors)),
        placements=tuple(None if i % 3 else "Shard(0)" for i in range(tensors)),
        mesh_coordinates=tuple(None if i % 3 else (i % 2,) for i in range(tensors)),
        values=tuple(values),
        reasons=tuple(why),
        step=None if sample_id % 3 == 2 else 7 * sample_id,
    )


def parts(directory: Path) -> list[pl.DataFrame]:
    return [pl.read_parquet(path) for path in list_parts(directory)]


def written(directory: Path, records: list, buffer_rows: int, as_measurements: bool) -> list:
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=buffer_rows))
    for record in records:
        writer.append(tuple(record) if as_measurements else record)
    assert writer.close()
    return parts(directory)


@pytest.mark.parametrize("buffer_rows", [1, 7, 9, 1000])
def test_blocks_write_the_rows_of_their_measurements_in_parts_of_any_size(
    tmp_path: Path, buffer_rows: int
) -> None:
    records = [block(0, 5), block(0, 4, "output_gradient"), block(1, 6), block(2, 1)]
    from_blocks = written(tmp_path / "blocks", records, buffer_rows, as_measurements=False)
    from_rows = written(tmp_path / "rows", records, buffer_rows, as_measurements=True)
    assert [p.height for p in from_blocks] == [p.height for p in from_rows]
    for a, b in zip(from_blocks, from_rows, strict=True):
        assert a.equals(b, null_equal=True)
    whole = pl.concat(from_blocks)
    assert whole.height == 3 * (5 + 4 + 6 + 1)
    assert whole["value"].null_count() == 4  # one null per block, with its reason
    assert whole.filter(pl.col("value").is_null())["unavailable_reason"].unique().to_list() == [
        "no finite entries"
    ]


def test_blocks_of_one_metric_write_the_rows_of_their_measurements(tmp_path: Path) -> None:
    records = [block(0, 5, metrics=("max",)), block(1, 3, "output_gradient", ("max",))]
    from_blocks = written(tmp_path / "blocks", records, 1000, as_measurements=False)
    from_rows = written(tmp_path / "rows", records, 1000, as_measurements=True)
    assert len(from_blocks) == len(from_rows) == 1
    assert from_blocks[0].equals(from_rows[0], null_equal=True)
    assert from_blocks[0]["metric"].to_list() == ["max"] * 8
    assert from_blocks[0]["layer"].to_list() == [f"blocks.{i}" for i in (0, 1, 2, 3, 4, 0, 1, 2)]


def test_a_part_that_splits_a_block_says_so_in_its_metadata(tmp_path: Path) -> None:
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=10))
    writer.append(block(0, 3))  # 9 rows
    writer.append(block(1, 3))  # the part ends after 1 of its 9 rows
    (first,) = list_parts(tmp_path)
    split = json.loads(pl.read_parquet_metadata(first)[SPLIT_RECORD_KEY])
    assert split == {"sample_id": 1, "signal": "output", "rows_in_parts": 1, "rows": 9}
    assert writer.rows_buffered == 8
    assert writer.close()
    assert sum(p.height for p in parts(tmp_path)) == 18


def test_a_cell_that_does_not_fit_is_nulled_with_a_reason_and_its_rows_kept(
    tmp_path: Path,
) -> None:
    good = block(0, 3)
    values: list[object] = list(good.values)
    values[4] = "not a number"
    bad = dataclasses.replace(good, values=tuple(values))  # type: ignore[arg-type]
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=100))
    writer.append(block(1, 2))
    writer.append(bad)
    assert writer.close()
    (history,) = parts(tmp_path)
    assert history.height == 15  # every row of both blocks
    row = history.filter((pl.col("sample_id") == 0) & (pl.col("layer") == "blocks.1"))
    assert row["value"].to_list()[1] is None
    assert "str" in row["unavailable_reason"].to_list()[1]
    assert history.filter(pl.col("sample_id") == 1)["value"].null_count() == 1  # untouched


def test_past_the_cap_whole_tensors_are_dropped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    real = writer_module.write_parquet_atomic
    monkeypatch.setattr(writer_module, "write_parquet_atomic", full)
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=4, max_buffered_rows=20))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        writer.append(block(0, 4))  # 12 rows
        writer.append(block(1, 5))  # 2 tensors fit (6 rows), 3 are dropped (9 rows)
    assert writer.rows_buffered == 18 + 1  # and sample 1's marker row: it is partial
    (loss,) = writer.losses
    assert (loss.rows, loss.first_sample_id, loss.last_sample_id) == (9, 1, 1)
    monkeypatch.setattr(writer_module, "write_parquet_atomic", real)
    assert not writer.close()  # 9 rows are lost for good
    history = pl.concat(parts(tmp_path))
    assert history.height == 19
    marked = history.filter(pl.col("metric") == "interrupted")
    assert marked.select("sample_id", "layer").rows() == [(1, "")]
    kept = history.filter(pl.col("sample_id") == 1, pl.col("metric") != "interrupted")
    layers = kept["layer"].unique(maintain_order=True)
    assert layers.to_list() == ["blocks.0", "blocks.1"]  # the oldest tensors stay, in order


def test_a_sample_larger_than_the_cap_is_written_in_pieces_while_writes_work(
    tmp_path: Path,
) -> None:
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=4, max_buffered_rows=10))
    writer.append(block(0, 12))  # 36 rows, at most 10 buffered at a time
    assert not writer.losses
    assert writer.close()
    history = pl.concat(parts(tmp_path))
    assert history.height == 36
    assert history["layer"].unique(maintain_order=True).to_list() == [
        f"blocks.{i}" for i in range(12)
    ]
