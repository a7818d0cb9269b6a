"""torch.compile: unsampled steps run the plain compiled graph; sampled steps are measured eagerly.

Each configuration runs the same steps three times from the same weights and inputs: compiled
without an observer, compiled with one, and eager with one. No parameter is updated (backward
only), so the weights stay equal across the three runs: outputs of unsampled steps are compared
bit for bit with the plain compiled model, and the rows of sampled steps with the eager run's.
Graphs and graph breaks are read from dynamo's counters; after warm-up (one sampled and one
unsampled step) the steps run under `set_stance("fail_on_recompile")`, which raises on any
recompile. Where compiling costs a graph break (a compiled caller of the observed model), the
break is counted here; what index.md says about compiled runs is in test_compile_notes.py.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from _compile_models import (
    KEY_COLUMNS,
    WIDTH,
    Net,
    Setup,
    compile_module,
    forward_dicts,
    graphs_and_breaks,
    history,
    inputs,
    prepare,
    step,
)

SETUPS = [
    Setup("compile_model_after_inject", "aot_eager"),
    Setup("compile_model_after_inject", "inductor"),
    Setup("compile_model_after_inject", "eager", options={"fullgraph": True}),
    Setup("compile_model_after_inject", "aot_eager", options={"dynamic": True}),
    Setup("compile_model_after_inject", "eager", sequential=True, options={"fullgraph": True}),
    Setup("inject_on_optimized_module", "eager", sequential=True),
    Setup("inject_on_orig_mod", "aot_eager"),
    Setup("model_compile_before_inject", "eager"),
    Setup("forward_compile_before_inject", "aot_eager"),
    Setup("model_compile_after_inject", "eager", sequential=True),
    Setup("model_compile_after_inject", "aot_eager", options={"fullgraph": True}),
    Setup("block_compile_before_inject", "aot_eager", options={"dynamic": True}),
    Setup("block_compile_before_inject", "eager", options={"fullgraph": True}),
    Setup("block_compile_after_inject", "inductor"),
    Setup("block_compile_after_inject", "aot_eager", blocks=12, options={"fullgraph": True}),
    Setup("torch_compile_blocks_before_inject", "eager", blocks=12),
]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_compiled_model_is_observed_at_compiled_speed(setup: Setup, tmp_path: Path) -> None:
    base = setup.model()
    batches = inputs(setup)

    # 1. The plain compiled model.
    plain = prepare(setup, copy.deepcopy(base), None)
    plain_outputs = [step(plain.call, x) for x in batches]
    plain_counts = graphs_and_breaks()
    assert plain_counts[0] >= 1
    torch._dynamo.reset()
    counters.clear()

    # 2. The same, observed: sampled steps 0, 2, 4.
    run_dir = tmp_path / "compiled"
    before: dict[str, object] = {}

    def observe(module: nn.Module) -> None:
        before.update(forward_dicts(module))
        inject_observer(module, output_dir=run_dir, sampler=EveryNForwardsSampler(2))

    with warnings.catch_warnings(record=True) as said:
        # A supported configuration warns about nothing.
        warnings.simplefilter("always")
        prepared = prepare(setup, copy.deepcopy(base), observe)
        outputs = [step(prepared.call, x) for x in batches[:2]]
        warm = graphs_and_breaks()
        with torch.compiler.set_stance("fail_on_recompile"):
            outputs += [step(prepared.call, x) for x in batches[2:]]
    assert not [w for w in said if str(w.message).startswith("torchinstruments")], [
        str(w.message) for w in said
    ]
    assert graphs_and_breaks() == warm == plain_counts
    for index in (1, 3, 5):
        assert torch.equal(outputs[index], plain_outputs[index])
    for index in (0, 2, 4):  # eager numerics: equal up to rounding
        torch.testing.assert_close(outputs[index], plain_outputs[index])
    remove_observer(prepared.observed)

    # Removal restores every forward; the compiled model keeps running, at most one recompile.
    # A torch container compiled while observed is the exception (README): dynamo then compiles
    # its children one by one, as it would for nn.Sequential's own frame.
    assert forward_dicts(prepared.observed) == before
    after = [step(prepared.call, x) for x in batches[:3]]
    if not (setup.sequential and setup.how != "inject_on_optimized_module"):
        assert graphs_and_breaks()[0] <= warm[0] + 1
    torch.testing.assert_close(after[1], plain_outputs[1])

    # 3. The same steps, eager and observed: the same rows.
    eager = copy.deepcopy(base)
    eager_dir = tmp_path / "eager"
    inject_observer(eager, output_dir=eager_dir, sampler=EveryNForwardsSampler(2))
    for x in batches:
        step(eager, x)
    remove_observer(eager)
    got, want = history(run_dir), history(eager_dir)
    assert got.height == want.height > 0
    assert got.select(KEY_COLUMNS).equals(want.select(KEY_COLUMNS))
    assert got["forward_index"].unique().sort().to_list() == [0, 2, 4]
    assert set(got["signal"].unique()) == {"output", "output_gradient"}
    assert got["layer"].n_unique() == 4 * setup.blocks + 1
    assert got["unavailable_reason"].null_count() == got.height
    assert got["value"].to_list() == pytest.approx(want["value"].to_list(), rel=1e-5, abs=1e-6)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def test_compiled_function_calling_the_observed_model_breaks_the_graph_once(
    tmp_path: Path,
) -> None:
    """Not the compiled model but a compiled step that calls it: the call to the model is one
    graph break (the root proxy is not traceable), and the model's forward compiles as its own
    graph. With fullgraph=True, where a break would raise, dynamo traces the model's forward
    through the proxy instead: that call runs in the graph, not counted, and said."""
    base = Net(2)
    batches = inputs(Setup("compile_function", "eager"))
    plain = torch.compile(loss_of, backend="eager")
    for x in batches:
        plain(base, x).backward()
    plain_graphs, plain_breaks = graphs_and_breaks()
    torch._dynamo.reset()
    counters.clear()

    model = copy.deepcopy(base)
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    observed = torch.compile(loss_of, backend="eager")
    for x in batches:
        observed(model, x).backward()
    assert graphs_and_breaks() == (plain_graphs + 1, plain_breaks + 1)
    torch._dynamo.reset()  # else the cached graphs above would serve the fullgraph call too
    whole = torch.compile(loss_of, backend="eager", fullgraph=True)
    with pytest.warns(RuntimeWarning, match="a caller compiled with fullgraph=True"):
        assert torch.equal(whole(model, batches[0]), loss_of(base, batches[0]))
    remove_observer(model)
    rows = pl.read_parquet(tmp_path / "stats" / "history.parquet")
    assert rows["forward_index"].unique().sort().to_list() == [0, 2, 4]
    index = (tmp_path / "stats" / "index.md").read_text("utf-8")
    assert "those root forwards were neither counted nor sampled" in index


class Outer(nn.Module):
    """A module that holds the observed model and is compiled as a whole."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Net(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * 2) * 3


def test_compiled_parent_of_the_observed_model_breaks_the_graph_at_the_call(
    tmp_path: Path,
) -> None:
    """inject_observer(outer.inner), then torch.compile(outer): the compiled parent's call of
    the observed model is a graph break, as a compiled function's is (the root proxy is not
    traceable): the parent's code before and after it and the model's forward are three
    graphs. Everything is recorded."""
    base = Outer()
    batches = inputs(Setup("compile_parent", "eager"))
    plain = compile_module(copy.deepcopy(base), backend="eager")
    for x in batches:
        step(plain, x)
    assert graphs_and_breaks() == (1, 0)
    torch._dynamo.reset()
    counters.clear()

    outer = copy.deepcopy(base)
    inject_observer(outer.inner, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    observed = compile_module(outer, backend="eager")
    for x in batches:
        step(observed, x)
    remove_observer(outer.inner)
    assert graphs_and_breaks() == (3, 1)
    assert history(tmp_path / "stats")["forward_index"].unique().sort().to_list() == [0, 2, 4]


class CountingSampler(EveryNForwardsSampler):
    """EveryNForwardsSampler(2) that counts how often it was asked."""

    def __init__(self) -> None:
        super().__init__(2)
        self.asked = 0

    def should_sample(self, forward_index: int) -> bool:
        self.asked += 1
        return super().should_sample(forward_index)


def test_forward_compiled_in_place_after_inject_breaks_the_graph_once(tmp_path: Path) -> None:
    """`model.forward = torch.compile(model.forward)` after inject_observer compiles a function
    that calls the root proxy: like a compiled function calling the model, one graph break (the
    root proxy), after which the model's forward compiles into the same graph. Removal leaves the user's compiled forward in place
    (the proxy inside it inert, warned about), and later calls never reach the observer."""
    base = Net(2)
    batches = inputs(Setup("forward_compile_after_inject", "eager"))
    plain = copy.deepcopy(base)
    plain.forward = torch.compile(plain.forward, backend="eager")
    for x in batches:
        step(plain, x)
    plain_graphs, plain_breaks = graphs_and_breaks()
    torch._dynamo.reset()
    counters.clear()

    model = copy.deepcopy(base)
    sampler = CountingSampler()
    inject_observer(model, output_dir=tmp_path / "stats", sampler=sampler)
    compiled_forward = torch.compile(model.forward, backend="eager")
    model.forward = compiled_forward
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for x in batches:
            step(model, x)
    # The break of a compiled caller, not that of a compiled wrapper made before inject.
    assert [str(w.message) for w in said if str(w.message).startswith("torchinstruments")] == []
    assert graphs_and_breaks() == (plain_graphs, plain_breaks + 1)
    with pytest.warns(RuntimeWarning, match="replaced or wrapped after inject_observer"):
        remove_observer(model)
    assert model.__dict__["forward"] is compiled_forward
    asked = sampler.asked
    for x in batches[:2]:
        step(model, x)
    assert sampler.asked == asked == len(batches)
    rows = pl.read_parquet(tmp_path / "stats" / "history.parquet")
    assert rows["forward_index"].unique().sort().to_list() == [0, 2, 4]


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A whole training step: the forward and the backward inside one function (one frame, so
    the call to the model breaks its graph once)."""
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def test_compiled_training_step_compiles_none_of_the_librarys_gradient_code(
    tmp_path: Path,
) -> None:
    """The backward inside the compiled function: the autograd engine calls the gradient hooks
    and the end-of-pass callback while dynamo is on. They run as plain Python, so the observer
    costs the compiled step what the call to the model costs (one graph break, one graph), and
    dynamo warns about nothing of the library's."""
    base = Net(2)
    batches = inputs(Setup("compile_function", "eager"))
    plain = torch.compile(train_step, backend="eager")
    for x in batches:
        plain(base, x)
    plain_graphs, plain_breaks = graphs_and_breaks()
    torch._dynamo.reset()
    counters.clear()

    model = copy.deepcopy(base)
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    observed = torch.compile(train_step, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in batches:
            observed(model, x)
    remove_observer(model)
    assert graphs_and_breaks() == (plain_graphs + 1, plain_breaks + 1)
    assert [str(w.message) for w in caught] == []
    rows = pl.read_parquet(tmp_path / "stats" / "history.parquet")
    gradients = rows.filter(pl.col("signal") == "output_gradient")
    assert gradients["forward_index"].unique().sort().to_list() == [0, 2, 4]


def test_model_compile_before_inject_on_a_torch_container_costs_one_graph_break_and_says_so(
    tmp_path: Path,
) -> None:
    """nn.Sequential.forward lives in torch, where dynamo never starts compiling: model.compile()
    then traces nn.Module.__call__ from the top, into the root proxy installed later."""
    setup = Setup("model_compile_before_inject", "eager", sequential=True)
    base = setup.model()
    batches = inputs(setup)
    plain = prepare(setup, copy.deepcopy(base), None)
    for x in batches:
        step(plain.call, x)
    plain_graphs, plain_breaks = graphs_and_breaks()
    torch._dynamo.reset()
    counters.clear()

    run_dir = tmp_path / "stats"

    def observe(module: nn.Module) -> None:
        inject_observer(module, output_dir=run_dir, sampler=EveryNForwardsSampler(2))

    with pytest.warns(RuntimeWarning, match="one extra graph break"):
        prepared = prepare(setup, copy.deepcopy(base), observe)
    for x in batches:
        step(prepared.call, x)
    assert graphs_and_breaks() == (plain_graphs, plain_breaks + 1)
    remove_observer(prepared.observed)
    assert "**Note:** model.compile() ran before inject_observer" in (
        run_dir / "index.md"
    ).read_text("utf-8")
    assert history(run_dir)["forward_index"].unique().sort().to_list() == [0, 2, 4]


def test_sampled_forwards_in_several_threads_leave_torch_compile_on(tmp_path: Path) -> None:
    """Sampled forwards switch torch.compile off process-wide while they run; threads entering
    and leaving in crossed order must not leave it off."""
    model = Net(2)
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(1))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                step(model, torch.randn(4, WIDTH))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    remove_observer(model)
    assert errors == []
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    compiled(torch.ones(3))
    assert graphs_and_breaks()[0] == 1


@pytest.mark.parametrize("how", ["torch_compile", "block_compile"])
def test_a_model_compiled_and_run_before_inject_is_measured_whole_without_a_recompile(
    how: str, tmp_path: Path
) -> None:
    """Compiled and warm before inject_observer: its cached graphs guard on the module's
    `forward` (none in the instance dict), and the root proxy's frame is kept out of compiled
    code, so the warm graphs serve the unsampled forwards unchanged (no recompile), while the
    sampled ones reach the proxy and run eagerly: every layer is measured, nothing is warned."""
    model = Net(2)
    call: Callable[[torch.Tensor], torch.Tensor] = model
    if how == "torch_compile":
        call = compile_module(model, backend="eager")
    else:
        for block in model.blocks:
            block.compile(backend="eager")
    batches = inputs(Setup(how, "eager"))
    step(call, batches[0])
    warm = graphs_and_breaks()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
        with torch.compiler.set_stance("fail_on_recompile"):
            for x in batches[:4]:
                step(call, x)
        remove_observer(model)
    assert [str(w.message) for w in said if "torchinstruments" in str(w.message)] == []
    assert graphs_and_breaks() == warm
    rows = history(tmp_path / "stats")
    assert rows["forward_index"].unique().sort().to_list() == [0, 2]
    assert rows["layer"].n_unique() == 4 * 2 + 1
    assert set(rows["signal"].unique()) == {"output", "output_gradient"}
    assert rows["unavailable_reason"].null_count() == rows.height
