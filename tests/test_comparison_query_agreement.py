"""index.md's two-run comparison query finds, series by series, the first difference `compare`
finds: nulls for different reasons differ (one run's last batch empty, the other's all NaN:
real runs), and equal values never do, two NaN or two infinities of one sign included (written
into a copy of a run's history: the library itself writes a null with a reason there)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import polars as pl
import torch
from test_index_queries import execute
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.__main__ import main
from torchinstruments.rundir.page_queries import OTHER_RUN_LINE

KEY = ("layer", "call_index", "signal", "tensor_path", "mode", "metric")


def train(directory: Path, last: str) -> Path:
    """Three forwards of one MLP on the same batches, the last one `plain`, `empty` (null:
    empty tensor) or `nan` (null: no finite entries)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # empty and NaN tensors are said
        for i in range(3):
            batch = torch.randn(5, 4)
            if i == 2 and last == "empty":
                batch = torch.randn(0, 4)
            if i == 2 and last == "nan":
                batch = torch.full((5, 4), float("nan"))
            model(batch).sum().backward()
    remove_observer(model)
    return directory


def query_firsts(mine: Path, other: Path) -> dict[tuple[Any, ...], int]:
    found, _ = execute(
        (mine / "index.md").read_text(encoding="utf-8"),
        {OTHER_RUN_LINE: f"other_run = Path({json.dumps(str(other))})"},
    )
    return {row[:-1]: row[-1] for row in found["first"].select(*KEY, "first_sample").rows()}


def compare_firsts(mine: Path, other: Path) -> dict[tuple[Any, ...], int]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["compare", str(mine), str(other), "--format", "json"]) == 0
    rows = json.loads(out.getvalue())["rows"]
    return {
        tuple(r[k] for k in KEY): r["first_difference"]
        for r in rows
        if r["first_difference"] is not None
    }


def test_the_comparison_query_differs_where_the_nulls_reasons_differ_as_compare(
    tmp_path: Path,
) -> None:
    mine = train(tmp_path / "empty", "empty")
    other = train(tmp_path / "nan", "nan")
    reasons = pl.read_parquet(mine / "history.parquet").join(
        pl.read_parquet(other / "history.parquet"), on=[*KEY, "sample_id"], suffix="_other"
    )
    apart = reasons.filter(
        pl.col("value").is_null(),
        pl.col("value_other").is_null(),
        pl.col("unavailable_reason") != pl.col("unavailable_reason_other"),
    )
    assert apart.height > 0  # "empty tensor" against "no finite entries"
    query = query_firsts(mine, other)
    assert query == compare_firsts(mine, other)
    for r in apart.iter_rows(named=True):
        assert query[tuple(r[k] for k in KEY)] == 2


def test_the_comparison_query_finds_no_difference_between_equal_nonfinite_values(
    tmp_path: Path,
) -> None:
    mine = train(tmp_path / "a", "plain")
    other = tmp_path / "b"
    shutil.copytree(mine, other)
    edits = {("0", "mean", 0): float("nan"), ("2", "max", 1): float("inf")}
    for run in (mine, other):
        rows = pl.read_parquet(run / "history.parquet")
        for (layer, metric, sample), value in edits.items():
            at = (
                (pl.col("layer") == layer)
                & (pl.col("signal") == "output")
                & (pl.col("metric") == metric)
                & (pl.col("sample_id") == sample)
            )
            rows = rows.with_columns(value=pl.when(at).then(value).otherwise("value"))
        rows.write_parquet(run / "history.parquet")
    assert compare_firsts(mine, other) == {}
    assert query_firsts(mine, other) == {}
