"""history.parquet's physical layout: the merge round-trips every column exactly, writes brotli
row groups of HISTORY_ROW_GROUP_ROWS rows whose sample ranges a reader can prune on (read from the
file's footer, not through Polars), and a sample that repeats the previous one's values costs
about its new timestamps, not its values again."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from parquet_footer import BROTLI, column_chunks
from polars.testing import assert_frame_equal

from torchinstruments.measurement.reducers import DEFAULT_METRICS
from torchinstruments.rundir import layout
from torchinstruments.rundir.layout import (
    HISTORY_SCHEMA,
    PARTS_DIR,
    order_metadata,
    part_path,
    write_parquet_atomic,
)
from torchinstruments.rundir.merge import merge_history

# Float64 values a layout must keep bit for bit.
SPECIAL = (-0.0, 0.0, 5e-324, -2.2250738585072014e-308, 1.7976931348623157e308, -math.inf, math.nan)


def synthetic_history(samples: int, tensors: int, *, varied: bool = False) -> pl.DataFrame:
    """`samples` samples of `tensors` tensors x the nine default metrics, in history order (the
    first half of the tensors outputs, the second half gradients). Every sample repeats the
    first one's values (random doubles); each tensor has its own timestamp, a few to 60 us after
    the one before, as a run's are. `varied`: also nulls with reasons, DTensor placements and
    mesh coordinates, unset steps, two populations and special floats, in every column that
    can hold them."""
    rng = np.random.default_rng(0)
    metrics = len(DEFAULT_METRICS)
    per_sample = tensors * metrics
    n = samples * per_sample
    tensor = np.tile(np.repeat(np.arange(tensors), metrics), samples)
    sample = np.repeat(np.arange(samples), per_sample)
    values = np.tile(rng.standard_normal(per_sample), samples)
    reason: list[str | None] = [None] * n
    placement: list[str | None] = [None] * n
    mesh: list[list[int] | None] = [None] * n
    step: list[int | None] = sample.tolist()
    population: list[str | None] = [None] * n
    value: list[float | None] = values.tolist()
    if varied:
        for i in range(0, n, 7):
            value[i], reason[i] = None, "empty tensor"
        for i in range(3, n, 7):
            value[i] = SPECIAL[i % len(SPECIAL)]
        for i in range(0, n, 5):
            placement[i], mesh[i] = "Shard(1)", [i % 2, 0]
        for i in range(0, n, 11):
            step[i], population[i] = None, "global:ranks=0-1"
    frame = pl.DataFrame(
        {
            "sample_id": sample,
            "forward_index": 2 * sample + 1,
            "timestamp": 1_700_000_000_000_000
            + np.repeat(np.cumsum(rng.integers(5, 60, samples * tensors)), metrics),
            "rank": [None if varied else 0] * n,
            "layer": (tensor % (tensors // 2)).astype(str),
            "module_type": np.where(tensor % 2 == 0, "Linear", "Tanh"),
            "call_index": tensor % 3 if varied else np.zeros(n, np.int64),
            "signal": np.where(tensor < tensors // 2, "output", "output_gradient"),
            "tensor_path": np.where(tensor % 3 == 1, "[0]", "") if varied else [""] * n,
            "shape": [[8, 16]] * n,
            "dtype": ["float32"] * n,
            "placement": placement,
            "mesh_coordinate": mesh,
            "step": step,
            "mode": ["train"] * n,
            "grad_enabled": tensor < tensors // 2,
            "metric": np.tile(np.array(DEFAULT_METRICS), samples * tensors),
            "value": value,
            "unavailable_reason": reason,
            "population": population,
            "attempt": [0] * n,
        }
    )
    return frame.with_columns(pl.col("timestamp").cast(pl.Datetime("us", "UTC"))).cast(
        HISTORY_SCHEMA
    )


def merge_parts(directory: Path, frame: pl.DataFrame, part_rows: int = 8192) -> Path:
    """Write `frame` as the writer does (parts of `part_rows` rows with their order metadata),
    merge them, and return history.parquet."""
    (directory / PARTS_DIR).mkdir(parents=True)
    for i, offset in enumerate(range(0, frame.height, part_rows)):
        part = frame.slice(offset, part_rows)
        write_parquet_atomic(part, part_path(directory, i), metadata=order_metadata(part))
    return merge_history(directory).path


@pytest.mark.parametrize("row_group_rows", [None, 1_000])
def test_merged_history_equals_its_rows_frame_for_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row_group_rows: int | None
) -> None:
    if row_group_rows is not None:  # many row groups and pages, with boundaries mid-sample
        monkeypatch.setattr(layout, "HISTORY_ROW_GROUP_ROWS", row_group_rows)
    frame = synthetic_history(6, 200, varied=True)
    assert frame.schema == HISTORY_SCHEMA
    merged = pl.read_parquet(merge_parts(tmp_path, frame, part_rows=1_234))
    assert_frame_equal(merged, frame, check_exact=True)
    got, want = (
        f.get_column("value").fill_null(0.0).to_numpy().view(np.int64) for f in (merged, frame)
    )
    np.testing.assert_array_equal(got, want)  # -0.0 and subnormals too, bit for bit


def test_row_groups_are_brotli_with_each_ones_sample_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layout, "HISTORY_ROW_GROUP_ROWS", 1_000)
    frame = synthetic_history(6, 200, varied=True)  # 10,800 rows
    groups = column_chunks(merge_parts(tmp_path, frame, part_rows=1_234))
    # Row groups of 1,000 rows in history order, the last one what is left; every column of
    # every group brotli-compressed.
    assert [g[0]["rows"] for g in groups] == [1_000] * 10 + [800]
    assert {c["codec"] for g in groups for c in g} == {BROTLI}
    assert [c["name"].split(".")[0] for c in groups[0]] == list(HISTORY_SCHEMA)
    # Each group's sample_id statistics are its rows' range: a reader can skip groups by sample.
    for i, group in enumerate(groups):
        (chunk,) = (c for c in group if c["name"] == "sample_id")
        rows = frame.get_column("sample_id").slice(1_000 * i, 1_000)
        assert struct.unpack("<q", chunk["min"])[0] == rows.min()
        assert struct.unpack("<q", chunk["max"])[0] == rows.max()


def test_a_repeated_sample_costs_its_timestamps_not_its_values(tmp_path: Path) -> None:
    # 5 samples of 4,096 tensors: 184,320 rows, more than one row group of 2**17 rows, and
    # 295 KB of new random doubles in the first sample.
    samples, tensors = 5, 4_096
    frame = synthetic_history(samples, tensors)
    assert 2**17 < frame.height <= layout.HISTORY_ROW_GROUP_ROWS
    first = merge_parts(tmp_path / "first", frame.filter(pl.col("sample_id") == 0))
    whole = merge_parts(tmp_path / "whole", frame)
    assert_frame_equal(pl.read_parquet(whole), frame, check_exact=True)
    # What a later sample adds is its tensors' new timestamps (8 bytes each before compression)
    # and a little bookkeeping; its values repeat the first sample's. A layout that compresses
    # a row group's column in more than one page, or splits these rows into two row groups,
    # stores the values again (here 295 KB more than the bound).
    bound = first.stat().st_size + (samples - 1) * (tensors * 8 + 1024)
    assert whole.stat().st_size <= bound
