"""history.parquet's physical layout: the merge round-trips every column exactly (with the
parts' constant columns streamed as literals, or read where a part does not name them), writes
brotli row groups of HISTORY_ROW_GROUP_ROWS rows whose sample ranges a reader can prune on (read
from the file's footer, not through Polars), and a sample that repeats the previous one's values
costs about its new timestamps, not its values again, within a row group of more than 2**16
tensors."""

from __future__ import annotations

import json
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
    CONSTANT_KEY,
    HISTORY_FILE,
    HISTORY_SCHEMA,
    ORDER_KEY,
    PARTS_DIR,
    constant_metadata,
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
            "shape": pl.Series([[8, 16]]).new_from_index(0, n),  # a list a row from Python: seconds
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


def write_parts(
    directory: Path, frame: pl.DataFrame, part_rows: int = 8192, *, first: int = 0
) -> None:
    """Write `frame` as the writer does: parts of `part_rows` rows, numbered from `first`, with
    their order and constant columns in their metadata."""
    (directory / PARTS_DIR).mkdir(parents=True, exist_ok=True)
    for i, offset in enumerate(range(0, frame.height, part_rows)):
        part = frame.slice(offset, part_rows)
        metadata = order_metadata(part) | constant_metadata(part)
        write_parquet_atomic(part, part_path(directory, first + i), metadata=metadata)


def merge_parts(directory: Path, frame: pl.DataFrame, part_rows: int = 8192) -> Path:
    """Write `frame` as the writer does, merge the parts, and return history.parquet."""
    write_parts(directory, frame, part_rows)
    return merge_history(directory).path


def assert_same_rows(path: Path, frame: pl.DataFrame) -> None:
    """history.parquet holds `frame`'s rows frame for frame, its values bit for bit."""
    merged = pl.read_parquet(path)
    assert_frame_equal(merged, frame, check_exact=True)
    got, want = (
        f.get_column("value").fill_null(0.0).to_numpy().view(np.int64) for f in (merged, frame)
    )
    np.testing.assert_array_equal(got, want)  # -0.0 and subnormals too, bit for bit


def constant_entry(path: Path) -> dict[str, object] | None:
    entry = pl.read_parquet_metadata(path).get(CONSTANT_KEY)
    return None if entry is None else json.loads(entry)


@pytest.mark.parametrize("row_group_rows", [None, 1_000])
@pytest.mark.parametrize("varied", [False, True])
def test_merged_history_equals_its_rows_frame_for_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row_group_rows: int | None, varied: bool
) -> None:
    if row_group_rows is not None:  # many row groups and pages, with boundaries mid-sample
        monkeypatch.setattr(layout, "HISTORY_ROW_GROUP_ROWS", row_group_rows)
    frame = synthetic_history(6, 200, varied=varied)
    assert frame.schema == HISTORY_SCHEMA
    merged = merge_parts(tmp_path, frame, part_rows=1_234)
    assert_same_rows(merged, frame)
    # The columns one value in every row were literals: named as such, with that value.
    constant = {c: frame[c][0] for c in frame.columns if frame[c].n_unique() == 1}
    constant = {c: v.to_list() if isinstance(v, pl.Series) else v for c, v in constant.items()}
    assert constant_entry(merged) == constant
    assert {"rank", "shape", "dtype", "mode", "attempt"} <= set(constant)


@pytest.mark.parametrize(
    "entry",
    [None, '{"dtype": 5}', '{"shape": "[8, 16]"}', '{"step": 1.5}', '{"nope": 1}', "{", "[]"],
)
def test_parts_without_or_with_unusable_constants_are_read(
    tmp_path: Path, entry: str | None
) -> None:
    frame = synthetic_history(4, 100)
    write_parts(tmp_path, frame, part_rows=500)
    parts = sorted((tmp_path / PARTS_DIR).iterdir())
    # A part of a version before the entry (None), or every part with an entry that names a
    # value its column cannot hold, or no column: no literal stands for their rows.
    for part in parts[1:2] if entry is None else parts:
        rows = pl.read_parquet(part)
        extra = {} if entry is None else {CONSTANT_KEY: entry}
        rows.write_parquet(part, metadata=order_metadata(rows) | extra)
    merged = merge_history(tmp_path).path
    assert pl.read_parquet_metadata(merged).get(ORDER_KEY)  # concatenated, not sorted
    assert_same_rows(merged, frame)
    assert constant_entry(merged) is None


def test_a_continued_run_merges_into_its_history_with_what_stays_constant(
    tmp_path: Path,
) -> None:
    # A first attempt's history.parquet, then a second attempt's parts: its attempt differs.
    frame = synthetic_history(6, 100)
    first = frame.filter(pl.col("sample_id") < 3)
    later = frame.filter(pl.col("sample_id") >= 3).with_columns(attempt=pl.lit(1, pl.Int32))
    merge_parts(tmp_path, first, part_rows=700)
    assert constant_entry(tmp_path / HISTORY_FILE)["attempt"] == 0  # type: ignore[index]
    write_parts(tmp_path, later, part_rows=700, first=100)
    merged = merge_history(tmp_path).path
    assert_same_rows(merged, pl.concat([first, later]))
    entry = constant_entry(merged)
    assert entry is not None
    assert "attempt" not in entry
    assert entry["dtype"] == "float32"


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


@pytest.mark.parametrize(("samples", "tensors"), [(5, 4_096), (2, 36_000)])
def test_a_repeated_sample_costs_its_timestamps_not_its_values(
    tmp_path: Path, samples: int, tensors: int
) -> None:
    # 5 samples of 4,096 tensors: 184,320 rows, more than a row group of 2**17 rows, and 295
    # KB of new random doubles in the first sample. 2 samples of 36,000 tensors: 648,000 rows,
    # more than 2**19, and more distinct timestamps than a 16-bit dictionary key holds (the
    # row group's size is chosen so: brotli compresses its wider keys better, see `layout`).
    frame = synthetic_history(samples, tensors)
    assert 2**17 < frame.height <= layout.HISTORY_ROW_GROUP_ROWS
    assert tensors < 2**16 or frame.get_column("timestamp").n_unique() > 2**16
    first = merge_parts(tmp_path / "first", frame.filter(pl.col("sample_id") == 0))
    whole = merge_parts(tmp_path / "whole", frame)
    assert_frame_equal(pl.read_parquet(whole), frame, check_exact=True)
    # What a later sample adds is its tensors' new timestamps (8 bytes each before compression)
    # and a little bookkeeping; its values repeat the first sample's. A layout that compresses
    # a row group's column in more than one page, or splits these rows into two row groups,
    # stores the values again (here 295 KB, or 2.6 MB, more than the bound).
    bound = first.stat().st_size + (samples - 1) * (tensors * 8 + 1024)
    assert whole.stat().st_size <= bound


def test_a_column_is_named_constant_only_when_every_row_holds_its_value() -> None:
    """The per-type tests (`min == max`, a comparison with the first string, lists compared
    entry by entry) agree with `n_unique` where a column differs only in one middle row, where
    lists differ in length, and where every list is empty."""
    n = 101
    middle = n // 2
    frame = pl.DataFrame(
        {
            "same_int": [7] * n,
            "int_mid": [7] * middle + [8] + [7] * (n - middle - 1),
            "same_str": ["a"] * n,
            "str_mid": ["a"] * middle + ["b"] + ["a"] * (n - middle - 1),
            "same_list": [[64, 256]] * n,
            "list_mid": [[64, 256]] * middle + [[64, 255]] + [[64, 256]] * (n - middle - 1),
            "list_len": [[64, 256]] * middle + [[64, 256, 1]] + [[64, 256]] * (n - middle - 1),
            "empty_lists": pl.Series([[]] * n, dtype=pl.List(pl.Int64)),
            "same_bool": [True] * n,
            "bool_mid": [True] * middle + [False] + [True] * (n - middle - 1),
        }
    )
    entry = json.loads(constant_metadata(frame)[CONSTANT_KEY])
    by_hand = {c: frame[c][0] for c in frame.columns if frame[c].n_unique() == 1}
    by_hand = {c: v.to_list() if isinstance(v, pl.Series) else v for c, v in by_hand.items()}
    assert entry == by_hand
    assert set(entry) == {"same_int", "same_str", "same_list", "empty_lists", "same_bool"}
