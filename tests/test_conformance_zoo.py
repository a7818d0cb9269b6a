"""The conformance zoo: real model code, every row against plain hooks on a deep copy.

Each case observes a model for one or two steps (every forward sampled, unless it says otherwise)
and runs a deep copy of it with `register_forward_hook` + `Tensor.register_hook`, reduced with
NumPy (`hook_reference`). Both directions are compared: every reference tensor has a row, every
row has a reference tensor, and every value equals NumPy's within a float64-rounding tolerance.
The cases run on the CPU, and on CUDA too when it is available (skipped otherwise); on CUDA the
zoo also counts host synchronisations: none added to an unsampled step (run under
`torch.cuda.set_sync_debug_mode("error")` when the plain model itself syncs never), at most one
per sampled forward and one per backward on a (steady-state) sampled step. `bench/device_check.sh` runs the CUDA
half on one GPU.

References that need a definition:
- torch.func: test_conformance_torch_func.py says what the reference is for each transform.
- non-reentrant checkpointing: the forward's calls; the recomputation during backward is
  neither a root forward nor a call nor a row (`hook_reference` skips what a backward pass
  calls, also inside a root forward). Reentrant checkpointing runs its block under no_grad in
  the forward: output rows, and no gradient rows (plain hooks have none).
- torch.compile: sampled forwards run eagerly, so their rows equal the eager copy's; the
  unsampled forward between them runs the compiled graph and has no rows.
Tensor parallelism and FSDP2 are in test_conformance_distributed.py (two gloo processes).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from _zoo import (
    CUDA_ONLY,
    check,
    device_fixture,  # noqa: F401 (a fixture)
    squares_step,
)
from _zoo_cases import CASES, HELD_NOT_CALLED, PARAMETRIZED, STEPS
from hook_reference import run_both

# One torch thread: the same reduction order on both sides, and tiny models run faster on one
# thread than on two contended ones. On a machine of two or more cores that leaves a core spare,
# so the CPU cases' tensors of 2**16 to 2**22 entries are measured by spare_core's worker
# (test_spare_core.py holds its rows to the training thread's, bit for bit).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", list(CASES))
def test_rows_equal_plain_hooks(run_dir: Path, device: torch.device, name: str) -> None:
    model, step = CASES[name](device)
    result = run_both(model, step, run_dir, steps=STEPS.get(name, 1))
    if name == "bf16_autocast":
        assert "bfloat16" in result.history["dtype"].unique().to_list()
    if name in HELD_NOT_CALLED:  # and the children it never calls have none
        layer, holder = HELD_NOT_CALLED[name]
        assert layer in result.catalog
        assert holder not in result.catalog
        assert layer in result.history["layer"].unique().to_list()
    if name == "structured_outputs":
        paths = set(result.history["tensor_path"].to_list())
        assert {".extra[0]", ".extra[('gate', 1)]", ".policy['mean']", ".value"} <= paths
    if name == "torchscript_submodule":
        assert result.catalog == ["0", "2", "3"]
    if name in PARAMETRIZED:
        assert not [layer for layer in result.catalog if ".parametrizations" in layer]
        assert set(PARAMETRIZED[name]) <= set(result.history["layer"].unique().to_list())
    check(result, device)


def test_inductor_compiled_model(run_dir: Path, device: torch.device) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    step = squares_step(lambda: torch.randn(4, 8, device=device))
    result = run_both(model, step, run_dir, steps=3, every=2, prepare=torch.compile)
    assert sorted(result.history["forward_index"].unique().to_list()) == [0, 2]
    check(result, device, exact=False)  # the unsampled step ran inductor's kernels


def test_inductor_compiled_model_across_shape_changes(run_dir: Path, device: torch.device) -> None:
    """The batch size changes every step: the unsampled steps compile, then recompile with
    dynamic shapes (torch.compile's automatic dynamic), the sampled ones between them run
    eagerly; their rows equal the eager copy's."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(device)

    def step(m: nn.Module, i: int) -> Any:
        return squares_step(lambda: torch.randn(2 + i, 8, device=device))(m, i)

    result = run_both(model, step, run_dir, steps=5, every=2, prepare=torch.compile)
    assert sorted(result.history["forward_index"].unique().to_list()) == [0, 2, 4]
    assert sorted({s[0] for s in result.history["shape"].to_list()}) == [2, 4, 6]
    check(result, device, exact=False)  # the unsampled steps ran inductor's kernels


# --- CUDA: host synchronisations ----------------------------------------------------------------


def count_host_syncs(fn: Callable[[], Any]) -> int:
    """How many synchronising CUDA calls `fn` makes (torch's sync debug mode, warn level)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def run_without_host_syncs(fn: Callable[[], Any]) -> None:
    """Run `fn` with any synchronising CUDA call raising."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@CUDA_ONLY
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_host_syncs(run_dir: Path, name: str) -> None:
    device = torch.device("cuda")
    model, step = CASES[name](device)
    plain = copy.deepcopy(model)
    step(plain, 0)  # warm-up: lazy CUDA initialisation is not the step's
    plain_syncs = count_host_syncs(lambda: step(plain, 1))
    step(model, 0)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    try:
        sampled = [count_host_syncs(lambda: step(model, 1))]  # forward_index 0: sampled
        if plain_syncs == 0:
            run_without_host_syncs(lambda: step(model, 2))  # forward_index 1: not sampled
            unsampled = 0
        else:
            unsampled = count_host_syncs(lambda: step(model, 2))
        sampled.append(count_host_syncs(lambda: step(model, 3)))  # forward_index 2: sampled
    finally:
        remove_observer(model)
    torch.cuda.synchronize()
    print(f"{name}: host syncs per step: plain {plain_syncs}, sampled {sampled}")
    assert unsampled == plain_syncs
    # Steady state (the second sampled step; the first may make one-time constants): one
    # transfer when the sampled forward ends, one when its backward ends.
    passes = 1 if name == "transformer_encoder_eval_no_grad" else 2
    assert plain_syncs <= sampled[1] <= plain_syncs + passes, (sampled, plain_syncs)
