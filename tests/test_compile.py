"""torch.compile: unsampled steps run the plain compiled graph; sampled steps are measured eagerly.

Each configuration runs the same steps three times from the same weights and inputs: compiled
without an observer, compiled with one, and eager with one. No parameter is updated (backward
only), so the weights stay equal across the three runs: outputs of unsampled steps are compared
bit for bit with the plain compiled model, and the rows of sampled steps with the eager run's.
Graphs and graph breaks are read from dynamo's counters; after warm-up (one sampled and one
unsampled step) the steps run under `set_stance("fail_on_recompile")`, which raises on any
recompile.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import torchinstruments.compilation
from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

WIDTH = 8
STEPS = 6  # forward_index 0, 2, 4 sampled; 1, 3, 5 not
KEY_COLUMNS = [
    "sample_id",
    "forward_index",
    "layer",
    "module_type",
    "call_index",
    "signal",
    "tensor_path",
    "shape",
    "dtype",
    "mode",
    "grad_enabled",
    "metric",
]


class Block(nn.Module):
    """A pre-norm residual MLP block: four selected leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Net(nn.Module):
    """`blocks` residual blocks and a linear head."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass(frozen=True)
class Setup:
    """One way of compiling, and when the observer is injected relative to it."""

    how: str
    backend: str
    blocks: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    sequential: bool = False  # root is an nn.Sequential: its forward lives in torch

    def __str__(self) -> str:
        extra = "".join(f"-{key}" for key in self.options)
        root = "-sequential" if self.sequential else ""
        return f"{self.how}-{self.backend}-{self.blocks}blocks{extra}{root}"

    def model(self) -> nn.Module:
        if self.sequential:
            return nn.Sequential(*(Block() for _ in range(self.blocks)), nn.Linear(WIDTH, 2))
        return Net(self.blocks)


@dataclass
class Prepared:
    """What the loop calls, and the module given to inject_observer / remove_observer."""

    call: Callable[[torch.Tensor], torch.Tensor]
    observed: nn.Module


def compile_module(module: nn.Module, **kwargs: Any) -> nn.Module:
    """`torch.compile(module)`: an OptimizedModule (typed as a plain callable by torch)."""
    compiled = torch.compile(module, **kwargs)
    assert isinstance(compiled, nn.Module)
    return compiled


def prepare(
    setup: Setup, model: nn.Module, observe: Callable[[nn.Module], object] | None
) -> Prepared:
    """Compile `model` as `setup` says, injecting (when `observe` is given) at the right moment."""

    def attach(module: nn.Module) -> None:
        if observe is not None:
            observe(module)

    kwargs: dict[str, Any] = {"backend": setup.backend, **setup.options}
    if setup.how == "compile_model_after_inject":
        attach(model)
        return Prepared(torch.compile(model, **kwargs), model)
    if setup.how == "inject_on_optimized_module":
        compiled = compile_module(model, **kwargs)
        attach(compiled)
        return Prepared(compiled, compiled)
    if setup.how == "inject_on_orig_mod":
        compiled = compile_module(model, **kwargs)
        original = compiled.get_submodule("_orig_mod")
        attach(original)
        return Prepared(compiled, original)
    if setup.how == "model_compile_before_inject":
        model.compile(**kwargs)
        attach(model)
        return Prepared(model, model)
    if setup.how == "forward_compile_before_inject":
        model.forward = torch.compile(model.forward, **kwargs)
        attach(model)
        return Prepared(model, model)
    if setup.how == "model_compile_after_inject":
        attach(model)
        model.compile(**kwargs)
        return Prepared(model, model)
    assert isinstance(model, Net)
    if setup.how == "block_compile_before_inject":  # regional compilation, then observed
        for block in model.blocks:
            block.compile(**kwargs)
        attach(model)
        return Prepared(model, model)
    if setup.how == "block_compile_after_inject":
        attach(model)
        for block in model.blocks:
            block.compile(**kwargs)
        return Prepared(model, model)
    if setup.how == "torch_compile_blocks_before_inject":
        for index, block in enumerate(model.blocks):
            model.blocks[index] = compile_module(block, **kwargs)
        attach(model)
        return Prepared(model, model)
    raise AssertionError(setup.how)


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


def graphs_and_breaks() -> tuple[int, int]:
    """Graphs compiled (recompiles included) and graph breaks, from dynamo's counters."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def inputs(setup: Setup) -> list[torch.Tensor]:
    """One batch per step; batch sizes vary only where shapes are compiled dynamic."""
    generator = torch.Generator().manual_seed(1)
    sizes = [3 + i for i in range(STEPS)] if setup.options.get("dynamic") else [4] * STEPS
    return [torch.randn(size, WIDTH, generator=generator) for size in sizes]


def step(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Forward and backward, no parameter update: the weights stay those of the start."""
    output = call(x)
    output.square().mean().backward()
    return output.detach()


def forward_dicts(model: nn.Module) -> dict[str, object]:
    """Each module's instance `forward` (None where it has none), by name."""
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


def history(directory: Path) -> pl.DataFrame:
    return pl.read_parquet(directory / "history.parquet").sort(KEY_COLUMNS)


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


class NeverSample:
    """A sampler that declines every root forward."""

    def should_sample(self, forward_index: int) -> bool:
        return False


@pytest.mark.parametrize("calls", [0, 3])
def test_run_without_a_sample_says_so_at_removal_and_in_index(calls: int, tmp_path: Path) -> None:
    model = Net(2)
    run_dir = tmp_path / "stats"
    inject_observer(model, output_dir=run_dir, sampler=NeverSample())
    compiled = torch.compile(model, backend="eager")
    for _ in range(calls):
        step(compiled, torch.randn(4, WIDTH))
    with pytest.warns(RuntimeWarning, match=f"no sample was recorded \\({calls} root forwards"):
        remove_observer(model)
    index = (run_dir / "index.md").read_text("utf-8")
    assert "**No sample was recorded:**" in index
    seen = "the model was never called" if calls == 0 else f"{calls} root forwards were seen"
    assert seen in index
    assert pl.read_parquet(run_dir / "history.parquet").height == 0


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def test_compiled_function_calling_the_observed_model_breaks_the_graph_once(
    tmp_path: Path,
) -> None:
    """Not the compiled model but a compiled step that calls it: the call to the model is one
    graph break (the root proxy is not traceable), and the model's forward compiles as its own
    graph. With fullgraph=True dynamo refuses it."""
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
    refused = torch.compile(loss_of, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="no traceable __call__"):
        refused(model, batches[0])
    remove_observer(model)
    rows = pl.read_parquet(tmp_path / "stats" / "history.parquet")
    assert rows["forward_index"].unique().sort().to_list() == [0, 2, 4]


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
    for x in batches:
        step(model, x)
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


def eager_note(run_dir: Path) -> list[str]:
    index = (run_dir / "index.md").read_text("utf-8")
    return [line for line in index.splitlines() if "sampled forwards ran eagerly" in line]


def test_index_says_sampled_forwards_of_a_compiled_model_ran_eagerly(tmp_path: Path) -> None:
    model = Net(2)
    inject_observer(model, output_dir=tmp_path / "compiled", sampler=EveryNForwardsSampler(2))
    compiled = torch.compile(model, backend="eager")
    for x in inputs(Setup("compile_model_after_inject", "eager")):
        step(compiled, x)
    remove_observer(model)
    (note,) = eager_note(tmp_path / "compiled")
    assert "(3 of the 3 samples were called through compiled code)" in note
    assert "eager numerics, which can differ from the compiled ones in the last bits" in note
    assert "unsampled forwards ran the compiled code" in note


def test_index_names_compiled_blocks_that_ran_eagerly_in_sampled_forwards(tmp_path: Path) -> None:
    model = Net(2)
    inject_observer(model, output_dir=tmp_path / "blocks", sampler=EveryNForwardsSampler(2))
    for block in model.blocks:
        block.compile(backend="eager")
    for x in inputs(Setup("block_compile_after_inject", "eager")):
        step(model, x)
    remove_observer(model)
    (note,) = eager_note(tmp_path / "blocks")
    assert "(compiled modules: 'blocks.0', 'blocks.1')" in note


def test_index_names_compiled_modules_by_their_eager_names(tmp_path: Path) -> None:
    """Inside an observed OptimizedModule, compiled blocks are named as the layers are, without
    `_orig_mod.`, and a block compiled twice over (a wrapper around a module.compile()'d one)
    once."""
    model = Net(2)
    for block in model.blocks:
        block.compile(backend="eager")
    model.blocks[1] = compile_module(model.blocks[1], backend="eager")
    compiled = compile_module(model, backend="eager")
    inject_observer(compiled, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    for x in inputs(Setup("inject_on_optimized_module", "eager")):
        step(compiled, x)
    remove_observer(compiled)
    (note,) = eager_note(tmp_path / "stats")
    assert "(compiled modules: the root, 'blocks.0', 'blocks.1')" in note


@pytest.mark.parametrize(("where", "named"), [("", "the root"), ("blocks.0", "'blocks.0'")])
def test_index_names_a_module_whose_forward_was_compiled_in_place(
    where: str, named: str, tmp_path: Path
) -> None:
    """`module.forward = torch.compile(module.forward)` before inject_observer (Hugging Face's
    docs do it for generation): the sampled forwards run it eagerly, which index.md must say."""
    model = Net(2)
    module = model.get_submodule(where)
    module.forward = torch.compile(module.forward, backend="eager")
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    for x in inputs(Setup("forward_compile_before_inject", "eager")):
        step(model, x)
    remove_observer(model)
    (note,) = eager_note(tmp_path / "stats")
    assert f"(compiled modules: {named})" in note
    assert graphs_and_breaks() == (1, 0)  # the unsampled forwards ran the compiled forward


def test_index_says_random_draws_of_an_inductor_model_differ_after_an_eager_sample(
    tmp_path: Path,
) -> None:
    """Dropout under inductor: a sampled step runs eagerly and draws its random numbers as
    eager dropout does, not as inductor's kernels do, so the unsampled steps after it continue
    another random number stream and are not the plain compiled model's. index.md must say so,
    not only that eager numerics differ "in the last bits"."""
    base = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Dropout(0.5), nn.Linear(2 * WIDTH, 2))
    batches = inputs(Setup("compile_model_after_inject", "inductor"))

    def run(observe: Path | None) -> list[torch.Tensor]:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if observe is not None:
            inject_observer(model, output_dir=observe, sampler=EveryNForwardsSampler(2))
        compiled = compile_module(model, backend="inductor")
        torch.manual_seed(5)
        outputs = [step(compiled, x) for x in batches[:2]]
        if observe is not None:
            remove_observer(model)
        return outputs

    plain, observed = run(None), run(tmp_path / "stats")
    assert not torch.equal(observed[1], plain[1])  # an unsampled step, after a sampled one
    (note,) = eager_note(tmp_path / "stats")
    assert "random number stream" in note
    assert "dropout masks" in note


def test_an_eager_run_says_nothing_about_eager_samples(tmp_path: Path) -> None:
    model = Net(2)
    inject_observer(model, output_dir=tmp_path / "eager", sampler=EveryNForwardsSampler(2))
    for x in inputs(Setup("eager", "eager")):
        step(model, x)
    remove_observer(model)
    assert eager_note(tmp_path / "eager") == []


def test_a_torch_that_cannot_exclude_the_root_wrapper_says_compiled_forwards_are_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch lacks the per-frame exclusion (compile_support() False), dynamo would trace
    the root wrapper as a traced call, which passes through uncounted: inject_observer warns
    and index.md says that forwards run under torch.compile are not recorded."""
    monkeypatch.setattr(torchinstruments.compilation, "compile_support", lambda: False)
    model = Net(1)
    with pytest.warns(RuntimeWarning, match="not recorded: forwards run under torch.compile"):
        inject_observer(model, output_dir=tmp_path / "stats")
    step(model, torch.randn(4, WIDTH))
    remove_observer(model)
    index = (tmp_path / "stats" / "index.md").read_text("utf-8")
    assert "**Note:** not recorded: forwards run under torch.compile" in index
    assert "neither counted nor sampled" in index
