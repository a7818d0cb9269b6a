"""A plain loop that calls model.eval(): its eval samples are series of their own everywhere a
run is summarized (show, heatmap, plot, TensorBoard), and plot/heatmap can draw over `step`.

result.json's entries per mode are pinned in tests/test_summary.py (against plain Python), the
trainers' in tests/test_trainer_phases.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer, set_step

from conftest import cli_in_process, read_heatmap, read_history

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps of two training forwards and one eval forward each, every forward sampled."""
    run = tmp_path_factory.mktemp("mixed") / "stats"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    for step in range(4):
        set_step(model, 10 * step)
        for _ in range(2):
            model(torch.randn(8, 4)).sum().backward()
        model.eval()
        with torch.no_grad():
            model(torch.randn(8, 4) * 5)  # other inputs: eval values differ from train ones
        model.train()
    remove_observer(model)
    return run


def test_show_gives_eval_its_own_latest_and_window(mixed: Path) -> None:
    history = read_history(mixed)
    result = cli_in_process("show", mixed, "--format", "csv", "--metrics", "std")
    assert result.returncode == 0, result.stderr
    shown = pl.read_csv(result.stdout.encode(), schema_overrides={"layer": pl.String}).filter(
        pl.col("layer") == "0", pl.col("signal") == "output"
    )
    assert sorted(shown["mode"].to_list()) == ["eval", "train"]
    for mode in ("train", "eval"):
        rows = history.filter(
            pl.col("layer") == "0",
            pl.col("signal") == "output",
            pl.col("metric") == "std",
            pl.col("mode") == mode,
        ).sort("sample_id")
        [row] = shown.filter(pl.col("mode") == mode).iter_rows(named=True)
        assert row["latest_sample_id"] == rows["sample_id"][-1]
        assert row["latest_value"] == rows["value"][-1]
        assert row["observations"] == rows.height  # 8 train samples, 4 eval ones
    text = cli_in_process("show", mixed, "--metrics", "std", "--all").stdout
    assert "0 [eval]" in text


def test_heatmap_over_step_has_eval_rows_and_sample_columns(mixed: Path, tmp_path: Path) -> None:
    result = cli_in_process("heatmap", mixed, "--metrics", "mean", "--x", "step", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    _, meta = read_heatmap(tmp_path / "heatmap-mean.png")
    samples = read_history(mixed).select("sample_id", "step").unique().sort("step", "sample_id")
    assert meta["x"] == "step"
    assert meta["columns"] == samples["step"].to_list()  # 12 samples, 3 per step
    assert meta["columns"][:3] == [0, 0, 0]
    rows = [tuple(r) for r in meta["rows"]]
    assert rows[:2] == [("0", 0, "", "train"), ("0", 0, "", "eval")]
    assert len(rows) == 6  # 3 layers x (train, eval)


def test_plot_over_step_draws_eval_as_its_own_line(mixed: Path, tmp_path: Path) -> None:
    png = tmp_path / "trends.png"
    result = cli_in_process("plot", mixed, "-o", png, "--metrics", "mean", "--x", "step")
    assert result.returncode == 0, result.stderr
    description = json.loads(Image.open(png).text["Description"])  # type: ignore[attr-defined]
    assert description["x"] == "step"
    assert description["tensors"][:2] == ["0 (Linear)", "0 [eval] (Linear)"]


def test_plot_over_step_without_steps_says_what_gives_one(tmp_path: Path) -> None:
    run = tmp_path / "stats"
    model = nn.Linear(3, 2)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 3))
    remove_observer(model)
    for args in (("plot", "-o", tmp_path / "x.png"), ("heatmap", "-o", tmp_path)):
        result = cli_in_process(args[0], run, "--x", "step", *args[1:])
        assert result.returncode == 1
        assert "has a step" in result.stderr
        assert "set_step(model, step)" in result.stderr


def test_tensorboard_eval_samples_have_tags_of_their_own(mixed: Path) -> None:
    history = read_history(mixed)
    events = EventAccumulator(str(mixed / "tensorboard"), {HISTOGRAMS: 0}).Reload()
    eval_steps = history.filter(pl.col("mode") == "eval")["forward_index"].unique().sort().to_list()
    train_steps = (
        history.filter(pl.col("mode") == "train", pl.col("signal") == "output")["forward_index"]
        .unique()
        .sort()
        .to_list()
    )
    assert [e.step for e in events.Histograms("eval/0/call_0/output/tensor")] == eval_steps
    assert [e.step for e in events.Histograms("0/call_0/output/tensor")] == train_steps
