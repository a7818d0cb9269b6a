"""global_statistics=: exact statistics of the whole tensor over ranks, on real gloo processes.

One worker per rank runs every case (2 and 4 ranks on 127.0.0.1):

- tensor parallel, both `use_local_output` settings (model A: Colwise(False) + Rowwise(True),
  model B: Colwise(True) + Rowwise(False)): fc1's Shard(-1) output and fc2's Partial output get
  global rows equal to NumPy's statistics of the whole tensor (gathered by the test itself after
  removal, through plain forward hooks);
- data parallel, `global_statistics=<the world group>`: every layer's rows are those of the
  global batch (every rank's outputs concatenated); on 4 ranks, data parallel in halves, each
  rank naming its own group ({0, 1} or {2, 3}): its half's batch (every rank creates the
  library's group of each half, in one order);
- the collectives the library adds per sample, counted by wrapping torch.distributed's
  functions: the same with 3 layers and with 30, and none without the option;
- a rank whose forward raises mid-sample: `test_global_raised.py`;
- ranks whose samples are different root forwards (one ran an extra evaluation batch): null
  with a reason, never one value from two steps; a step set on rank 0 alone is no difference;
- tensor parallel over a 2-D mesh's "tp" submesh: each group measures its own whole tensor;
- a trainer callback's record_eval sampler that could disagree across ranks is refused.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _ranks import join, joined, run_groups

METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.when: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.when is not None:
            raise RuntimeError("raised mid-forward")
        return x * 2


def chain(layers: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))


class Counting:
    """Counts calls of torch.distributed's collectives (the library calls them by name)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")

    def __init__(self) -> None:
        self.calls = 0
        self.saved = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self) -> Counting:
        for name, fn in self.saved.items():

            def counted(*args: object, _fn: object = fn, **kwargs: object) -> object:
                self.calls += 1
                return _fn(*args, **kwargs)  # type: ignore[operator]

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def whole(t: torch.Tensor, dim: int) -> np.ndarray:
    """The whole tensor a rank's part stands for, gathered by the test (DTensor or local part)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor().detach().numpy()
    parts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t.detach().numpy())  # parts may differ in size (uneven batches)
    return np.concatenate(parts, axis=dim)  # type: ignore[arg-type]


def outputs(model: nn.Module, x: torch.Tensor, names: dict[str, int]) -> dict[str, np.ndarray]:
    """Each named layer's output as plain forward hooks see it, gathered along `names[layer]`
    (-1: already whole, the replicated output of a row-parallel layer)."""
    seen: dict[str, torch.Tensor] = {}
    handles = [
        getattr(model, n).register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out))
        for n in names
    ]
    model(x)
    for h in handles:
        h.remove()
    out = {}
    for name, dim in names.items():
        t = seen[name]
        if dim == -2:  # whole already (Replicate DTensor or its local tensor)
            t = t.to_local() if hasattr(t, "to_local") else t
            out[name] = t.detach().numpy()
        else:
            out[name] = whole(t, dim)
    return out


def worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    report: dict[str, object] = {}
    with joined(rank, world_size, port):
        mesh = init_device_mesh("cpu", (world_size,))
        every = EveryNForwardsSampler(1)
        torch.manual_seed(0)
        x = torch.randn(5, 4)  # the same on every rank (tensor parallel)
        for name, colwise, rowwise in (("a", False, True), ("b", True, False)):
            torch.manual_seed(1)
            model = TwoLayers()
            plan: dict[str, ParallelStyle] = {
                "fc1": ColwiseParallel(use_local_output=colwise),
                "fc2": RowwiseParallel(use_local_output=rowwise),
            }
            parallelize_module(model, mesh, plan)
            out = str(Path(output_dir) / f"tp-{name}")
            inject_observer(
                model, output_dir=out, sampler=every, rank_policy="all", global_statistics=True
            )
            model(x).sum().backward()
            remove_observer(model)
            report[f"tp-{name}"] = {
                k: v.tolist() for k, v in outputs(model, x, {"fc1": -1, "fc2": -2}).items()
            }
        # data parallel: each rank its own batch, the world group named
        counts = {}
        for layers in (3, 30):
            torch.manual_seed(2)
            model = chain(layers)
            out = str(Path(output_dir) / f"dp-{layers}")
            inject_observer(
                model,
                output_dir=out,
                sampler=every,
                rank_policy="all",
                global_statistics=dist.group.WORLD,
            )
            torch.manual_seed(10 + rank)
            xs = torch.randn(3 + rank, 4)  # uneven batches
            with Counting() as counting:
                model(xs)
            counts[layers] = counting.calls
            remove_observer(model)
            if layers == 3:
                names = {str(i): 0 for i in range(layers)}
                report["dp"] = {k: v.tolist() for k, v in outputs(model, xs, names).items()}
        if world_size == 4:  # data parallel in halves, {0, 1} and {2, 3}: each rank names its own
            halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            torch.manual_seed(2)
            model = chain(1)
            inject_observer(
                model,
                output_dir=str(Path(output_dir) / "halves"),
                sampler=every,
                rank_policy="all",
                global_statistics=halves[rank // 2],
            )
            torch.manual_seed(10 + rank)
            xs = torch.randn(3 + rank, 4)
            model(xs)
            remove_observer(model)
            local = outputs(model, xs, {"0": -2})["0"].tolist()
            Path(output_dir, f"halves-{rank}.json").write_text(json.dumps(local))
        torch.manual_seed(2)
        model = chain(3)
        inject_observer(
            model, output_dir=str(Path(output_dir) / "off"), sampler=every, rank_policy="all"
        )
        with Counting() as counting:
            model(torch.randn(2, 4)).sum().backward()
        remove_observer(model)
        report["collectives"] = {"3": counts[3], "30": counts[30], "off": counting.calls}
        if rank == 0:
            Path(output_dir, "report.json").write_text(json.dumps(report))


def reference(values: np.ndarray) -> dict[str, float]:
    v = values.astype(np.float64).ravel()
    return {
        "mean": v.mean(),
        "std": v.std(),
        "min": v.min(),
        "max": v.max(),
        "p25": np.percentile(v, 25),
        "p50": np.percentile(v, 50),
        "p75": np.percentile(v, 75),
        "zero_fraction": float((v == 0).mean()),
        "nonfinite_fraction": 0.0,
    }


def global_rows(directory: Path, layer: str) -> dict[str, float]:
    rows = pl.read_parquet(directory / "history.parquet").filter(
        pl.col("layer") == layer, pl.col("signal") == "output"
    )
    assert rows["population"].unique().to_list() == [
        "global:ranks=" + ",".join(map(str, range(len(list(directory.parent.glob("rank-*"))))))
    ]
    return dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))


def check(got: dict[str, float], values: np.ndarray, rel: float = 1e-12) -> None:
    want = reference(values)
    for metric in METRICS:
        if metric in ("mean", "std"):
            assert got[metric] == pytest.approx(want[metric], rel=max(rel, 1e-9), abs=1e-12), metric
        else:
            assert got[metric] == pytest.approx(want[metric], rel=rel, abs=0), metric


@pytest.mark.parametrize("world_size", [2, 4])
def test_global_rows_equal_the_gathered_tensor(ranks: Path, world_size: int) -> None:
    tmp_path = ranks / f"gathered-{world_size}"
    report = json.loads((tmp_path / "report.json").read_text())
    for rank in range(world_size):
        for name in ("a", "b"):
            directory = tmp_path / f"tp-{name}" / f"rank-{rank:03d}"
            tensors = report[f"tp-{name}"]
            check(global_rows(directory, "fc1"), np.array(tensors["fc1"], dtype=np.float32))
            # Partial: the sums in float64 rounded to float32 once, the model's all-reduce in
            # float32: equal up to float32 rounding
            check(global_rows(directory, "fc2"), np.array(tensors["fc2"], dtype=np.float32), 1e-6)
            if name == "a":  # fc1 hands on a DTensor: the ReLU's output is one too, Shard(-1)
                fc1 = np.array(tensors["fc1"], dtype=np.float32)
                check(global_rows(directory, "relu"), np.maximum(fc1, 0))
            else:  # fc1 hands on its local shard: the ReLU's output is this rank's tensor
                relu = pl.read_parquet(directory / "history.parquet").filter(
                    pl.col("layer") == "relu", pl.col("signal") == "output"
                )
                assert relu["population"].null_count() == relu.height
        directory = tmp_path / "dp-3" / f"rank-{rank:03d}"
        for layer, values in report["dp"].items():
            check(global_rows(directory, layer), np.array(values, dtype=np.float32))
    counts = report["collectives"]
    assert counts["3"] == counts["30"] > 0
    assert counts["off"] == 0
    if world_size == 4:  # each rank named its own half: its rows are its half's whole batch
        for rank in range(world_size):
            half = [2 * (rank // 2), 2 * (rank // 2) + 1]
            seen = [json.loads((tmp_path / f"halves-{r}.json").read_text()) for r in half]
            rows = pl.read_parquet(tmp_path / "halves" / f"rank-{rank:03d}" / "history.parquet")
            rows = rows.filter(pl.col("signal") == "output")
            assert rows["population"].unique().to_list() == [f"global:ranks={half[0]},{half[1]}"]
            got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
            check(got, np.concatenate([np.array(v, dtype=np.float32) for v in seen]))


def test_refused_at_inject_without_a_rank_consistent_sampler() -> None:
    from torchinstruments import inject_observer

    with pytest.raises(ValueError, match="initialized process group"):
        inject_observer(nn.Linear(2, 2), output_dir="unused", global_statistics=True)
    with pytest.raises(TypeError, match="global_statistics must be"):
        inject_observer(nn.Linear(2, 2), output_dir="unused", global_statistics="yes")
    # a rank outside the group it names: `dist.new_group` gave it torch's non-member value
    with pytest.raises(ValueError, match="this rank is not a member of the process group"):
        inject_observer(
            nn.Linear(2, 2),
            output_dir="unused",
            global_statistics=dist.GroupMember.NON_GROUP_MEMBER,
        )


def test_refused_at_inject_with_a_sampler_that_could_disagree_or_one_rank_observing(
    tmp_path: Path,
) -> None:
    """With a process group (one gloo rank here), the default clock sampler and rank_policy
    'rank0' are refused at inject, naming the fix; nothing is written and the model is not
    touched."""
    from torchinstruments import EveryNForwardsSampler, has_observer, inject_observer

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = nn.Linear(2, 2)
        run = tmp_path / "run"
        with pytest.raises(ValueError, match=r"refuses sampler=.*EveryNForwardsSampler\(n\)"):
            inject_observer(model, output_dir=run, global_statistics=True, rank_policy="all")

        class Clock:
            def should_sample(self, forward_index: int) -> bool:
                return forward_index == 0

        with pytest.raises(ValueError, match="same_on_every_rank = True"):
            inject_observer(
                model, output_dir=run, global_statistics=True, rank_policy="all", sampler=Clock()
            )
        with pytest.raises(ValueError, match="rank_policy='all'"):
            inject_observer(
                model, output_dir=run, global_statistics=True, sampler=EveryNForwardsSampler(2)
            )
        assert not has_observer(model)
        assert "forward" not in vars(model)
        assert not run.exists()
    finally:
        dist.destroy_process_group()


def uneven_forwards_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """Rank 1 runs one evaluation batch rank 0 does not: from there on the two ranks' k-th
    samples are different root forwards (rank 0's train step k against rank 1's evaluation
    batch, then against its step k - 1)."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer, set_step

    with joined(rank, world_size, port):
        torch.manual_seed(0)
        model = chain(2)
        inject_observer(
            model,
            output_dir=output_dir,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
        )
        # four root forwards each; None: an evaluation batch (rank 1 only)
        steps: list[int | None] = [0, None, 1, 2] if rank == 1 else [0, 1, 2, 3]
        for step in steps:
            if step is None:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(2, 4))
                model.train()
                continue
            set_step(model, step)
            model(torch.randn(2, 4)).sum().backward()
        remove_observer(model)
        # the same root forwards, the step set on rank 0 only (a loop that logs there): measured
        inject_observer(
            model,
            output_dir=Path(output_dir, "steps-on-rank-0"),
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
        )
        for step in range(2):
            if rank == 0:
                set_step(model, step)
            model(torch.randn(2, 4)).sum().backward()
        remove_observer(model)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One spawn of 4 processes for every scenario of the file, each in a group of its own (a
    spawned rank imports torch: seconds per process): `worker` on all 4 into
    `root/gathered-4`; then, two pairs side by side, `uneven_forwards_worker` into
    `root/uneven`, `tensor_parallel_in_data_parallel_worker` into `root/mesh` and last
    `rank_leaves_early_worker` into `root/left` (its rank 1's process ends there) on the first
    two, `worker` into `root/gathered-2` on the other two (about as long)."""
    root = tmp_path_factory.mktemp("ranks")
    for name in ("gathered-4", "uneven", "mesh", "gathered-2", "left"):
        (root / name).mkdir()
    run_groups(
        [
            (worker, (str(root / "gathered-4"),), range(4)),
            (uneven_forwards_worker, (str(root / "uneven"),), (0, 1)),
            (tensor_parallel_in_data_parallel_worker, (str(root / "mesh"),), (0, 1)),
            (rank_leaves_early_worker, (str(root / "left"),), (0, 1)),
            (worker, (str(root / "gathered-2"),), (2, 3)),
        ],
        processes=4,
        # 4 gloo ranks on CI's 2 cores run several models each: more than 120 s per rank
        timeout_s=420,
    )
    return root


def test_ranks_at_different_root_forwards_get_no_global_rows_of_each_others_tensors(
    ranks: Path,
) -> None:
    """A global row stands for one root forward on every rank: where the ranks' samples differ
    (a step or a mode apart), every rank skips the sample (null with a reason), never a value
    combined from rank 0's train step and rank 1's evaluation batch or earlier step."""
    tmp_path = ranks / "uneven"
    rows = {
        rank: pl.read_parquet(tmp_path / f"rank-{rank:03d}" / "history.parquet").filter(
            pl.col("layer") == "0", pl.col("signal") == "output", pl.col("metric") == "mean"
        )
        for rank in range(2)
    }
    for rank in range(2):
        assert rows[rank]["population"].unique().to_list() == ["global:ranks=0,1"]
        by_sample = {r["sample_id"]: r for r in rows[rank].iter_rows(named=True)}
        assert by_sample[0]["value"] is not None  # the same root forward on both ranks
        for sample_id in (1, 2, 3):
            assert by_sample[sample_id]["value"] is None, (rank, sample_id)
            assert "different root forwards" in by_sample[sample_id]["unavailable_reason"]
        steps_on_rank_0 = pl.read_parquet(
            tmp_path / "steps-on-rank-0" / f"rank-{rank:03d}" / "history.parquet"
        )
        assert steps_on_rank_0["value"].null_count() == 0  # a step on one rank only: same forward


def rank_leaves_early_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """Uneven data without a join: rank 1 runs out of batches after two samples and its
    process ends; rank 0 trains on alone (its loop needs no collective of its own)."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    join(rank, world_size, port)
    torch.manual_seed(rank)
    model = chain(2)
    inject_observer(
        model,
        output_dir=output_dir,
        sampler=EveryNForwardsSampler(1),
        rank_policy="all",
        global_statistics=dist.group.WORLD,
    )
    with pytest.warns(RuntimeWarning) if rank == 0 else contextlib.nullcontext():
        for _ in range(4 if rank == 0 else 2):
            model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    if rank == 1:
        dist.destroy_process_group()  # rank 0's group is broken now: it has nothing to destroy


def test_a_rank_that_left_leaves_the_others_global_rows_null_with_the_reason(
    ranks: Path,
) -> None:
    """Once a rank of the group has gone, the next sample's collective fails on the ranks left
    and global statistics stop there: each claimed tensor still has its rows in that sample and
    every later one, null with the error as reason (its local rows are not written, so no row
    at all would be silent), and the step goes on."""
    tmp_path = ranks / "left"
    history = pl.read_parquet(tmp_path / "rank-000" / "history.parquet").filter(
        pl.col("signal") == "output"
    )
    per_sample = (
        history.group_by("sample_id").agg(pl.col("layer").unique().sort()).sort("sample_id")
    )
    assert per_sample.rows() == [(s, ["0", "1"]) for s in range(4)]
    assert history["population"].unique().to_list() == ["global:ranks=0,1"]
    measured = history.filter(pl.col("sample_id") < 2)
    assert measured["value"].null_count() == 0
    left = history.filter(pl.col("sample_id") >= 2)
    assert left.height == 2 * 2 * len(METRICS)
    assert left["value"].null_count() == left.height
    assert (
        left["unavailable_reason"]
        .str.starts_with("global statistics stopped at sample 2, for the rest of the run: ")
        .all()
    )
    index = (tmp_path / "rank-000" / "index.md").read_text("utf-8")
    assert "global statistics of a sample failed" in index


def tensor_parallel_in_data_parallel_worker(
    rank: int, world_size: int, port: int, output_dir: str
) -> None:
    """A data parallel x tensor parallel mesh, the model parallelized over its "tp" submesh:
    each tensor-parallel group measures its own whole tensor over its own ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with joined(rank, world_size, port):
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(1)
        model = TwoLayers()
        plan: dict[str, ParallelStyle] = {
            "fc1": ColwiseParallel(use_local_output=False),
            "fc2": RowwiseParallel(),
        }
        parallelize_module(model, mesh["tp"], plan)
        inject_observer(
            model,
            output_dir=output_dir,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=True,
        )
        torch.manual_seed(10 + rank)  # one batch per tensor-parallel group
        x = torch.randn(5, 4)
        model(x).sum().backward()
        remove_observer(model)
        whole = outputs(model, x, {"fc1": -1})["fc1"]
        Path(output_dir, f"fc1-{rank}.json").write_text(json.dumps(whole.tolist()))


def test_each_tensor_parallel_group_of_a_2d_mesh_measures_its_own_whole_tensor(
    ranks: Path,
) -> None:
    """Tensor parallel inside data parallel (a 2 x 1 mesh: two tensor-parallel groups, {0} and
    {1}, with a batch each; a 2 x 2 mesh's {0, 1} and {2, 3} alike). Every rank's sample holds
    the same layers over groups of the same size, so the sample is measured: each group's rows
    are its whole fc1 output, not nulls as if the ranks disagreed."""
    tmp_path = ranks / "mesh"
    for rank in range(2):
        rows = pl.read_parquet(tmp_path / f"rank-{rank:03d}" / "history.parquet").filter(
            pl.col("layer") == "fc1", pl.col("signal") == "output"
        )
        assert rows["population"].unique().to_list() == [f"global:ranks={rank}"]
        got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
        whole = json.loads((tmp_path / f"fc1-{rank}.json").read_text())
        check(got, np.array(whole, dtype=np.float32))


def test_a_trainer_callbacks_evaluation_sampler_that_could_disagree_is_refused(
    tmp_path: Path,
) -> None:
    """record_eval=<Sampler> samples evaluation forwards on a schedule of its own: with
    global_statistics it must decide alike on every rank too (a clock-based one is refused
    when the callback is built, naming record_eval), or one rank's evaluation sample would
    wait in a collective the others never join."""
    from torchinstruments import EveryNForwardsSampler, TimeIntervalSampler
    from torchinstruments.integrations.huggingface import HuggingFaceObserver
    from torchinstruments.integrations.lightning import LightningObserver

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        options = {
            "sampler": EveryNForwardsSampler(1),
            "rank_policy": "all",
            "global_statistics": True,
        }
        for callback in (LightningObserver, HuggingFaceObserver):
            with pytest.raises(ValueError, match=r"refuses record_eval=.*TimeIntervalSampler"):
                callback(tmp_path / "run", record_eval=TimeIntervalSampler(), **options)
            callback(tmp_path / "run", record_eval=EveryNForwardsSampler(2), **options)
            callback(tmp_path / "run", record_eval=True, **options)  # a copy of the sampler
    finally:
        dist.destroy_process_group()
