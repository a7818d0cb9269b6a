"""The conformance zoo, distributed: tensor parallel and FSDP2 on two real gloo processes.

One launch of two spawned ranks (127.0.0.1) runs every case; each rank compares its own rows
against plain hooks on a copy of the model that was parallelized (or sharded) the same way, and
writes what differed to a report the tests below read. A deep copy of an already parallelized
model would not be parallelized like it, so the model is copied first and both are prepared.

References (hook_reference):
- tensor parallel: `register_forward_hook(prepend=True)` sees what each Linear's forward
  returned, before the parallel style's own output hook converts it: a DTensor. Replicate rows
  describe the whole tensor, Shard(d) rows this rank's local shard (`to_local()`), Partial rows
  (RowwiseParallel's raw output: partial sums) are null with a reason that says "partial". The
  ReLU between the two Linears returns this rank's local part (a plain tensor with
  `use_local_output=True`, a Shard DTensor without). Both ranks feed the same inputs (tensor
  parallelism needs them replicated).
- FSDP2 (`fully_shard` on each Linear and the root): the layers see all-gathered parameters and
  return plain tensors; each rank feeds its own inputs.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _ranks import joined, run_ranks

TIMEOUT_SECONDS = 180
CASES = ("tp-local", "tp-dtensor", "fsdp2")


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part, a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_parallel_case(run_dir: Path, use_local_output: bool) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    from hook_reference import run_both

    mesh = init_device_mesh("cpu", (2,))
    plan: dict[str, ParallelStyle] = {
        "fc1": ColwiseParallel(use_local_output=use_local_output),
        "fc2": RowwiseParallel(use_local_output=use_local_output),
    }

    def step(model: nn.Module, i: int) -> torch.Tensor:
        out = local(model(torch.randn(4, 8)))  # the same inputs on both ranks
        out.square().sum().backward()
        return out.detach()

    torch.manual_seed(0)
    result = run_both(
        TwoLinears(),
        step,
        run_dir,
        prepare_both=lambda m: parallelize_module(m, mesh, plan),
        rank_policy="all",
    )
    placements = set(result.history["placement"].drop_nulls().unique().to_list())
    expected = {"Shard(1)", "Partial(sum)"} | (set() if use_local_output else {"Replicate"})
    missing = [f"no {p} row (placements: {placements})" for p in expected if p not in placements]
    return missing + problems_of(result)


def fsdp2_case(run_dir: Path, rank: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hook_reference import run_both

    mesh = init_device_mesh("cpu", (2,))

    def shard(model: nn.Module) -> None:
        for name in ("fc1", "fc2"):
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)

    def step(model: nn.Module, i: int) -> torch.Tensor:
        torch.manual_seed(100 * rank + i)  # each rank its own batch
        out = model(torch.randn(4, 8))
        out.square().sum().backward()
        return out.detach()

    torch.manual_seed(0)
    result = run_both(TwoLinears(), step, run_dir, prepare_both=shard, rank_policy="all", steps=2)
    # fully_shard gives each module a class of its own (FSDPLinear): rows list the user's class.
    plain = {name: type(module).__name__ for name, module in TwoLinears().named_modules()}
    listed = result.history.select("layer", "module_type").unique().iter_rows()
    retyped = [f"{layer!r} listed as {kind}" for layer, kind in listed if kind != plain[layer]]
    return problems_of(result) + retyped


def problems_of(result: Any) -> list[str]:
    """Differences from the reference (hook_reference.compare), results included."""
    from hook_reference import compare, observed_tensors

    problems = []
    if result.catalog != result.layers:
        problems.append(f"catalog {result.catalog} != {result.layers}")
    for got, want in zip(result.observed_outputs, result.reference_outputs, strict=True):
        if not torch.equal(got, want):
            problems.append("the observed step computed something else than the copy")
    problems += compare(observed_tensors(result.history), result.recorder.tensors)
    if result.history.is_empty():
        problems.append("no rows")
    return problems


def worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """One rank: every case, each in a run directory of its own; a report per rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on the machine's cores, not four contended threads
    report: dict[str, list[str]] = {}
    with joined(rank, world_size, port):
        try:
            for case in CASES:
                run_dir = Path(output_dir, case)
                try:
                    if case == "fsdp2":
                        report[case] = fsdp2_case(run_dir, rank)
                    else:
                        report[case] = tensor_parallel_case(run_dir, case == "tp-local")
                except Exception:
                    report[case] = [f"raised: {traceback.format_exc()}"]
                dist.barrier()
        finally:
            Path(output_dir, f"report-{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[str]]]:
    """Both ranks' reports, from one launch of two processes."""
    output_dir = tmp_path_factory.mktemp("distributed-zoo")
    run_ranks(worker, str(output_dir), timeout_s=TIMEOUT_SECONDS)
    return {rank: json.loads((output_dir / f"report-{rank}.json").read_text()) for rank in range(2)}


def assert_case_conforms(reports: dict[int, dict[str, list[str]]], case: str) -> None:
    for rank in range(2):
        problems = reports[rank][case]
        shown = "\n  ".join(problems[:30])
        assert not problems, f"rank {rank}, {case}: {len(problems)} differences:\n  {shown}"


@pytest.mark.parametrize("case", ["tp-local", "tp-dtensor"], ids=["local_output", "dtensor_output"])
def test_tensor_parallel(reports: dict[int, dict[str, list[str]]], case: str) -> None:
    assert_case_conforms(reports, case)


def test_fsdp2(reports: dict[int, dict[str, list[str]]]) -> None:
    assert_case_conforms(reports, "fsdp2")
