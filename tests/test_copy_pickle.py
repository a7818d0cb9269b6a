"""Copies of an observed model (deepcopy, pickle, torch.save) are plain, unobserved models."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, has_observer, inject_observer, remove_observer
from torchinstruments.capture import ForwardProxy

from conftest import mlp, read_history

SPAWN_TIMEOUT_S = 60.0


def assert_plain_copy(original: nn.Module, clone: nn.Module) -> None:
    """The clone has no proxy, is not observed, and computes what the original computes."""
    assert not has_observer(clone)
    for module in clone.modules():
        assert not isinstance(module.__dict__.get("forward"), ForwardProxy)
    x = torch.randn(3, 8)
    assert torch.equal(clone(x), original(x))
    for mine, theirs in zip(clone.parameters(), original.parameters(), strict=True):
        assert mine is not theirs
        assert torch.equal(mine, theirs)


def test_deepcopy_of_observed_model_is_plain_and_equal(run_dir: Path) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    ema = copy.deepcopy(model)
    assert_plain_copy(model, ema)
    ema(torch.randn(2, 8))  # a copy's forward is not recorded
    model(torch.randn(2, 8))
    remove_observer(model)
    # one root forward inside assert_plain_copy, one here; the copy's call is not among them
    assert read_history(run_dir)["forward_index"].unique().sort().to_list() == [0, 1]


def test_deepcopy_keeps_a_pre_existing_instance_forward(run_dir: Path) -> None:
    model = mlp()
    first = model[0]
    assert isinstance(first, nn.Linear)
    first.forward = lambda x: nn.Linear.forward(first, x) * 0  # type: ignore[assignment]
    inject_observer(model, output_dir=run_dir)
    clone = copy.deepcopy(model)
    remove_observer(model)
    assert not isinstance(clone[0].__dict__["forward"], ForwardProxy)
    assert torch.equal(clone[0](torch.ones(1, 8)), torch.zeros(1, 8))


def test_pickle_and_torch_save_of_observed_model_give_plain_equal_models(run_dir: Path) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir)
    unpickled = pickle.loads(pickle.dumps(model))
    assert_plain_copy(model, unpickled)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_plain_copy(model, loaded)
    assert b"torchinstruments" not in pickle.dumps(model)
    remove_observer(model)


def test_state_dict_round_trip_is_unaffected(run_dir: Path) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir)
    state = model.state_dict()
    fresh = mlp()
    fresh.load_state_dict(state)
    x = torch.randn(2, 8)
    assert torch.equal(fresh(x), model(x))
    remove_observer(model)


def doubled(x: torch.Tensor) -> torch.Tensor:
    """A module-level function set as a module's own `forward` (pickled by reference)."""
    return x * 2


def test_pickle_of_observed_model_keeps_its_own_forward_function(run_dir: Path) -> None:
    root = nn.Identity()
    root.forward = doubled  # type: ignore[method-assign]
    plain = pickle.loads(pickle.dumps(root))  # what an unobserved model gives
    inject_observer(root, output_dir=run_dir)
    unpickled = pickle.loads(pickle.dumps(root))
    buffer = io.BytesIO()
    torch.save(root, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert b"torchinstruments" not in pickle.dumps(root)
    remove_observer(root)
    for clone in (plain, unpickled, loaded):
        assert clone.__dict__["forward"] is doubled
        assert not has_observer(clone)
        assert torch.equal(clone(torch.ones(2)), torch.full((2,), 2.0))


def test_deepcopy_of_observed_model_is_exactly_a_plain_deepcopy(run_dir: Path) -> None:
    """An EMA copy made while observed holds no `forward` of its own, like a plain copy: it is
    freed without the garbage collector, and `torch.save` of it loads with weights_only=True."""
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    ema = copy.deepcopy(model)
    whole = io.BytesIO()
    torch.save(model, whole)  # the observed model itself: its forward is named via getattr
    remove_observer(model)
    whole.seek(0)
    with (
        torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.ReLU]),
        pytest.raises(pickle.UnpicklingError, match="getattr"),
    ):
        torch.load(whole, weights_only=True)
    assert [m for m in ema.modules() if "forward" in m.__dict__] == []
    assert torch.equal(ema(torch.ones(1, 8)), model(torch.ones(1, 8)))
    buffer = io.BytesIO()
    torch.save(ema, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.ReLU]):
        loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded(torch.ones(1, 8)), model(torch.ones(1, 8)))
    freed = weakref.ref(ema)
    gc.disable()
    try:
        del ema
        assert freed() is None  # no reference cycle through a bound forward
    finally:
        gc.enable()


def test_deepcopy_of_an_observed_module_with_its_own_deepcopy_leaves_nothing_of_ours(
    run_dir: Path,
) -> None:
    """torch.fx's GraphModule copies itself without `__setstate__`: its copy is plain too."""
    traced = torch.fx.symbolic_trace(mlp())
    inject_observer(traced, output_dir=run_dir)
    clone = copy.deepcopy(traced)
    remove_observer(traced)
    assert "__setstate__" not in clone.__dict__
    assert not isinstance(clone.__dict__.get("forward"), ForwardProxy)
    assert torch.equal(
        pickle.loads(pickle.dumps(clone))(torch.ones(1, 8)), traced(torch.ones(1, 8))
    )


def test_shallow_copy_shares_the_observed_forward_as_documented(run_dir: Path) -> None:
    """The documented limit: `copy.copy` copies `__dict__` as is, proxy included, so the copy's
    calls are the original's root forwards (use deepcopy for a plain copy)."""
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    shallow = copy.copy(model)
    assert isinstance(shallow.__dict__["forward"], ForwardProxy)
    shallow(torch.randn(2, 8))
    remove_observer(model)
    assert read_history(run_dir)["forward_index"].unique().to_list() == [0]


def spawned_child(model: nn.Module, done: Any) -> None:
    """In a 'spawn' child: run the model it was given, then try to remove its observer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 8))
        observed = has_observer(model)
        remove_observer(model)
    done.put({"observed": observed, "warnings": [str(w.message) for w in caught]})


@pytest.mark.timeout(150)
def test_a_model_sent_to_a_spawned_child_is_said_to_run_unobserved_there(run_dir: Path) -> None:
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    try:
        model(torch.randn(2, 8))
        context = torch.multiprocessing.get_context("spawn")
        done = context.SimpleQueue()
        child = context.Process(target=spawned_child, args=(model, done))
        with pytest.warns(RuntimeWarning, match="started with 'spawn' or 'forkserver'") as said:
            child.start()
        child.join(SPAWN_TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join()
        assert child.exitcode == 0
        facts = done.get()
    finally:
        remove_observer(model)
    [sent] = [str(w.message) for w in said if "torchinstruments" in str(w.message)]
    assert "runs unobserved" in sent
    assert "inject_observer in that process" in sent
    assert not facts["observed"]
    [message] = facts["warnings"]
    assert "has no observer" in message
    assert "a copy" in message
    assert "'spawn'" in message
    assert read_history(run_dir)["forward_index"].unique().to_list() == [0]  # the parent's only


def test_a_whole_module_torch_save_loads_with_the_class_forward_bound_as_documented(
    run_dir: Path,
) -> None:
    """What README and docs/guarantees.md say of it: an instance `forward` that is the class's,
    bound to the loaded model (a cycle: not freed at `del`), which `del loaded.forward` removes."""
    model = mlp()
    inject_observer(model, output_dir=run_dir)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    remove_observer(model)
    for drop_forward in (False, True):
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        bound = loaded.__dict__["forward"]
        assert bound.__func__ is type(loaded).forward
        assert bound.__self__ is loaded
        if drop_forward:
            del loaded.forward
            assert "forward" not in loaded.__dict__
        x = torch.randn(3, 8)
        assert torch.equal(loaded(x), model(x))
        gone = weakref.ref(loaded)
        gc.disable()
        try:
            del loaded, bound
            assert (gone() is None) == drop_forward
        finally:
            gc.enable()
        gc.collect()
        assert gone() is None
