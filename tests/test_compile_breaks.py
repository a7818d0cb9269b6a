"""torch.compile with a graph break inside the model: observed, it compiles as the plain model does.

A model whose forward (or a submodule's) breaks the graph is compiled twice from the same
weights, without and with an observer, and run for the same steps (sampled and unsampled
alternating). Dynamo's counters must agree: graphs, graph breaks, compiled frames and
recompiles. An observer frame between the root wrapper and the model's forward would itself
break at the call (one more break, one more frame), which is what these tests would see.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

STEPS = 6


class Breaking(nn.Module):
    """A linear layer followed by a graph break, then a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        torch._dynamo.graph_break()
        return y.relu()


class BreakInRoot(nn.Module):
    """The root's own forward breaks the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).tanh()
        torch._dynamo.graph_break()
        return self.b(self.norm(h))


class BreakInSubmodule(nn.Module):
    """A submodule's forward breaks the graph; the root is called with keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.sub = Breaking()
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(self.sub(self.a(x))) * scale


def break_in_sequential() -> nn.Module:
    """A torch container root (its forward lives in torch) holding a module that breaks."""
    return nn.Sequential(nn.Linear(4, 6), Breaking(), nn.Linear(6, 2))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "break_in_root": BreakInRoot,
    "break_in_submodule": BreakInSubmodule,
    "break_in_sequential_child": break_in_sequential,
}


def compiled(model: nn.Module, how: str, backend: str, observe: Path | None) -> nn.Module:
    """`model` compiled as `how` says, the observer injected at that point when `observe`."""

    def attach() -> None:
        if observe is not None:
            inject_observer(model, output_dir=observe, sampler=EveryNForwardsSampler(2))

    if how == "compile_after_inject":
        attach()
        result = torch.compile(model, backend=backend)
        assert isinstance(result, nn.Module)
        return result
    if how == "model_compile_before_inject":
        model.compile(backend=backend)
        attach()
        return model
    assert how == "model_compile_after_inject"
    attach()
    model.compile(backend=backend)
    return model


def dynamo_counts() -> dict[str, Any]:
    """Graphs, graph breaks, compiled frames and recompiles so far."""
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],
        "recompiles": sum(counters["recompiles"].values()),
    }


def run_steps(call: nn.Module, keywords: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    outputs = []
    for _ in range(STEPS):
        x = torch.randn(5, 4, generator=generator)
        y = call(x=x, scale=2.0) if keywords else call(x)
        y.square().mean().backward()
        outputs.append(y.detach())
    return outputs


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


CASES = [
    ("break_in_root", "compile_after_inject", "eager"),
    ("break_in_root", "compile_after_inject", "aot_eager"),
    ("break_in_root", "model_compile_before_inject", "eager"),
    ("break_in_root", "model_compile_after_inject", "eager"),
    ("break_in_submodule", "compile_after_inject", "eager"),
    ("break_in_submodule", "model_compile_after_inject", "aot_eager"),
    ("break_in_submodule", "compile_after_inject", "inductor"),
    ("break_in_sequential_child", "compile_after_inject", "eager"),
]


@pytest.mark.parametrize(
    ("model_name", "how", "backend"), CASES, ids=["-".join(case) for case in CASES]
)
def test_graph_break_in_the_model_costs_what_it_costs_the_plain_model(
    model_name: str, how: str, backend: str, tmp_path: Path
) -> None:
    base = MODELS[model_name]()
    keywords = model_name == "break_in_submodule"

    plain_outputs = run_steps(compiled(copy.deepcopy(base), how, backend, None), keywords)
    plain = dynamo_counts()
    assert plain["breaks"] >= 1
    torch._dynamo.reset()
    counters.clear()

    model = copy.deepcopy(base)
    outputs = run_steps(compiled(model, how, backend, tmp_path / "run"), keywords)
    observed = dynamo_counts()
    remove_observer(model)

    assert observed == plain
    for index in range(1, STEPS, 2):  # unsampled steps: the plain compiled graphs
        assert torch.equal(outputs[index], plain_outputs[index])
    assert (tmp_path / "run" / "history.parquet").is_file()
