"""Shared by the torch.compile tests: a small residual model, the ways of compiling it
relative to inject_observer (`Setup`, `prepare`), and dynamo's graph and break counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import torch
from torch import nn
from torch._dynamo.utils import counters

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
