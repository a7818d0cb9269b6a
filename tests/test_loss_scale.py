"""Loss scaling: gradient rows stay what plain hooks see, and the run records each sample's scale.

A real float16-autocast loop on CPU with `torch.amp.GradScaler("cpu")`, whose scale overflows,
halves and grows during the run, is run twice in lockstep: observed (`grad_scaler=`), and on a
deep copy with plain hooks (`register_forward_hook` + `Tensor.register_hook`, NumPy statistics).
The scale recorded for each sample is `scaler.get_scale()` at that step, and index.md's query
divides the gradient rows by it into the plain hooks' gradient statistics divided by that scale.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import inject_observer, remove_observer
from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import LayerInfo, RunCounts, RunInfo, ScaleSpan
from torchinstruments.rundir.index_page import render_index
from torchinstruments.rundir.page_loss_scale import SCALED_METRICS
from torchinstruments.rundir.state import RunState

from conftest import mlp, numpy_profile, observe, read_history, strict_json

STEPS = 12


def scaled_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
) -> None:
    """One mixed-precision step as torch's AMP recipe writes it."""
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def hooked(model: nn.Module, grads: dict[str, list[np.ndarray]]) -> None:
    """Plain hooks: the gradient into each leaf's output, per step, as float64 NumPy."""
    for name, module in model.named_modules():
        if name and not list(module.children()):

            def keep(_m: nn.Module, _i: Any, out: torch.Tensor, name: str = name) -> None:
                out.register_hook(lambda g: grads[name].append(g.detach().double().numpy()))

            module.register_forward_hook(keep)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_recorded_scale_per_sample_unscales_rows_to_plain_hook_gradients(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = mlp(16, 2)
    reference = copy.deepcopy(model)
    grads: dict[str, list[np.ndarray]] = {n: [] for n in ("0", "1", "2", "3")}
    hooked(reference, grads)
    # A scale far too large for float16 gradients: the weights' gradients overflow (inf:
    # skipped step, halved), then it grows again every 2 clean steps, so it changes in the run.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=2)
    reference_scaler = copy.deepcopy(scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(32, 16)
    with pytest.warns(RuntimeWarning, match="grad_scaler GradScaler"):
        directory = observe(model, run_dir, grad_scaler=scaler)
    scales = []
    for _ in range(STEPS):
        scales.append(scaler.get_scale())
        scaled_step(model, optimizer, scaler, x)
        scaled_step(reference, reference_optimizer, reference_scaler, x)
    remove_observer(model)

    assert len(set(scales)) > 2  # the scale halved and grew during the run
    spans = strict_json(directory / ".state.json")["counts"]["loss_scales"]
    firsts = [span["first_sample_id"] for span in spans]
    assert firsts == sorted(firsts)
    assert spans[-1] == {"first_sample_id": STEPS, "scale": None}  # none after the last sample
    recorded = [
        next(span["scale"] for span in reversed(spans) if span["first_sample_id"] <= sample)
        for sample in range(STEPS)
    ]
    assert recorded == scales

    page = (directory / "index.md").read_text(encoding="utf-8")
    assert "**Gradient rows are scaled:**" in page
    assert f"sample 0: {scales[0]:.0f}; " in page  # exact: 4194304, not 4.1943e+06
    blocks = python_blocks(page)
    (setup,) = [block for block in blocks if "def this_run" in block]
    (query,) = [block for block in blocks if "join_asof" in block]
    session: dict[str, Any] = {}
    exec(compile(setup, "index.md:setup", "exec"), session)
    exec(compile(query, "index.md:loss-scale", "exec"), session)
    unscaled: pl.DataFrame = session["unscaled"]

    history = read_history(directory).filter(pl.col("signal") == "output_gradient")
    rows = history.filter(pl.col("metric").is_in(SCALED_METRICS), pl.col("value").is_not_null())
    assert unscaled.height == rows.height > 0
    checked = 0
    for row in unscaled.iter_rows(named=True):
        want = numpy_profile(grads[row["layer"]][row["sample_id"]])[row["metric"]]
        scale = scales[row["sample_id"]]
        assert row["scale"] == scale
        if want is None:
            assert row["value"] is None
            continue
        assert row["value"] == pytest.approx(want, rel=1e-6, abs=1e-9 * scale)  # plain hooks
        assert row["unscaled"] == pytest.approx(want / scale, rel=1e-6, abs=1e-9)
        checked += 1
    assert checked > 0


def test_grad_scaler_must_be_a_grad_scaler(run_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"grad_scaler must be a torch\.amp\.GradScaler.*float"):
        inject_observer(mlp(), output_dir=run_dir, grad_scaler=65536.0)
    assert not run_dir.exists()


def test_float16_autocast_without_grad_scaler_is_said(run_dir: Path) -> None:
    model = mlp(8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        directory = observe(model, run_dir)
    with (
        pytest.warns(RuntimeWarning, match="no grad_scaler was given"),
        torch.autocast("cpu", dtype=torch.float16),
    ):
        model(torch.randn(4, 8)).float().sum().backward()
    remove_observer(model)
    page = (directory / "index.md").read_text(encoding="utf-8")
    assert "float16 autocast was on in sampled forwards and no grad_scaler was given" in page
    assert "## Loss scale" not in page


def test_bfloat16_autocast_without_grad_scaler_says_nothing_of_scaling(run_dir: Path) -> None:
    model = mlp(8, 1)
    directory = observe(model, run_dir)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("error")
        model(torch.randn(4, 8)).float().sum().backward()
    remove_observer(model)
    page = (directory / "index.md").read_text(encoding="utf-8")
    assert "## Loss scale" not in page
    assert "no grad_scaler was given" not in page
    assert (
        "loss_scales" not in strict_json(directory / ".state.json")["counts"]
        or not (strict_json(directory / ".state.json")["counts"]["loss_scales"])
    )


def test_a_continued_run_keeps_each_attempts_scales(run_dir: Path) -> None:
    """The second attempt's spans follow the first's, one span per first sample: the first's
    closing span (no scale after its last sample, for a killed attempt's samples between them)
    gives way where the next attempt starts right after it."""
    scales = []
    for attempt, init_scale in enumerate((1024.0, 4096.0)):
        model = mlp(8, 1)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            directory = observe(model, run_dir, grad_scaler=scaler, resume=attempt > 0)
        for _ in range(3):
            scales.append(scaler.get_scale())
            scaled_step(model, optimizer, scaler, torch.randn(4, 8))
        remove_observer(model)
    spans = strict_json(directory / ".state.json")["counts"]["loss_scales"]
    assert spans == [
        *({"first_sample_id": i, "scale": s} for i, s in enumerate(scales[:3])),
        *({"first_sample_id": i + 3, "scale": s} for i, s in enumerate(scales[3:])),
        {"first_sample_id": 6, "scale": None},
    ]
    page = (directory / "index.md").read_text(encoding="utf-8")
    assert f"sample 2: {scales[2]:.17g}; sample 3: {scales[3]:.17g}" in page


def state_with(tmp_path: Path, counts: RunCounts | None, **changes: Any) -> RunState:
    run = RunInfo(
        output_dir=tmp_path,
        library_version="0.1.0",
        torch_version="2.15.0",
        model_class="Net",
        layers=(LayerInfo("fc", "Linear"),),
        focus_layers=("fc",),
        sampler="EveryNForwardsSampler(n=1)",
        metrics=("mean", "zero_fraction"),
        rank=None,
        world_size=None,
        rank_policy="rank0",
        capture_direct_forwards=True,
        history=HistoryConfig(),
        started_at="2026-01-01T00:00:00+00:00",
        grad_scaler="GradScaler(enabled=True)",
    )
    return RunState(run, counts, **changes)


def test_index_says_which_samples_have_no_recorded_scale(tmp_path: Path) -> None:
    live = render_index(state_with(tmp_path, None))
    assert "saved in .state.json (`loss_scales`) as the run's rows are" in live
    saved = (ScaleSpan(0, 1024.0), ScaleSpan(2, None))  # the live run's save so far
    live = render_index(state_with(tmp_path, None, loss_scales=saved))
    assert "(so far: the run goes on) (2 span(s), one per change): samples 0-1: 1024; " in live
    # killed after its rows of samples 2-4 reached the disk, before it saved their scales
    killed = state_with(tmp_path, RunCounts(5, 5, 5, loss_scales=saved), counts_recovered=True)
    assert "samples 0-1: 1024; samples 2 on: not recorded." in render_index(killed)
    killed = render_index(state_with(tmp_path, RunCounts(5, 5, 5), counts_recovered=True))
    assert "No loss scale is recorded: the process ended before the run saved any" in killed
    # an earlier attempt was killed (its spans died with it), the next one recorded its own
    spans = (ScaleSpan(3, 1024.0), ScaleSpan(5, 512.0), ScaleSpan(6, None))
    page = render_index(state_with(tmp_path, RunCounts(6, 6, 6, loss_scales=spans)))
    assert "samples 0-2: not recorded; samples 3-4: 1024; samples 5 on: 512." in page
    assert "SCALED = ['mean']" in page  # a fraction does not scale
