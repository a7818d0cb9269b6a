"""Tensor parallelism on two real gloo processes: DTensor outputs are measured, never null, and
their rows say what they describe; the library adds no collective to the step.

`parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})`: the
layer proxies see each parallel Linear's output before the parallel style's own forward hook
converts it, so fc1 returns a DTensor sharded on its last dim (this rank's shard is measured and
labelled), fc2 a Partial DTensor (partial sums: null with a reason), and the ReLU between them a
plain tensor that is this rank's local part (the run says so).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import polars as pl
import torch
from torch import nn

from torchinstruments.records import MetricValue

from _ranks import joined, run_ranks
from conftest import assert_matches_numpy, read_history


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def collectives(step: object) -> int:
    """How many collective ops (gloo/c10d) one call of `step` runs, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()  # type: ignore[operator]
    names = [event.name for event in prof.events() or []]
    return sum(1 for name in names if "all_reduce" in name or "allreduce" in name or "gloo" in name)


def worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """One rank: a tensor-parallel model, observed; references from an unsharded copy."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with joined(rank, world_size, port):
        torch.manual_seed(0)
        plain = TwoLayers()
        model = TwoLayers()
        model.load_state_dict(plain.state_dict())
        mesh = init_device_mesh("cpu", (world_size,))
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        x = torch.randn(5, 4)  # the same on both ranks (same seed)
        step = lambda: model(x).sum().backward()  # noqa: E731
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inject_observer(
                model, output_dir=output_dir, sampler=EveryNForwardsSampler(1), rank_policy="all"
            )
            observed_collectives = collectives(step)
            remove_observer(model)
        plain_collectives = collectives(step)
        # The reference: the parallel model's own step, unobserved, with fc1's output (this
        # rank's local shard, as ColwiseParallel hands it on) kept for its gradient. Its float32
        # values are what the layer computed; the unsharded model's shard is the same up to
        # rounding only (a matmul of 3 columns may round differently from one of 6: 1 ulp on an
        # AMD EPYC), so the statistics are checked against the former, the values against both.
        local = model.fc1(x)
        local.retain_grad()
        model.fc2(model.relu(local)).sum().backward()
        assert local.grad is not None
        hidden = plain.fc1(x)
        hidden.retain_grad()
        plain.fc2(plain.relu(hidden)).sum().backward()
        assert hidden.grad is not None
        shard = slice(rank * 3, rank * 3 + 3)  # fc1's 6 output features, split over 2 ranks
        report = {
            "warnings": [str(w.message) for w in caught],
            "collectives": [observed_collectives, plain_collectives],
            "fc1": local.detach().tolist(),
            "fc1_grad": local.grad.tolist(),
            "relu": model.relu(local).detach().tolist(),
            "fc1_unsharded": hidden[:, shard].detach().tolist(),
            "fc1_grad_unsharded": hidden.grad[:, shard].tolist(),
        }
        Path(output_dir, f"report-{rank}.json").write_text(json.dumps(report))
    # Done: end as a forked child ends, without the interpreter's teardown. The profiler's
    # (kineto's) thread can be unwound at exit and abort the process (SIGABRT, "terminate called
    # without an active exception", pytorch/kineto#1051) after everything above succeeded; an
    # exception above still ends the process with a failing exit code.
    os._exit(0)


def profile_of(rows: pl.DataFrame, layer: str, signal: str = "output") -> dict[str, MetricValue]:
    """The metric values of one layer's rows."""
    chosen = rows.filter(pl.col("layer") == layer, pl.col("signal") == signal)
    return {
        r["metric"]: MetricValue(r["value"], r["unavailable_reason"])
        for r in chosen.rows(named=True)
    }


def test_tensor_parallel_layers_are_measured_and_labelled(tmp_path: Path) -> None:
    output_dir = tmp_path / "stats"
    output_dir.mkdir()
    run_ranks(worker, str(output_dir))
    for rank in range(2):
        report = json.loads((output_dir / f"report-{rank}.json").read_text())
        directory = output_dir / f"rank-{rank:03d}"
        rows = read_history(directory)
        # no collective added: the observed step runs exactly the plain step's collectives
        assert report["collectives"][0] == report["collectives"][1]
        fc1 = rows.filter(pl.col("layer") == "fc1")
        assert set(fc1["placement"].to_list()) == {"Shard(1)"}
        assert fc1["mesh_coordinate"].to_list() == [[rank]] * fc1.height
        assert fc1["shape"].to_list() == [[5, 3]] * fc1.height  # this rank's local shard
        # this rank's shard of the unsharded model, up to float32 rounding of the matmul
        for name in ("fc1", "fc1_grad"):
            np.testing.assert_allclose(
                np.array(report[name]), np.array(report[f"{name}_unsharded"]), rtol=1e-6, atol=1e-7
            )
        assert_matches_numpy(profile_of(rows, "fc1"), np.array(report["fc1"]))
        assert_matches_numpy(
            profile_of(rows, "fc1", "output_gradient"), np.array(report["fc1_grad"])
        )
        # the ReLU between them: a plain tensor, this rank's local part
        relu = rows.filter(pl.col("layer") == "relu")
        assert relu["placement"].null_count() == relu.height
        assert_matches_numpy(profile_of(rows, "relu"), np.array(report["relu"]))
        # fc2 returns partial sums: null with a reason that says so, labelled
        fc2 = rows.filter(pl.col("layer") == "fc2", pl.col("signal") == "output")
        assert fc2["value"].null_count() == fc2.height
        assert set(fc2["placement"].to_list()) == {"Partial(sum)"}
        assert set(fc2["unavailable_reason"].to_list()) == {
            "partial sums (DTensor placement Partial(sum)): not the layer's output"
        }
        warned = [w for w in report["warnings"] if "tensor parallel: layers returned DTensors" in w]
        assert len(warned) == 1
        assert (
            "Plain tensors between tensor-parallel layers are this rank's local parts" in warned[0]
        )
        page = (directory / "index.md").read_text(encoding="utf-8")
        assert "Plain tensors between tensor-parallel layers are this rank's local parts" in page
        result = json.loads((directory / "result.json").read_text())
        fc1_entry = next(layer for layer in result if layer["layer"] == "fc1")["tensors"][0]
        assert (fc1_entry["placement"], fc1_entry["mesh_coordinate"]) == ("Shard(1)", [rank])
