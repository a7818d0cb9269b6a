"""Output gradients: matched to their forward, first backward only, never altered."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.gradients import GradientRecorder
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.records import LayerInfo, TensorKey
from torchinstruments.spare_core import SpareCore

from conftest import mlp, read_history, values


def reference_output_gradients(model: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """d(loss)/d(output of each layer), computed on an unobserved copy with retain_grad."""
    outputs = []
    h = x
    for layer in copy.deepcopy(model):
        h = layer(h)
        h.retain_grad()
        outputs.append(h)
    (h**2).sum().backward()
    return [o.grad.detach().clone() for o in outputs]  # type: ignore[union-attr]


def test_output_gradient_statistics_match_an_independent_computation(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(11, 5)
    expected = reference_output_gradients(model, x)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    (model(x) ** 2).sum().backward()
    remove_observer(model)
    history = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    for index, grad in enumerate(expected):
        g = grad.double().numpy().ravel()
        rows = history.filter(pl.col("layer") == str(index))
        got = dict(zip(rows["metric"], rows["value"], strict=True))
        assert got["mean"] == pytest.approx(g.mean(), rel=1e-5, abs=1e-7)
        assert got["std"] == pytest.approx(g.std(), rel=1e-5)
        assert got["min"] == pytest.approx(g.min(), rel=1e-6)
        assert got["max"] == pytest.approx(g.max(), rel=1e-6)
        assert got["p50"] == pytest.approx(np.percentile(g, 50), rel=1e-5, abs=1e-7)
        assert rows["shape"].to_list()[0] == list(grad.shape)
        assert rows["forward_index"].unique().to_list() == [0]


def test_only_the_first_backward_through_a_sampled_output_is_recorded(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    y = model(torch.randn(3, 4))
    y.sum().backward(retain_graph=True)
    (y.sum() * 100).backward()
    remove_observer(model)
    grads = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    assert values(grads, layer="1", metric="mean") == [pytest.approx(1.0)]
    index = (run_dir / "index.md").read_text(encoding="utf-8")  # and the reader is told so
    assert "A later backward pass through the same output is not recorded" in index


def test_accumulated_forwards_are_matched_to_their_own_sample(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    first = model(torch.randn(3, 4)).sum()
    second = model(torch.randn(3, 4)).sum() * 3
    (first + second).backward()
    remove_observer(model)
    grads = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    assert values(grads, layer="1", metric="mean") == [pytest.approx(1.0), pytest.approx(3.0)]
    assert grads.filter(pl.col("sample_id") == 1)["forward_index"].unique().to_list() == [1]


def test_detached_branch_gets_no_gradient_rows(run_dir: Path) -> None:
    class TwoBranches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kept = nn.Linear(4, 4)
            self.cut = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.kept(x) + self.cut(x).detach()

    model = TwoBranches()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    history = read_history(run_dir)
    grads = history.filter(pl.col("signal") == "output_gradient")
    assert set(grads["layer"]) == {"kept"}
    assert set(history.filter(pl.col("signal") == "output")["layer"]) == {"kept", "cut"}


def test_gradients_of_several_backward_passes_are_each_flushed(run_dir: Path) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    for _ in range(6):
        model(torch.randn(2, 8)).sum().backward()
    remove_observer(model)
    grads = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    assert grads["forward_index"].unique().sort().to_list() == [0, 2, 4]


def test_gradient_via_autograd_grad_is_recorded(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    (gx,) = torch.autograd.grad(model(x).sum(), x)
    remove_observer(model)
    assert gx.shape == x.shape
    grads = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    assert values(grads, layer="1", metric="mean") == [pytest.approx(1.0)]


def test_hooks_on_leaf_outputs_do_not_pile_up_across_samples(run_dir: Path) -> None:
    class PassThrough(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x  # returns its (leaf) input itself

    weights = torch.randn(3, 2, requires_grad=True)
    model = nn.Sequential(PassThrough())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(5):
        (model(weights) * 2).sum().backward()
    assert len(weights._backward_hooks or {}) <= 1  # type: ignore[attr-defined]
    remove_observer(model)
    assert not weights._backward_hooks  # type: ignore[attr-defined]
    grads = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    assert values(grads, metric="mean") == [pytest.approx(2.0)] * 5


def test_forwards_without_backward_leave_at_most_one_hook_on_a_leaf_output(run_dir: Path) -> None:
    class Positional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.table  # a parameter returned as is

    model = Positional()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(5):
        model(torch.randn(1))
    assert len(model.table._backward_hooks or {}) == 1  # type: ignore[attr-defined]
    remove_observer(model)
    assert not model.table._backward_hooks  # type: ignore[attr-defined]


class _RecordingMode(torch.overrides.TorchFunctionMode):
    """A torch function mode that notes the name of every function it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.seen.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_under_a_torch_function_mode_hooks_are_not_seen_by_the_mode_and_gradients_match(
    run_dir: Path,
) -> None:
    """A non-leaf output's hook is put on the tensor without the handle `register_hook` makes
    (the observer never removes it), also under a user's torch function mode, which is set
    aside while the library hooks and measures (ambient.py): the mode never sees
    `register_hook`, and the gradients are the same."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(11, 5)
    expected = reference_output_gradients(model, x)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    mode = _RecordingMode()
    with mode:
        (model(x) ** 2).sum().backward()
    remove_observer(model)
    assert "register_hook" not in mode.seen
    history = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    for index, grad in enumerate(expected):
        rows = history.filter(pl.col("layer") == str(index))
        got = dict(zip(rows["metric"], rows["value"], strict=True))
        g = grad.double().numpy().ravel()
        assert got["mean"] == pytest.approx(g.mean(), rel=1e-5, abs=1e-7)
        assert got["max"] == pytest.approx(g.max(), rel=1e-6)


def test_an_outputs_gradient_hook_is_its_key_with_every_field_of_the_key() -> None:
    """The hook on a sampled output stands in for the output's key (one object per hooked
    output), so it carries every field of the key it was made from, the defaulted ones too: a
    field the copy missed would put the rows of the output and its gradient under another key."""
    recorder = GradientRecorder(
        Measurer(None), None, lambda *args: None, lambda *args: None, SpareCore()
    )
    layer = LayerInfo("block.0", "Linear")
    key = TensorKey(3, 7, layer, 2, "output", "[1]", "eval", True, step=41)
    output = torch.randn(4, requires_grad=True) * 2  # a non-leaf: the hook is kept
    hook = recorder.hook_output(key, output, True)
    assert hook is not key
    assert isinstance(hook, TensorKey)
    for field in dataclasses.fields(TensorKey):
        assert getattr(hook, field.name) == getattr(key, field.name), field.name


def _recorder() -> GradientRecorder:
    return GradientRecorder(
        Measurer(None), None, lambda *args: None, lambda *args: None, SpareCore()
    )


def test_a_series_hook_is_armed_again_for_its_next_sample_once_nothing_else_holds_it() -> None:
    """A 3,000-layer sampled step paid the collector for a new hook per output and sample; a
    series' hook is armed again for its next sample when nothing but the recorder holds it (its
    graph is gone), as that sample's key, with every field of it."""
    recorder = _recorder()
    layer = LayerInfo("block.0", "Linear")
    first = id(  # its tensor and graph are gone at once, and the test keeps only its id
        recorder.hook_output(
            TensorKey(0, 0, layer, 0, "output", "", "train", True),
            torch.randn(4, requires_grad=True) * 2,
            False,
        )
    )
    key = TensorKey(1, 5, layer, 0, "output", "", "eval", True, step=9)
    output = torch.randn(4, requires_grad=True) * 2
    again = recorder.hook_output(key, output, True)
    assert id(again) == first
    for field in dataclasses.fields(TensorKey):
        assert getattr(again, field.name) == getattr(key, field.name), field.name
    held = recorder.hook_output(
        TensorKey(2, 6, layer, 0, "output", "", "train", True),
        (torch.randn(4, requires_grad=True) * 2),
        False,
    )
    assert held is not again  # `output`'s graph still holds the first: a hook of its own
    assert (again.sample_id, again.forward_index) == (1, 5)


def test_a_hook_an_earlier_graph_still_holds_is_not_taken_by_the_next_sample(
    run_dir: Path,
) -> None:
    """A backward through an earlier sample's graph, run again after a later sample's forward
    (retain_graph), must not reach the later sample's rows: that graph's hooks are still held
    by it, so the later sample has hooks of its own."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    earlier = model(torch.randn(3, 4))
    earlier.sum().backward(retain_graph=True)
    later = model(torch.randn(3, 4))
    (earlier.sum() * 100).backward()  # the earlier sample's second pass: not recorded
    (later.sum() * 3).backward()
    remove_observer(model)
    grads = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    assert values(grads, layer="1", metric="mean") == [pytest.approx(1.0), pytest.approx(3.0)]


def test_a_loop_holding_the_last_loss_records_each_samples_own_gradients(run_dir: Path) -> None:
    """An ordinary loop holds the last step's loss (and graph) while it runs the next forward:
    each sample's gradient rows are its own, compared with plain hooks on an unobserved copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    inputs = [torch.randn(11, 5) for _ in range(4)]
    expected = [reference_output_gradients(model, x) for x in inputs]  # no update between
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    loss = None
    for x in inputs:
        loss = (model(x) ** 2).sum()
        loss.backward()
    del loss
    remove_observer(model)
    history = read_history(run_dir).filter(pl.col("signal") == "output_gradient")
    for sample_id, grads in enumerate(expected):
        for index, grad in enumerate(grads):
            rows = history.filter(pl.col("sample_id") == sample_id, pl.col("layer") == str(index))
            got = dict(zip(rows["metric"], rows["value"], strict=True))
            g = grad.double().numpy().ravel()
            assert got["mean"] == pytest.approx(g.mean(), rel=1e-5, abs=1e-7)
            assert got["max"] == pytest.approx(g.max(), rel=1e-6)
            assert rows["forward_index"].unique().to_list() == [sample_id]
