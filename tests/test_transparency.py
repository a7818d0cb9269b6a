"""Observed and unobserved runs give bit-identical outputs and gradients (property tests)."""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

ModelFactory = Callable[[], nn.Module]


def make_mlp(widths: list[int], activation: str) -> ModelFactory:
    acts = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "relu_": lambda: nn.ReLU(True)}

    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), acts[activation]()]
        return nn.Sequential(*layers, nn.Dropout(0.2))

    return build


def make_conv(channels: int) -> ModelFactory:
    def build() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(2, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.LazyLinear(3),
        )

    return build


class Recurrent(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def run(factory: ModelFactory, x: torch.Tensor, observe: bool, seed: int) -> tuple:
    """Build, run forward+backward twice, and return outputs, grads and the RNG state after."""
    torch.manual_seed(seed)
    model = factory()
    model(x)  # materialise lazy modules before injection, identically in both runs
    outputs, grads = [], []
    # Hypothesis calls the test many times per tmp_path: each run's directory is its own,
    # removed once the run is finished.
    with tempfile.TemporaryDirectory() as directory:
        if observe:
            inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
        for _ in range(2):
            model.zero_grad()
            out = model(x)
            (out.float() ** 2).mean().backward()
            outputs.append(out.detach().clone())
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        if observe:
            remove_observer(model)
    outputs.append(model(x).detach().clone())  # after removal: the plain model again
    return outputs, grads, torch.get_rng_state()


def assert_bit_identical(a: tuple, b: tuple) -> None:
    outputs_a, grads_a, rng_a = a
    outputs_b, grads_b, rng_b = b
    for x, y in zip(outputs_a, outputs_b, strict=True):
        assert torch.equal(x, y)
    for step_a, step_b in zip(grads_a, grads_b, strict=True):
        assert len(step_a) == len(step_b)
        for x, y in zip(step_a, step_b, strict=True):
            assert torch.equal(x, y)
    assert torch.equal(rng_a, rng_b)


@settings(max_examples=15, deadline=None)
@given(
    widths=st.lists(st.integers(1, 12), min_size=2, max_size=5),
    activation=st.sampled_from(["relu", "tanh", "gelu", "relu_"]),
    batch=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_mlp_outputs_and_gradients_are_bit_identical(
    widths: list[int], activation: str, batch: int, seed: int
) -> None:
    factory = make_mlp(widths, activation)
    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(seed))
    observed = run(factory, x, True, seed)
    plain = run(factory, x, False, seed)
    assert_bit_identical(observed, plain)


@settings(max_examples=8, deadline=None)
@given(channels=st.integers(1, 6), size=st.sampled_from([4, 6, 8]), seed=st.integers(0, 2**16))
def test_conv_outputs_and_gradients_are_bit_identical(channels: int, size: int, seed: int) -> None:
    factory = make_conv(channels)
    x = torch.randn(3, 2, size, size, generator=torch.Generator().manual_seed(seed))
    assert_bit_identical(run(factory, x, True, seed), run(factory, x, False, seed))


@settings(max_examples=8, deadline=None)
@given(hidden=st.integers(1, 8), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_recurrent_outputs_and_gradients_are_bit_identical(
    hidden: int, steps: int, seed: int
) -> None:
    x = torch.randn(2, steps, 3, generator=torch.Generator().manual_seed(seed))
    factory = lambda: Recurrent(hidden)  # noqa: E731
    assert_bit_identical(run(factory, x, True, seed), run(factory, x, False, seed))


def test_output_after_removal_equals_output_before_injection(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = make_mlp([4, 6, 2], "tanh")().eval()
    x = torch.randn(5, 4)
    before = model(x)
    inject_observer(model, output_dir=tmp_path / "s")
    during = model(x)
    remove_observer(model)
    assert torch.equal(before, during)
    assert torch.equal(before, model(x))
