"""torch.compile in the set-ups a training or evaluation loop runs it in: rows equal plain hooks.

Each case runs the same steps on a model compiled without an observer and, from the same
weights and seeds, on one compiled after `inject_observer` (hooked eager copy alongside, see
hook_reference.py). The observed run must compile what the plain one compiles (dynamo's
graphs, breaks, compiled frames and recompiles), its unsampled steps must give the plain
compiled outputs bit for bit, and every row must equal the hooks' reference. After removal,
the compiled model never reaches the observer again, also when it recompiles.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from hook_reference import run_both

WIDTH = 8
STEPS = 6  # forward_index 0, 2, 4 sampled


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(self.norm(x)))


class Net(nn.Module):
    """Two residual blocks and a head; the blocks optionally under non-reentrant checkpointing."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 2)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


Step = Callable[[nn.Module, int], torch.Tensor]


def train_step(model: nn.Module, i: int) -> torch.Tensor:
    output = model(torch.randn(4, WIDTH))
    output.square().mean().backward()
    return output.detach()


def evaluation_step(model: nn.Module, i: int) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.randn(4, WIDTH))


def two_forwards_one_backward(model: nn.Module, i: int) -> torch.Tensor:
    """Forward i (sampled when even) and i + 1 of one step share a loss: the sampled output's
    gradient flows back while the unsampled forward's graph (compiled) runs its backward."""
    first, second = model(torch.randn(4, WIDTH)), model(torch.randn(4, WIDTH))
    (first.square().mean() + second.abs().mean()).backward()
    return second.detach()


def reset_midway(model: nn.Module, i: int) -> torch.Tensor:
    """`torch._dynamo.reset()` before step 3: everything compiles again from there."""
    if i == 3:
        torch._dynamo.reset()
    return train_step(model, i)


CASES: dict[str, tuple[Callable[[], nn.Module], Step]] = {
    "eval_under_no_grad": (lambda: Net().eval(), evaluation_step),
    "checkpointed_blocks": (lambda: Net(checkpointed=True), train_step),
    "two_forwards_one_backward": (Net, two_forwards_one_backward),
    "dynamo_reset_midway": (Net, reset_midway),
}


def dynamo_counts() -> dict[str, int]:
    """Graphs, graph breaks, compiled frames and recompiles so far."""
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],
        "recompiles": sum(counters["recompiles"].values()),
    }


def compiled(model: nn.Module) -> nn.Module:
    result = torch.compile(model, backend="aot_eager")
    assert isinstance(result, nn.Module)
    return result


def run_plain(model: nn.Module, step: Step) -> list[torch.Tensor]:
    """The steps on the plain compiled model, seeded as `run_both` seeds them."""
    return run_plain_with(compiled(model), step)


def run_plain_with(call: nn.Module, step: Step = train_step) -> list[torch.Tensor]:
    """The steps on `call`, already compiled, seeded as `run_both` seeds them."""
    outputs = []
    for i in range(STEPS):
        torch.manual_seed(1000 + i)
        outputs.append(step(call, i))
    return outputs


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_loop_compiles_as_plain_and_its_rows_equal_plain_hooks(
    case: str, tmp_path: Path
) -> None:
    make, step = CASES[case]
    torch.manual_seed(0)
    base = make()
    plain_outputs = run_plain(copy.deepcopy(base), step)
    plain = dynamo_counts()
    assert plain["graphs"] >= 1
    torch._dynamo.reset()
    counters.clear()

    result = run_both(base, step, tmp_path / "stats", steps=STEPS, every=2, prepare=compiled)
    assert dynamo_counts() == plain
    forwards_per_step = 2 if case == "two_forwards_one_backward" else 1
    for i in range(STEPS):
        if forwards_per_step == 2 or i % 2 == 1:  # the output of an unsampled forward
            assert torch.equal(result.observed_outputs[i], plain_outputs[i])
    result.assert_conforms()
    sampled = result.history["forward_index"].unique().sort().to_list()
    assert sampled == list(range(0, STEPS * forwards_per_step, 2))
    signals = set(result.history["signal"].unique())
    assert signals == (
        {"output"} if case == "eval_under_no_grad" else {"output", "output_gradient"}
    )


class CountingSampler(EveryNForwardsSampler):
    """EveryNForwardsSampler(2) that counts how often it was asked."""

    def __init__(self) -> None:
        super().__init__(2)
        self.asked = 0

    def should_sample(self, forward_index: int) -> bool:
        self.asked += 1
        return super().should_sample(forward_index)


def forward_dicts(model: nn.Module) -> dict[str, object]:
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


@pytest.mark.parametrize(
    "how", ["torch_compile_after_inject", "inject_on_optimized_module", "model_compile_after"]
)
def test_compiled_model_never_reaches_the_observer_after_removal_even_when_it_recompiles(
    how: str, tmp_path: Path
) -> None:
    model = Net()
    reference = copy.deepcopy(model)  # eager; no step updates the weights
    sampler = CountingSampler()
    if how == "inject_on_optimized_module":
        call = observed = compiled(model)
        before = forward_dicts(observed)
        inject_observer(observed, output_dir=tmp_path / "stats", sampler=sampler)
    else:
        call = observed = model
        before = forward_dicts(observed)
        inject_observer(observed, output_dir=tmp_path / "stats", sampler=sampler)
        if how == "torch_compile_after_inject":
            call = compiled(model)
        else:
            model.compile(backend="aot_eager")
    for i in range(4):
        train_step(call, i)
    remove_observer(observed)
    assert forward_dicts(observed) == before
    assert sampler.asked == 4

    graphs = dynamo_counts()["graphs"]
    for batch in (4, 7, 9):  # new shapes: recompiles (automatic dynamic)
        call(torch.randn(batch, WIDTH)).sum().backward()
    torch._dynamo.reset()  # and everything compiled afresh
    x = torch.randn(5, WIDTH)
    torch.testing.assert_close(call(x), reference(x))
    assert dynamo_counts()["graphs"] > graphs
    assert sampler.asked == 4


def compile_blocks_in_place(model: nn.Module) -> None:
    """Regional compilation by hand: each block replaced by its `torch.compile` wrapper."""
    blocks = model.get_submodule("blocks")
    assert isinstance(blocks, nn.ModuleList)
    for index, block in enumerate(blocks):
        blocks[index] = compiled(block)


def test_blocks_compiled_into_their_parent_after_inject_compile_as_plain_and_rows_equal_hooks(
    tmp_path: Path,
) -> None:
    """`model.blocks[i] = torch.compile(model.blocks[i])` after inject_observer, before the first
    step, each block under non-reentrant checkpointing: the layers inside the wrappers keep their
    eager names and rows equal plain hooks on an eager copy; dynamo compiles what it compiles for
    the plain model, and after removal the compiled blocks run without a recompile. A sampled
    step's backward recomputes the blocks eagerly, as its forward ran them (eager_backward.py):
    compiled, the recomputation would save other tensors than the forward and checkpointing's
    check would fail the backward with a CheckpointError."""
    torch.manual_seed(0)
    base = Net(checkpointed=True)
    plain = copy.deepcopy(base)
    compile_blocks_in_place(plain)
    plain_outputs = run_plain_with(plain)
    plain_counts = dynamo_counts()
    assert plain_counts["graphs"] == 2
    torch._dynamo.reset()
    counters.clear()

    def step(model: nn.Module, i: int) -> torch.Tensor:
        if i == 0:
            compile_blocks_in_place(model)
        return train_step(model, i)

    model = copy.deepcopy(base)
    result = run_both(
        model, step, tmp_path / "stats", reference_step=train_step, steps=STEPS, every=2
    )
    assert dynamo_counts() == plain_counts
    for i in (1, 3, 5):
        assert torch.equal(result.observed_outputs[i], plain_outputs[i])
    result.assert_conforms()
    assert result.history["forward_index"].unique().sort().to_list() == [0, 2, 4]
    # The only instance forwards left are torch.compile's own, on its wrappers.
    left = [m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__]
    assert len(left) == 2
    assert all(forward.__module__.startswith("torch.") for forward in left)
    with torch.compiler.set_stance("fail_on_recompile"):
        torch.manual_seed(1000 + 1)
        assert torch.equal(train_step(model, 1), plain_outputs[1])


def test_accelerate_compile_regions_observed_after_it_rows_equal_plain_hooks(
    tmp_path: Path,
) -> None:
    """accelerate's `compile_regions` returns a new module (the blocks shared and compiled, the
    other leaves compiled one by one), observed as returned: eager layer names, rows equal plain
    hooks on an eager copy, unsampled steps the plain regional model's outputs."""
    from accelerate.utils import compile_regions

    def regions(model: nn.Module) -> nn.Module:
        return compile_regions(model, backend="aot_eager")

    torch.manual_seed(0)
    base = Net()
    plain_outputs = run_plain_with(regions(copy.deepcopy(base)))
    plain = dynamo_counts()
    torch._dynamo.reset()
    counters.clear()

    result = run_both(base, train_step, tmp_path / "stats", steps=STEPS, every=2, prepare=regions)
    assert dynamo_counts() == plain
    for i in (1, 3, 5):
        assert torch.equal(result.observed_outputs[i], plain_outputs[i])
    result.assert_conforms()
    assert result.history["forward_index"].unique().sort().to_list() == [0, 2, 4]


def test_a_sampled_backward_that_raised_leaves_torch_compile_off_only_until_the_next_forward(
    tmp_path: Path,
) -> None:
    """The backward pass of a sampled forward runs with torch.compile off, and its end turns it
    on again; one that raised never reaches its end, so the next root forward does, or removal
    (else every model in the process would run eagerly from then on)."""

    @torch.compile(backend="eager")
    def compiled_now(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if torch.compiler.is_compiling() else x - 1

    def compiling() -> bool:
        return compiled_now(torch.zeros(())).item() == 1

    def failing_hook(grad: torch.Tensor) -> None:
        seen.append(compiling())
        raise RuntimeError("the user's hook")

    seen: list[bool] = []
    model = nn.Linear(WIDTH, 1)
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    try:
        assert compiling()
        output = model(torch.randn(4, WIDTH))  # sampled
        assert compiling()
        output.register_hook(failing_hook)
        with pytest.raises(RuntimeError, match="the user's hook"):
            output.sum().backward()
        assert seen == [False]  # off in the backward pass ...
        del output  # the pass's tensors and hooks freed: the hold must outlive them
        gc.collect()
        assert not compiling()  # ... and left off by its exception ...
        model(torch.randn(4, WIDTH)).sum().backward()  # ... until the next root forward
        assert compiling()
        model(torch.randn(4, WIDTH)).sum().backward()  # sampled, and a backward that ends
        assert compiling()
        model(torch.randn(4, WIDTH)).sum().backward()  # not sampled
        output = model(torch.randn(4, WIDTH))  # sampled
        output.register_hook(failing_hook)
        with pytest.raises(RuntimeError, match="the user's hook"):
            output.sum().backward()
        assert not compiling()
    finally:
        remove_observer(model)  # as a trainer's callback does after a fit that raised
    assert compiling()  # removal ends the hold too: no later forward of this model needed
