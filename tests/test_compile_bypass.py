"""A module built from the observed model after inject_observer runs it unobserved, and says so.

accelerate's `compile_regions(model)` (and any module made from a shallow copy of the model's
`__dict__` with `forward` rebound to the class's own) calls the model's layers without its root
forward. Removal must not say "the model was never called": the warning and index.md name the
module that ran it and the fix.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from types import MethodType

import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x).relu()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(module: nn.Module, model: nn.Module, steps: int = 3) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        module(torch.randn(4, WIDTH)).square().mean().backward()
        optimizer.step()


def removal_warnings(model: nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remove_observer(model)
    return [str(w.message) for w in caught if "torchinstruments" in str(w.message)]


def shallow_copy_rebound(model: nn.Module) -> nn.Module:
    """A module of the model's class built from its `__dict__`, forward rebound to the class's."""
    built = model.__class__.__new__(model.__class__)
    built.__dict__.update(model.__dict__)
    built.__dict__["forward"] = MethodType(type(model).forward, built)
    return built


def test_compile_regions_after_inject_is_named_as_the_cause_not_a_model_never_called(
    tmp_path: Path,
) -> None:
    from accelerate.utils import compile_regions

    torch.manual_seed(0)
    model = Net()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(2))
    regional = compile_regions(model, backend="eager")
    train(regional, model)
    said = removal_warnings(model)
    index = (tmp_path / "run" / "index.md").read_text()

    assert len(said) == 1
    assert "no sample was recorded (0 root forwards seen, none sampled;" in said[0]
    for text in (said[0], index):
        assert "the model was never called" not in text
        assert "the module accelerate's compile_regions built from it shares its layers" in text
        assert "call inject_observer on that module (the one compile_regions returns)" in text


def test_compile_regions_module_observed_itself_records_and_names_no_copy(tmp_path: Path) -> None:
    """The fix the message gives: inject into what compile_regions returns."""
    from accelerate.utils import compile_regions

    torch.manual_seed(0)
    model = Net()
    regional = compile_regions(model, backend="eager")
    inject_observer(regional, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(2))
    train(regional, model, steps=2)
    assert removal_warnings(regional) == []
    index = (tmp_path / "run" / "index.md").read_text()
    assert "No sample was recorded" not in index
    assert "shares its layers" not in index


def test_shallow_copy_with_its_own_forward_is_named_as_the_cause(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(2))
    built = shallow_copy_rebound(model)
    train(built, model)
    said = removal_warnings(model)
    index = (tmp_path / "run" / "index.md").read_text()
    assert len(said) == 1
    for text in (said[0], index):
        assert "the model was never called" not in text
        assert "a module built from a shallow copy of its __dict__ shares its layers" in text
        assert "call inject_observer on that module and remove_observer on it" in text


def test_model_never_called_without_a_copy_still_says_never_called(tmp_path: Path) -> None:
    model = Net()
    inject_observer(model, output_dir=tmp_path / "run")
    twin = copy.copy(model)  # shares the root proxy: its calls would count; none is made
    said = removal_warnings(model)
    index = (tmp_path / "run" / "index.md").read_text()
    assert said == [
        f"torchinstruments: no sample was recorded (0 root forwards seen, none sampled): "
        f"{tmp_path / 'run'} holds no rows, and its index.md says so"
    ]
    assert "**No sample was recorded:** the model was never called, so" in index
    assert "shares its layers" not in index
    del twin
