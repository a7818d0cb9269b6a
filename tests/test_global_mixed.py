"""global_statistics where the ranks' tensors of one layer differ in dtype or in size, on 2 real
gloo processes, data parallel with the world group named.

A layer whose output is float32 on one rank and bfloat16 on the other (autocast on some ranks
only) is one tensor: its global rows are the statistics of the union of both ranks' values
(each as its rank computed it), and each rank's `dtype` column says its own dtype. A rank whose
batch is empty contributes no entries and the other rank's values are the whole; a sample
empty on every rank has null rows with the reason. The reference is NumPy over the values
plain forward hooks saw on each rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import torch
import torch.distributed as dist
from test_global_statistics import METRICS, check
from torch import nn

from torchinstruments import reasons

from _ranks import joined, run_ranks

BATCHES = {0: [2, 0, 0], 1: [3, 3, 0]}  # per rank, per sample: rank 0 empty, then both empty


class Cast(nn.Module):
    """Its input in `dtype` (bfloat16 on rank 1: a rank computing in lower precision)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) * 3


def worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with joined(rank, world_size, port):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), Cast(torch.bfloat16 if rank else torch.float32))
        seen: dict[str, list[list[float]]] = {"0": [], "1": []}
        for name, layer in model.named_children():
            layer.register_forward_hook(
                lambda m, a, out, name=name: seen[name].append(
                    out.detach().double().reshape(-1).tolist()
                )
            )
        inject_observer(
            model,
            output_dir=output_dir,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
        )
        torch.manual_seed(10 + rank)
        for batch in BATCHES[rank]:
            model(torch.randn(batch, 4))
        remove_observer(model)
        every: list[object] = [None] * world_size
        dist.all_gather_object(every, seen)
        if rank == 0:
            Path(output_dir, "seen.json").write_text(json.dumps(every))


def test_ranks_whose_tensor_differs_in_dtype_or_is_empty_measure_the_union(
    tmp_path: Path,
) -> None:
    run_ranks(worker, str(tmp_path))
    seen = json.loads((tmp_path / "seen.json").read_text())
    for rank in range(2):
        history = pl.read_parquet(tmp_path / f"rank-{rank:03d}" / "history.parquet").filter(
            signal="output"
        )
        assert sorted(history["sample_id"].unique().to_list()) == [0, 1, 2]
        assert history["population"].unique().to_list() == ["global:ranks=0,1"]
        assert history.filter(layer="1")["dtype"].unique().to_list() == [
            "bfloat16" if rank else "float32"
        ]
        for layer in ("0", "1"):
            for sample_id in (0, 1):
                rows = history.filter(layer=layer, sample_id=sample_id)
                got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
                assert set(got) == set(METRICS)
                union = [v for part in seen for v in part[layer][sample_id]]
                check(got, np.array(union, dtype=np.float64))
            empty = history.filter(layer=layer, sample_id=2)
            assert empty.height == len(METRICS)
            assert empty["value"].null_count() == empty.height
            assert empty["unavailable_reason"].unique().to_list() == [reasons.EMPTY_GLOBAL]
