"""global_statistics= where the ranks run different layers in one sample (a Mixture of Experts
whose experts are not all routed to on every rank), on 2 real gloo processes.

Only the tensors some rank did not produce are null, with a reason naming the ranks that ran
them; every layer all ranks ran keeps its global rows, equal to NumPy's statistics of the
concatenation of both ranks' outputs (recorded by plain forward hooks on each rank). Experts
run in a different order on each rank are still one tensor each. Ranks that ran different
layers take exactly one collective more than ranks that ran the same ones. An expert frozen
in eval mode that one rank alone runs is that one missing tensor, never ranks apart (the kind
of forward the ranks compare is the root's call, a training forward on both).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import torch
import torch.distributed as dist
from test_global_statistics import METRICS, Counting, check
from torch import nn

from _ranks import joined, run_ranks

# Each step's experts by rank: expert 1 on rank 0 only; one expert each; both everywhere;
# both everywhere, in another order on each rank.
ROUTES = {
    0: [[0, 1], [0], [0, 1], [1, 0]],
    1: [[0], [1], [0, 1], [0, 1]],
}


class Routed(nn.Module):
    """A shared layer, the experts the step's route picks, another shared layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.experts = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.out = nn.Linear(6, 3)
        self.route: list[int] = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        mixed = torch.zeros_like(h)
        for expert in self.route:
            mixed = mixed + self.experts[expert](h)
        return self.out(mixed)


def routed_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """Each rank its own batch and routes; every layer's local outputs saved per step."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with joined(rank, world_size, port):
        torch.manual_seed(0)  # the same weights on both ranks
        model = Routed()
        # a frozen expert (eval mode) in a training forward: the forward is still a training
        # one on every rank, so where one rank alone runs it only its tensor is null
        model.experts[1].eval()
        seen: dict[str, list[object]] = {}
        step = [0]
        for name, module in model.named_modules():
            if name:
                module.register_forward_hook(
                    lambda m, a, out, n=name: seen.__setitem__(
                        f"{step[0]}/{n}", out.detach().tolist()
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
        collectives: list[object] = []
        for step[0], route in enumerate(ROUTES[rank]):
            model.route = route
            with Counting() as counting:
                model(torch.randn(3 + rank, 4)).sum().backward()  # uneven batches
            collectives.append(counting.calls)
        remove_observer(model)
        seen["collectives"] = collectives
        Path(output_dir, f"outputs-{rank}.json").write_text(json.dumps(seen))


def test_only_layers_not_run_on_every_rank_lose_their_global_rows(tmp_path: Path) -> None:
    run_ranks(routed_worker, str(tmp_path))
    saved = [json.loads((tmp_path / f"outputs-{rank}.json").read_text()) for rank in range(2)]
    for rank in range(2):
        # One more collective (the tensors' hashes) where the ranks ran different sets of
        # layers (steps 0 and 1), none where they ran the same, in whatever order (steps 2, 3)
        collectives = saved[rank].pop("collectives")
        assert [calls - collectives[2] for calls in collectives] == [1, 1, 0, 0]
    outputs = [
        {key: np.array(values, dtype=np.float32) for key, values in ranks.items()}
        for ranks in saved
    ]
    for rank in range(2):
        rows = pl.read_parquet(tmp_path / f"rank-{rank:03d}" / "history.parquet").filter(
            pl.col("signal") == "output"
        )
        assert rows["population"].unique().to_list() == ["global:ranks=0,1"]
        measured = nulled = 0
        for step, route in enumerate(ROUTES[rank]):
            ran = ["inp", *(f"experts.{e}" for e in route), "out"]
            sample = rows.filter(pl.col("sample_id") == step)
            assert sorted(sample["layer"].unique().to_list()) == sorted(ran)
            for layer in ran:
                layer_rows = sample.filter(pl.col("layer") == layer)
                other = outputs[1 - rank].get(f"{step}/{layer}")
                if other is None:  # this rank alone ran it: null, the reason names the rank
                    assert layer_rows["value"].null_count() == len(METRICS), (rank, step, layer)
                    for reason in layer_rows["unavailable_reason"].to_list():
                        assert reason.startswith(
                            f"not run on every rank of its group (ran on rank {rank} of 0, 1)"
                        ), reason
                    nulled += 1
                    continue
                values = np.concatenate([outputs[r][f"{step}/{layer}"] for r in range(2)])
                got = dict(zip(layer_rows["metric"], layer_rows["value"], strict=True))
                check(got, values)
                measured += 1
        # rank 0: expert 1 at step 0 and expert 0 at step 1; rank 1: expert 1 at step 1
        assert nulled == (2 if rank == 0 else 1)
        # inp and out in each of 4 steps; experts: 0 at step 0, both at steps 2 and 3
        assert measured == 4 * 2 + 1 + 2 + 2
