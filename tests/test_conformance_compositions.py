"""Random compositions of layer kinds and training steps equal plain hooks, on every CPU path.

The conformance zoo runs real models; this file runs what real models are made of, composed at
random (seeded: a failure names its seed): tuple, dict and list outputs, a view of an input, one
tensor returned twice, one module called twice, an output changed in place after its layer
returned, no_grad and checkpointed sub-blocks, bfloat16 autocast, float64 layers, NaN and ±inf
entries, integer outputs, dropout (whose random numbers stay the user's), tensors above
`order.SMALL` entries; and the steps a job takes: training, evaluation under no_grad, eval mode
with a backward, a forward under no_grad in train mode, gradient accumulation (two forwards, one
backward). Each composition is observed and, on a deep copy, hooked (`hook_reference.run_both`):
every row equals the reference both ways, and the model computes what it computes unobserved.

Paths (`PATHS`): the small-tensor lane; the host path alone (the lane declining every tensor);
the host paths where selection is quicker than the CPU's sort; a custom reducer beside the
default profile (no lane: `reducers.Measurer`'s host path; its abs_max rows compared too); the sync-free general path a GPU
runs, here on the CPU.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchinstruments import AbsMax
from torchinstruments.measurement import lane, order, paths

from hook_reference import run_both

WIDTHS = (3, 16, 64, 300, 1100)  # 64 x 1100 entries: above order.SMALL, the selection's range
BATCHES = (1, 4, 32, 64)
STEP_KINDS = ("train", "train", "eval", "eval_mode", "no_grad", "accumulate")
SEEDS = range(20)


class TupleOut(nn.Module):
    """Returns a tensor that requires grad and a detached one."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.detach() - 1


class DictOut(nn.Module):
    """Returns a dict: a tensor of the input's shape and a reduced one."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": x + 1, "b": x.sum(dim=1)}


class TwiceOut(nn.Module):
    """Returns its input twice in a list: one tensor at two paths."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x, x]


class First(nn.Module):
    """Calls `inner` and passes on its first (or only) tensor."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if isinstance(out, dict):
            return out["a"]
        return out[0] if isinstance(out, tuple | list) else out


class HalfView(nn.Module):
    """Returns a view of its input's first half of columns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : max(1, x.shape[1] // 2)]


class NonFinite(nn.Module):
    """Puts `value` (NaN or ±inf) in every seventh entry."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask.view(-1)[::7] = True
        return x.masked_fill(mask, self.value)


class Finite(nn.Module):
    """Replaces non-finite entries, so that the layers after compute on numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)


class ArgMax(nn.Module):
    """Returns an int64 tensor (no gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=1)


class SideArgMax(nn.Module):
    """Calls an integer-valued layer and passes its input on."""

    def __init__(self) -> None:
        super().__init__()
        self.arg = ArgMax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.arg(x)
        return x


class DoubledInPlace(nn.Module):
    """Doubles `inner`'s output in place after `inner` returned it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).mul_(2)


class NoGrad(nn.Module):
    """Runs `inner` under no_grad and adds its result to the input."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = self.inner(x)
        return x + y


class CalledTwice(nn.Module):
    """One Linear called twice in a forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.relu(self.linear(x)))


class ToDouble(nn.Module):
    """Returns a float64 tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double() * 1.5


class Float64(nn.Module):
    """A float64 Linear between float32 layers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.to_double = ToDouble()
        self.linear = nn.Linear(width, width).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.to_double(x)).float()


class Checkpointed(nn.Module):
    """`inner` under non-reentrant activation checkpointing (run again in the backward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


class Conv(nn.Module):
    """A Conv1d over the features as one channel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(1)).squeeze(1)


class Autocast(nn.Module):
    """A Linear under bfloat16 autocast: a bfloat16 output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.linear(x)
        return y.float()


def _leaf_kinds(width: int, rng: random.Random) -> list[Callable[[], nn.Module]]:
    """Blocks without sub-blocks of their own."""
    return [
        lambda: nn.Linear(width, width),
        nn.ReLU,
        lambda: nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True)),
        nn.GELU,
        nn.Sigmoid,
        lambda: nn.LayerNorm(width),
        lambda: nn.Dropout(0.3),
        lambda: First(TupleOut()),
        lambda: First(DictOut()),
        lambda: First(TwiceOut()),
        lambda: nn.Sequential(HalfView(), nn.Linear(max(1, width // 2), width)),
        lambda: nn.Sequential(NonFinite(rng.choice([math.nan, math.inf, -math.inf])), Finite()),
        SideArgMax,
        lambda: DoubledInPlace(nn.Linear(width, width)),
        lambda: CalledTwice(width),
        lambda: Float64(width),
        Conv,
        lambda: Autocast(width),
        nn.Identity,
    ]


def block(rng: random.Random, width: int, depth: int) -> nn.Module:
    """A random block: a leaf kind, or (two levels at most) a no_grad, checkpointed or
    sequential block of random blocks."""
    kinds = _leaf_kinds(width, rng)
    choice = rng.randrange(len(kinds) + (3 if depth < 2 else 0))
    if choice < len(kinds):
        return kinds[choice]()
    inner = nn.Sequential(*[block(rng, width, depth + 1) for _ in range(rng.randint(1, 3))])
    return [NoGrad, Checkpointed, lambda module: module][choice - len(kinds)](inner)


def composition(seed: int) -> tuple[nn.Module, int, list[str], int]:
    """The model, batch size, step kinds and sampling interval of one seed."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    width, batch = rng.choice(WIDTHS), rng.choice(BATCHES)
    blocks = [block(rng, width, 0) for _ in range(rng.randint(2, 6))]
    model = nn.Sequential(nn.Linear(8, width), *blocks)
    return model, batch, [rng.choice(STEP_KINDS) for _ in range(4)], rng.choice([1, 1, 2])


def stepper(batch: int, kinds: list[str]) -> Callable[[nn.Module, int], torch.Tensor]:
    """Step `i` of kind `kinds[i]`; returns the last forward's output."""

    def step(model: nn.Module, i: int) -> torch.Tensor:
        kind, x = kinds[i], torch.randn(batch, 8)
        if kind == "train":
            out = model(x)
            out.square().mean().backward()
        elif kind == "eval":
            model.eval()
            with torch.no_grad():
                out = model(x)
            model.train()
        elif kind == "eval_mode":  # eval mode, gradients on (an evaluation of input gradients)
            model.eval()
            out = model(x)
            out.sum().backward()
            model.train()
        elif kind == "no_grad":
            with torch.no_grad():
                out = model(x)
        else:  # gradient accumulation
            first, out = model(x), model(x * 0.5)
            (first.mean() + out.square().mean()).backward()
        for parameter in model.parameters():
            parameter.grad = None
        return out.detach()

    return step


def _lane(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """As installed: a sample's small float32 CPU tensors measured together."""
    return {}


def _host(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The lane declines every tensor: each CPU tensor measured alone."""
    monkeypatch.setattr(lane, "takes", lambda tensor: False)
    return {}


def _selected(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """As where the CPU's sort is slower than selection."""
    monkeypatch.setattr(order, "selection_is_quicker", lambda *args, **kwargs: True)
    return {}


def _custom(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A custom reducer beside the default profile."""
    return {"reducers": [AbsMax()]}


def _general(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every tensor on the sync-free general path, as on a GPU."""
    monkeypatch.setattr(paths, "choose", lambda tensor, **kwargs: "general")
    return {}


PATHS = {
    "lane": _lane,
    "host": _host,
    "selected": _selected,
    "custom": _custom,
    "general": _general,
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("path", list(PATHS))
def test_random_compositions_and_steps_equal_plain_hooks(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None, path: str, seed: int
) -> None:
    model, batch, kinds, every = composition(seed)
    extra = PATHS[path](monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # checkpointing's and autocast's own notes
        result = run_both(model, stepper(batch, kinds), run_dir, steps=4, every=every, **extra)
    result.assert_conforms()
    for observed, reference in zip(result.observed_outputs, result.reference_outputs, strict=True):
        assert torch.equal(observed, reference), f"seed {seed}: the observed model computed else"
