"""global_statistics= when a rank's sampled forward raises (the user's exception propagates),
on 2 and 4 real gloo processes: no rank waits, and only what the ranks could not agree on is
null.

The model is Linear "0", a layer "1" that raises on the last rank in the second sample, and
Linear "2". In that sample every rank ran "0" before the raise: its global rows are measured,
equal to NumPy's statistics of every rank's output as plain forward hooks saw it. "1" and "2"
did not run on the raising rank: null on the others, with a reason naming the rank that raised.
The raising rank's sample is marked interrupted; every other sample is measured on every rank.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import polars as pl
import pytest
import torch
import torch.distributed as dist
from test_global_statistics import METRICS, Raises, check
from torch import nn

from _ranks import joined, run_groups


def raising_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """Three samples, each rank its own inputs; the last rank raises in the second."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with joined(rank, world_size, port):
        torch.manual_seed(0)  # the same weights on every rank
        raiser = Raises()
        model = nn.Sequential(nn.Linear(4, 4), raiser, nn.Linear(4, 4))
        seen: dict[str, list[float]] = {}
        model[0].register_forward_hook(
            lambda m, a, out: seen.__setitem__(str(len(seen)), out.detach().reshape(-1).tolist())
        )
        inject_observer(
            model,
            output_dir=output_dir,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
        )
        torch.manual_seed(10 + rank)
        for step in range(3):
            raiser.when = step if (step == 1 and rank == world_size - 1) else None
            with contextlib.suppress(RuntimeError):
                model(torch.randn(2, 4))
        remove_observer(model)
        Path(output_dir, f"seen-{rank}.json").write_text(json.dumps(seen))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One spawn of 4 processes for both world sizes: `raising_worker` on all 4 into `root/4`,
    then on the first 2 into `root/2` (a spawned rank imports torch: seconds per process)."""
    root = tmp_path_factory.mktemp("raised")
    for world_size in (2, 4):
        (root / str(world_size)).mkdir()
    run_groups(
        [
            (raising_worker, (str(root / "4"),), range(4)),
            (raising_worker, (str(root / "2"),), range(2)),
        ],
        processes=4,
    )
    return root


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_raise_on_one_rank_nulls_only_the_tensors_it_did_not_run(
    runs: Path, world_size: int
) -> None:
    tmp_path = runs / str(world_size)
    seen = [json.loads((tmp_path / f"seen-{r}.json").read_text()) for r in range(world_size)]
    raiser = world_size - 1
    ranks = ", ".join(map(str, range(world_size)))
    others = ", ".join(map(str, range(raiser)))
    for rank in range(world_size):
        history = pl.read_parquet(tmp_path / f"rank-{rank:03d}" / "history.parquet")
        output = history.filter(pl.col("signal") == "output", pl.col("metric") != "interrupted")
        assert output["population"].unique().to_list() == [f"global:ranks={ranks}".replace(" ", "")]
        for sample_id in range(3):
            rows = output.filter(pl.col("layer") == "0", pl.col("sample_id") == sample_id)
            got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
            whole = [x for part in seen for x in part[str(sample_id)]]
            check(got, torch.tensor(whole).numpy())
        after = output.filter(pl.col("layer") != "0", pl.col("sample_id") == 1)
        if rank == raiser:  # it raised in "1": it ran neither "1" nor "2", so no rows of them
            assert after.height == 0
        else:
            assert sorted(after["layer"].unique().to_list()) == ["1", "2"]
            assert after.height == 2 * len(METRICS)
            assert after["value"].null_count() == after.height
            assert (
                after["unavailable_reason"]
                .str.starts_with(
                    f"the root forward raised on rank {raiser}, which did not run this tensor (it "
                    f"ran on rank {others} of {ranks})"
                )
                .all()
            )
        measured = output.filter(pl.col("sample_id") != 1)
        assert measured.height == 3 * 2 * len(METRICS)
        assert measured["value"].null_count() == 0
        marked = history.filter(pl.col("metric") == "interrupted")["sample_id"].to_list()
        assert marked == ([1] if rank == raiser else [])
