"""Removal restores the model exactly, and leaves nothing behind over many cycles."""

from __future__ import annotations

import gc
import os
import threading
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import (
    EveryNForwardsSampler,
    has_observer,
    inject_observer,
    remove_observer,
)

from conftest import mlp, page_prose, read_history


def snapshot(model: nn.Module) -> dict[str, object]:
    """Everything about a model that observation must not change (besides `forward`)."""
    return {
        "dicts": {name: dict(m.__dict__) for name, m in model.named_modules()},
        "state_keys": list(model.state_dict().keys()),
        "parameters": [id(p) for p in model.parameters()],
        "buffers": [id(b) for b in model.buffers()],
        "children": {name: [id(c) for c in m.children()] for name, m in model.named_modules()},
    }


def test_model_is_identical_during_and_after_observation_except_forward(run_dir: Path) -> None:
    model = nn.Sequential(mlp(), nn.BatchNorm1d(8))
    before = snapshot(model)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    during = snapshot(model)
    # Between root forwards only the root carries a proxy (layers get theirs per sample).
    for name, module_dict in during["dicts"].items():  # type: ignore[union-attr]
        assert ("forward" in module_dict) == (name == ""), name
        without = {k: v for k, v in module_dict.items() if k != "forward"}
        assert without == before["dicts"][name]  # type: ignore[index]
    for key in ("state_keys", "parameters", "buffers", "children"):
        assert during[key] == before[key]
    model(torch.randn(4, 8)).sum().backward()
    remove_observer(model)
    after = snapshot(model)
    assert after == before
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_pre_existing_instance_forward_is_restored_by_identity(run_dir: Path) -> None:
    model = mlp()
    custom = model[0].forward
    model[0].forward = custom

    def root_forward(x: torch.Tensor) -> torch.Tensor:
        return nn.Sequential.forward(model, x) * 2

    model.forward = root_forward  # type: ignore[assignment]
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    x = torch.randn(2, 8)
    observed = model(x)
    remove_observer(model)
    assert model[0].__dict__["forward"] is custom
    assert model.__dict__["forward"] is root_forward
    assert torch.equal(observed, model(x))
    assert read_history(run_dir)["layer"].unique().len() == 6


def test_root_forward_wrapped_by_someone_else_after_injection_is_not_clobbered(
    run_dir: Path,
) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    ours = model.forward
    calls = []

    def theirs(*args: object) -> object:
        calls.append(1)
        return ours(*args)

    model.forward = theirs  # type: ignore[assignment]
    model(torch.randn(2, 8))
    with pytest.warns(RuntimeWarning, match="1 module forward"):
        remove_observer(model)
    assert model.__dict__["forward"] is theirs
    x = torch.randn(2, 8)
    assert torch.equal(model(x), nn.Sequential.forward(model, x))
    assert len(calls) == 2
    assert read_history(run_dir)["forward_index"].unique().to_list() == [0]


def test_root_forward_replaced_mid_run_is_named_in_index_with_what_was_not_observed(
    run_dir: Path,
) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 8))  # observed
    model.forward = lambda x: nn.Sequential.forward(model, x)  # type: ignore[assignment]
    for _ in range(3):
        model(torch.randn(2, 8))  # through the replacement: not observed
    with pytest.warns(RuntimeWarning, match=r"1 module forward.*\(the root \(Sequential\)\)"):
        remove_observer(model)
    index = (run_dir / "index.md").read_text()
    assert (
        "replaced or wrapped after inject_observer, the forward of: the root (Sequential). "
        in index
    )
    assert "a root forward made so was neither counted nor sampled" in index
    assert "counts: 1 root forward, 1 sample" in index


def test_a_layer_forward_replaced_during_a_sampled_forward_is_named_in_index(
    run_dir: Path,
) -> None:
    model = mlp()
    first, second = model[0], model[1]

    def replace_first(x: torch.Tensor) -> torch.Tensor:
        # Inside the sampled forward, once layer 0 ran: its proxy is wrapped by what replaces it.
        first.forward = lambda y: nn.Linear.forward(first, y)  # type: ignore[assignment]
        return torch.relu(x)

    second.forward = replace_first  # type: ignore[assignment]
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match="was replaced during a sampled forward"):
        model(torch.randn(2, 8))
    with pytest.warns(RuntimeWarning, match=r"\(layer '0'\)"):
        remove_observer(model)
    index = (run_dir / "index.md").read_text()
    assert "replaced or wrapped after inject_observer, the forward of: layer `0`. " in index


def test_layer_forward_replaced_between_forwards_is_kept_and_still_observed(
    run_dir: Path,
) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    first = model[0]
    assert isinstance(first, nn.Linear)
    calls = []

    def theirs(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return nn.Linear.forward(first, x)

    first.forward = theirs  # type: ignore[assignment]
    model(torch.randn(2, 8))  # sampled: our proxy goes on top of theirs, and off again
    assert first.__dict__["forward"] is theirs
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # nothing of ours is inside theirs: no warning
        remove_observer(model)
    assert not said, [str(w.message) for w in said]
    assert first.__dict__["forward"] is theirs
    assert "forward" not in model[2].__dict__
    assert len(calls) == 1
    assert "0" in read_history(run_dir)["layer"].to_list()


def test_second_injection_raises_and_first_observer_keeps_working(
    run_dir: Path, tmp_path: Path
) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with pytest.raises(RuntimeError, match="remove_observer"):
        inject_observer(model, output_dir=tmp_path / "other")
    assert not (tmp_path / "other").exists()
    model(torch.randn(2, 8))
    remove_observer(model)
    assert read_history(run_dir).height > 0


def test_remove_observer_without_observer_does_nothing_and_says_so(run_dir: Path) -> None:
    model = mlp()
    message = r"^torchinstruments: remove_observer: this Sequential has no observer \(never "
    with pytest.warns(RuntimeWarning, match=message):
        assert remove_observer(model) is None
    assert inject_observer(model, output_dir=run_dir) == run_dir
    assert has_observer(model)
    assert remove_observer(model) == run_dir
    assert not has_observer(model)
    with pytest.warns(RuntimeWarning, match="already removed"):
        assert remove_observer(model) is None


def test_remove_in_finally_after_a_refused_inject_warns_and_keeps_the_error(
    tmp_path: Path,
) -> None:
    model = mlp()

    def observed_loop() -> None:
        try:
            inject_observer(model, output_dir=tmp_path / "s", selector=lambda n, m: False)
        finally:
            remove_observer(model)

    with pytest.raises(ValueError, match="selector"), pytest.warns(RuntimeWarning, match="no obs"):
        observed_loop()


def test_remove_and_has_observer_see_through_torch_compile_wrappers(tmp_path: Path) -> None:
    model = mlp()
    inject_observer(model, output_dir=tmp_path / "a", sampler=EveryNForwardsSampler(1))
    compiled = torch.compile(model, backend="eager")
    assert isinstance(compiled, nn.Module)
    assert has_observer(compiled)
    with pytest.raises(RuntimeError, match="already has an observer"):
        inject_observer(compiled, output_dir=tmp_path / "b")
    model(torch.randn(2, 8)).sum().backward()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert remove_observer(compiled) == tmp_path / "a"
    assert not said, [str(w.message) for w in said]
    assert not has_observer(model)
    assert not has_observer(compiled)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert read_history(tmp_path / "a")["sample_id"].unique().to_list() == [0]

    # The other way round: injected into the wrapper, removed through the module it compiles.
    wrapper = torch.compile(model, backend="eager")
    assert isinstance(wrapper, nn.Module)
    own_forward = wrapper.__dict__.get("forward")  # OptimizedModule's own, restored exactly
    inject_observer(wrapper, output_dir=tmp_path / "c", sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 8))
    assert has_observer(model)
    assert remove_observer(model) == tmp_path / "c"
    assert not has_observer(wrapper)
    assert wrapper.__dict__.get("forward") is own_forward
    assert all("forward" not in m.__dict__ for m in model.modules())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


CYCLES = 25  # every leak below grows with each cycle; 25 show it as surely as 100 would
LEAK_BYTES_PER_CYCLE = 20_000  # the memory a cycle may keep (the bound 100 cycles had: 2 MB)


def test_repeated_inject_run_remove_cycles_leave_no_trace(tmp_path: Path) -> None:
    model = mlp()
    before = snapshot(model)
    x = torch.randn(4, 8)

    def cycle(index: int) -> None:
        inject_observer(
            model, output_dir=tmp_path / f"run{index}", sampler=EveryNForwardsSampler(1)
        )
        model(x).sum().backward()
        remove_observer(model)

    for index in range(5):  # warm-up: imports, caches, thread pools
        cycle(index)
    gc.collect()
    threads, fds = threading.active_count(), _open_fds()
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    last = 5 + CYCLES - 1
    for index in range(5, last + 1):
        cycle(index)
    gc.collect()
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert snapshot(model) == before
    assert threading.active_count() == threads  # exact: one thread kept per cycle shows
    assert _open_fds() == fds  # exact: one fd kept per cycle shows
    grown = end - start
    assert grown < CYCLES * LEAK_BYTES_PER_CYCLE, f"memory grew by {grown} bytes over {CYCLES}"
    assert read_history(tmp_path / f"run{last}")["sample_id"].unique().to_list() == [0]


@pytest.mark.parametrize("child_first", [True, False])
def test_nested_observers_are_removed_in_either_order_without_a_trace(
    tmp_path: Path, child_first: bool
) -> None:
    model = nn.Sequential(mlp(), nn.Linear(8, 2))
    child = model[0]
    before = snapshot(model)
    inject_observer(child, output_dir=tmp_path / "child", sampler=EveryNForwardsSampler(1))
    inject_observer(model, output_dir=tmp_path / "parent", sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 8)).sum().backward()
    first, second = (child, model) if child_first else (model, child)
    remove_observer(first)
    model(torch.randn(2, 8))  # the remaining observer still works
    remove_observer(second)
    assert snapshot(model) == before
    assert read_history(tmp_path / "child")["layer"].unique().len() == 6
    assert read_history(tmp_path / "parent")["layer"].unique().len() == 7
    assert read_history(tmp_path / ("parent" if child_first else "child"))[
        "sample_id"
    ].unique().sort().to_list() == [0, 1]


class PropertyForward(nn.Module):
    """A module whose class `forward` is a property returning the callable that computes: a
    data descriptor, which Python reads before any instance `forward`."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)

    @property
    def forward(self) -> nn.Module:  # pyrefly: ignore[bad-override]
        return self.inner


def test_a_forward_property_is_said_never_a_layer_and_left_exactly_as_it_was(
    run_dir: Path,
) -> None:
    """The proxy went into the instance `__dict__`, which the property shadows: the layer ran
    unseen and removal reported it as never run; a root with one was never called at all."""
    model = nn.Sequential(PropertyForward(), nn.Tanh())
    before = snapshot(model)
    with pytest.raises(TypeError, match="PropertyForward defines forward as a property"):
        inject_observer(model[0], output_dir=run_dir / "refused")
    assert not (run_dir / "refused").exists()
    with pytest.warns(RuntimeWarning, match=r"forward as a property: .* '0';"):
        inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer is said to have never run
        model(torch.ones(2, 3)).sum().backward()
        remove_observer(model)
    assert snapshot(model) == before
    assert set(read_history(run_dir)["layer"]) == {"0.inner", "1"}
    assert "cannot have their calls observed, so they are never layers" in page_prose(run_dir)
