"""The conformance harness can fail: each kind of difference from plain hooks is reported.

The zoo (test_conformance_zoo.py) passes only if `hook_reference.compare` finds nothing; these
tests feed it a real run's rows with one thing changed at a time and check that it says so.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from hook_reference import HookRecorder, compare, observed_tensors, run_both
from reference_values import reference_tensor


def observed_run(run_dir: Path) -> tuple[pl.DataFrame, HookRecorder]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def step(m: nn.Module, i: int) -> torch.Tensor:
        out = m(torch.randn(3, 4))
        out.square().sum().backward()
        return out

    result = run_both(model, step, run_dir)
    assert result.catalog == ["0", "1", "2"]
    return result.history, result.recorder


def problems(history: pl.DataFrame, recorder: HookRecorder) -> list[str]:
    return compare(observed_tensors(history), recorder.tensors)


def test_a_real_run_conforms(run_dir: Path) -> None:
    history, recorder = observed_run(run_dir)
    assert problems(history, recorder) == []
    assert len(recorder.tensors) == 6  # 3 layers x (output, output_gradient)


def test_a_changed_value_is_reported(run_dir: Path) -> None:
    history, recorder = observed_run(run_dir)
    where = (pl.col("layer") == "1") & (pl.col("metric") == "p50")
    changed = history.with_columns(
        pl.when(where).then(pl.col("value") * (1 + 1e-9) + 1e-12).otherwise("value").alias("value")
    )
    found = problems(changed, recorder)
    assert found
    assert all("'1'" in line and "p50" in line for line in found)


def test_a_missing_row_and_a_row_without_reference_are_reported(run_dir: Path) -> None:
    history, recorder = observed_run(run_dir)
    without = history.filter(~((pl.col("layer") == "2") & (pl.col("signal") == "output_gradient")))
    assert any("without a row" in line for line in problems(without, recorder))
    extra = history.filter(pl.col("layer") == "0").with_columns(pl.lit(5).alias("call_index"))
    found = problems(pl.concat([history, extra]), recorder)
    assert any("row without a reference" in line for line in found)


def test_a_null_where_numpy_has_a_value_is_reported(run_dir: Path) -> None:
    history, recorder = observed_run(run_dir)
    nulled = history.with_columns(
        pl.when(pl.col("layer") == "0").then(None).otherwise("value").alias("value"),
        pl.when(pl.col("layer") == "0")
        .then(pl.lit("statistics error: X"))
        .otherwise("unavailable_reason")
        .alias("unavailable_reason"),
    )
    assert any("null (statistics error: X)" in line for line in problems(nulled, recorder))


def test_expected_nulls_need_the_stated_reason() -> None:
    empty = reference_tensor(torch.empty(0))
    assert all(value is None for value in empty.values.values())
    assert empty.reason == r"^empty tensor$"
    nan = reference_tensor(torch.tensor([float("nan"), 0.0, float("inf")]))
    assert nan.values["nonfinite_fraction"] == pytest.approx(2 / 3)
    assert nan.values["zero_fraction"] == pytest.approx(1 / 3)
    assert nan.values["mean"] == 0.0
