"""A model cast mid-run (`model.half()`, `model.to(torch.bfloat16)`) or run under autocast on
some steps only: its tensors have more than one dtype over the run.

Every history row carries the dtype its tensor had; the summaries must not describe the whole
run as the latest dtype: result.json's tensor entry keeps `dtype` (the latest) and lists each
dtype with its sample range in `dtypes`, and index.md names each layer whose dtype changed, with
the samples of each dtype. The expected dtypes and sample ranges are the ones the test itself
cast at, not read back from the library.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.__main__ import main as cli_main
from torchinstruments.rundir import series_stats, summary
from torchinstruments.rundir.state import read_state

LAYERS = ("0", "1", "2")  # Linear, Tanh, Linear


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def step(net: nn.Module, dtype: torch.dtype, autocast: bool = False) -> None:
    """One sampled forward and backward with inputs of `dtype` (or float32 inputs under CPU
    autocast to bfloat16)."""
    x = torch.randn(3, 4, dtype=torch.float32 if autocast else dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = net(x)
    out.float().sum().backward()


def result_tensors(directory: Path) -> dict[tuple[str, str], dict]:
    """result.json's tensor entries by (layer, signal)."""
    records = json.loads((directory / "result.json").read_text(encoding="utf-8"))
    return {(r["layer"], t["signal"]): t for r in records for t in r["tensors"]}


def index_text(directory: Path) -> str:
    return " ".join((directory / "index.md").read_text(encoding="utf-8").split())


@pytest.mark.parametrize(
    ("cast", "name"),
    [(lambda m: m.to(torch.bfloat16), "bfloat16"), (lambda m: m.half(), "float16")],
    ids=["to-bfloat16", "half"],
)
def test_a_model_cast_mid_run_lists_each_dtype_with_its_samples(
    run_dir: Path, cast: Callable[[nn.Module], nn.Module], name: str
) -> None:
    net = model()
    inject_observer(net, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        step(net, torch.float32)
    cast(net)
    for _ in range(2):
        step(net, getattr(torch, name))
    remove_observer(net)

    history = pl.read_parquet(run_dir / "history.parquet")
    per_row = history.group_by("sample_id").agg(pl.col("dtype").unique()).sort("sample_id")
    assert per_row.rows() == [(i, ["float32"]) for i in range(3)] + [(i, [name]) for i in (3, 4)]
    tensors = result_tensors(run_dir)
    assert set(tensors) == {(layer, s) for layer in LAYERS for s in ("output", "output_gradient")}
    for key, tensor in tensors.items():
        assert tensor["dtype"] == name, key  # the latest, as before
        assert tensor["dtypes"] == [
            {"dtype": "float32", "first_sample_id": 0, "last_sample_id": 2},
            {"dtype": name, "first_sample_id": 3, "last_sample_id": 4},
        ], key
    index = index_text(run_dir)
    assert "**Note:** dtype changed during the run: 3 layers recorded tensors of more than" in index
    for layer, kind in zip(LAYERS, ("Linear", "Tanh", "Linear"), strict=True):
        assert f"`{layer}` ({kind}): float32 samples 0-2, {name} samples 3-4" in index

    # finalize renders index.md again from the state and recomputes the same
    (run_dir / "index.md").unlink()
    assert cli_main(["finalize", str(run_dir)]) == 0
    assert f"`2` (Linear): float32 samples 0-2, {name} samples 3-4" in index_text(run_dir)


def test_autocast_on_some_steps_gives_overlapping_ranges_per_dtype(run_dir: Path) -> None:
    """Steps alternating with and without autocast: each dtype's first and last sample, so
    the ranges overlap and neither dtype reads as the whole run's."""
    net = model()
    inject_observer(net, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for i in range(5):
        step(net, torch.float32, autocast=i % 2 == 1)
    remove_observer(net)
    entry = result_tensors(run_dir)[("0", "output")]
    assert entry["dtype"] == "float32"  # sample 4 ran without autocast
    assert entry["dtypes"] == [
        {"dtype": "float32", "first_sample_id": 0, "last_sample_id": 4},
        {"dtype": "bfloat16", "first_sample_id": 1, "last_sample_id": 3},
    ]
    assert "`0` (Linear): float32 samples 0-4, bfloat16 samples 1-3" in index_text(run_dir)


def test_a_run_of_one_dtype_has_no_dtypes_list_and_no_dtype_note(run_dir: Path) -> None:
    net = model()
    inject_observer(net, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        step(net, torch.float32)
    remove_observer(net)
    assert all("dtypes" not in t for t in result_tensors(run_dir).values())
    assert "**Note:** dtype changed during the run" not in index_text(run_dir)


@pytest.mark.parametrize("chunk_rows", [5, 18, 54, 1_000_000])
def test_dtypes_are_the_same_however_history_is_cut_into_chunks(
    run_dir: Path, chunk_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary reads history in chunks (a sample's 54 rows may straddle two): each
    tensor's dtypes and their samples match a plain loop over the rows, whether the second
    dtype first appears in the first chunk or many chunks later."""
    net = model()
    inject_observer(net, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for i in range(6):
        step(net, torch.float32, autocast=i in (3, 5))
    remove_observer(net)
    monkeypatch.setattr(series_stats, "SUMMARY_CHUNK_ROWS", chunk_rows)
    state = read_state(run_dir)
    changes = summary.write_result(run_dir, state.run.layers, state.run.history.window)

    spans: dict[tuple, dict[str, list[int]]] = {}
    for row in pl.read_parquet(run_dir / "history.parquet").iter_rows(named=True):
        key = (row["layer"], row["signal"])
        found = spans.setdefault(key, {}).setdefault(row["dtype"], [row["sample_id"]] * 2)
        found[0], found[1] = min(found[0], row["sample_id"]), max(found[1], row["sample_id"])
    for key, tensor in result_tensors(run_dir).items():
        expected = [
            {"dtype": d, "first_sample_id": f, "last_sample_id": la}
            for d, (f, la) in sorted(spans[key].items(), key=lambda item: item[1])
        ]
        assert tensor["dtypes"] == expected, key
    assert changes.total == 3
    assert changes.layers[0] == "`0` (Linear): float32 samples 0-4, bfloat16 samples 3-5"
