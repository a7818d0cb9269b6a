"""The conformance zoo's harness: the devices a case runs on, its step on fresh inputs, and the
check that a run equals plain hooks on its copy in both directions (`hook_reference`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from hook_reference import (
    ACCELERATOR_TOLERANCE,
    CPU_TOLERANCE,
    Conformance,
    Tolerance,
    leaves,
)

# Deterministic kernels on CUDA (set before the first CUDA call makes a cuBLAS handle).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

HAS_CUDA = torch.cuda.is_available()
CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]

Step = Callable[[nn.Module, int], Any]
Case = Callable[[torch.device], tuple[nn.Module, Step]]


@pytest.fixture(name="device", params=DEVICES)
def device_fixture(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The device a case runs on; on CUDA with deterministic algorithms."""
    name = request.param
    if name == "cpu":
        yield torch.device("cpu")
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield torch.device(name)
    finally:
        torch.use_deterministic_algorithms(False)


def tolerance_for(device: torch.device) -> Tolerance:
    """The comparison's tolerance on `device` (float64 rounding on the CPU)."""
    return CPU_TOLERANCE if device.type == "cpu" else ACCELERATOR_TOLERANCE


def assert_same_results(result: Conformance, exact: bool) -> None:
    """The observed steps computed what the copy computed."""
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        for a, b in zip(leaves(got), leaves(want), strict=True):
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b)


def check(
    result: Conformance, device: torch.device, *, compare_shapes: bool = True, exact: bool = True
) -> None:
    """Results equal, and the rows conform in both directions."""
    assert_same_results(result, exact and device.type == "cpu")
    result.assert_conforms(tolerance=tolerance_for(device), compare_shapes=compare_shapes)
    assert not result.history.is_empty(), "no rows at all"


def squares_step(inputs: Callable[[], torch.Tensor]) -> Step:
    """A step: forward on fresh inputs, backward of the sum of squares of the first output."""

    def step(m: nn.Module, i: int) -> Any:
        out = m(inputs())
        first = next(iter(leaves(out)))
        first.float().square().sum().backward()
        return out

    return step
