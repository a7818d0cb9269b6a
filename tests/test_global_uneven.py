"""global_statistics= when the ranks' data is uneven, on 2 real gloo processes: a rank takes a
sample while the other has left the loop and waits in the user's own collectives.

The library's collectives run on process groups of its own, so they never pair with the
user's: the user's all-reduce and barrier on the default group give the right values on every
rank, and no rank waits longer than the library's wait (`global_statistics_timeout`, shortened
here from its 60 s default).
The sample no other rank took, and every later one, has its global rows null with the reason
on the rank that took it, warned and said in index.md; the samples every rank took keep their
values. The ranks never pair again after the stop: a later sample on both ranks waits at most
once more, on the rank that had not stopped, and gives null rows with the reason on both.
Under DDP's join context, the parameters trained with the observer are those trained without.
With `global_statistics=True` on a model that holds no DTensor, no sample takes a collective: a
forward rank 0 runs alone (a validation batch under DDP) waits for no one, and a DTensor a
forward returns anyway keeps its local rows.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
import torch.distributed as dist
from test_global_statistics import METRICS, chain, check

from _ranks import join, run_ranks_in_sequence

# The library's wait: three of them run out in full here (rank 0's extra sample under DDP's
# join, then each rank's unpaired sample of `uneven_worker`), while the samples both ranks take
# pair within it, the ranks in step.
LIBRARY_WAIT = datetime.timedelta(seconds=2)
# The user's own groups' timeout: longer than the library's wait (a 30-minute default in gloo).
USER_TIMEOUT = datetime.timedelta(seconds=90)


def user_all_reduce(rank: int) -> list[float]:
    """The user's own collective on the default group: each rank adds rank + 1."""
    values = torch.full((5,), float(rank + 1))
    dist.all_reduce(values)
    return values.tolist()


def uneven_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """Rank 0 has three batches, rank 1 two; then both meet in the user's all-reduce and barrier,
    run one more sampled forward each, and meet again."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    join(rank, world_size, port, USER_TIMEOUT)
    torch.manual_seed(0)
    model = chain(2)
    seen: dict[int, list[float]] = {}
    model[0].register_forward_hook(
        lambda m, a, out: seen.__setitem__(len(seen), out.detach().reshape(-1).tolist())
    )
    inject_observer(
        model,
        output_dir=output_dir,
        sampler=EveryNForwardsSampler(1),
        rank_policy="all",
        global_statistics=dist.group.WORLD,
        global_statistics_timeout=LIBRARY_WAIT,
    )
    report: dict[str, object] = {}
    try:
        torch.manual_seed(10 + rank)
        for _ in range(3 if rank == 0 else 2):
            model(torch.randn(2, 4)).sum().backward()
        report["first"] = user_all_reduce(rank)
        dist.barrier()
        model(torch.randn(2, 4)).sum().backward()
        report["second"] = user_all_reduce(rank)
    except Exception as error:  # the user's collective failed: the test says so
        report["error"] = repr(error)
    remove_observer(model)
    report["seen"] = seen
    Path(output_dir, f"report-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


class FromLocal(torch.nn.Module):
    """A layer that returns a DTensor built in its forward, over a mesh it holds (no DTensor
    parameter or buffer)."""

    def __init__(self, mesh: object) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(x * 1.0, self.mesh, [Shard(0)])  # type: ignore[arg-type]


def without_dtensor_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """global_statistics=True on models without a DTensor at inject: DDP where rank 0 runs a
    no_grad forward alone after its first step (into `ddp`; the same with the world group named,
    into `named`), then a layer returning
    `DTensor.from_local` of each rank's own values (into `from-local`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    join(rank, world_size, port, USER_TIMEOUT)
    options: dict[str, Any] = {
        "sampler": EveryNForwardsSampler(1),
        "rank_policy": "all",
        "global_statistics": True,
        "global_statistics_timeout": LIBRARY_WAIT,
    }
    for name, option in (("ddp", True), ("named", dist.group.WORLD)):
        torch.manual_seed(0)
        model = DistributedDataParallel(chain(2))
        options["global_statistics"] = option
        inject_observer(model, output_dir=Path(output_dir, name), **options)
        for step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            # the validation batch rank 1 never runs; named: after DDP's second step, whose
            # forward broadcasts its buckets' order (a collective of its own on rank 1)
            if step == (0 if name == "ddp" else 1) and rank == 0:
                with torch.no_grad():
                    model(torch.randn(2, 4))
        remove_observer(model)
    options["global_statistics"] = True
    sharded = torch.nn.Sequential(FromLocal(init_device_mesh("cpu", (world_size,))))
    inject_observer(sharded, output_dir=Path(output_dir, "from-local"), **options)
    sharded(torch.full((2, 3), float(rank + 1)))
    remove_observer(sharded)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One pair of ranks for the file's two scenarios, one after the other, each in a group of
    its own (a pair of spawned ranks takes seconds): `join_worker` into `root/join`, then
    `uneven_worker` into `root/uneven`, then `without_dtensor_worker` into `root/alone`."""
    root = tmp_path_factory.mktemp("pair")
    for name in ("join", "uneven", "alone"):
        (root / name).mkdir()
    run_ranks_in_sequence(
        [
            (join_worker, (str(root / "join"),)),
            (uneven_worker, (str(root / "uneven"),)),
            (without_dtensor_worker, (str(root / "alone"),)),
        ]
    )
    return root


def layer_rows(directory: Path, layer: str = "0") -> pl.DataFrame:
    return pl.read_parquet(directory / "history.parquet").filter(
        pl.col("signal") == "output", pl.col("layer") == layer
    )


def test_a_sample_only_one_rank_takes_never_pairs_with_the_users_collectives(
    pair: Path,
) -> None:
    tmp_path = pair / "uneven"
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert "error" not in report
        assert report["first"] == [3.0] * 5
        assert report["second"] == [3.0] * 5
    for rank, taken, stopped_at in ((0, 4, 2), (1, 3, 2)):
        directory = tmp_path / f"rank-{rank:03d}"
        rows = layer_rows(directory)
        assert sorted(rows["sample_id"].unique().to_list()) == list(range(taken))
        assert rows["population"].unique().to_list() == ["global:ranks=0,1"]
        stopped = rows.filter(pl.col("sample_id") >= stopped_at)
        assert stopped.height == (taken - stopped_at) * len(METRICS)
        assert stopped["value"].null_count() == stopped.height
        # the reason names the sample and root forward the ranks parted at, and why they part
        apart = (
            f"global statistics stopped at sample {stopped_at}, for the rest of the run: "
            "RanksApartError: no other rank came within 2 s (global_statistics_timeout) to the "
            f"agreement on this rank's sample {stopped_at} (forward_index {stopped_at}), or a "
            "rank left it: a sampled forward ran on some ranks only (an evaluation or "
            "validation batch one rank ran alone: "
        )
        assert stopped["unavailable_reason"].str.starts_with(apart).all()
        index = (directory / "index.md").read_text("utf-8")
        assert f"they stopped (from sample {stopped_at} on" in index  # the warning, kept
        assert f"this rank's sample {stopped_at} (forward_index {stopped_at}), or a" in index
        assert "longer than 2 s (global_statistics_timeout)" in index
    # the samples both ranks took: the whole tensor over both ranks, as plain hooks saw it
    for sample_id in (0, 1):
        whole = [x for report in reports for x in report["seen"][str(sample_id)]]
        for rank in range(2):
            rows = layer_rows(tmp_path / f"rank-{rank:03d}").filter(
                pl.col("sample_id") == sample_id
            )
            got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
            check(got, torch.tensor(whole).numpy())


def train_with_join(rank: int, output_dir: str | None) -> list[list[float]]:
    """DDP under its join context, rank 0 with three batches and rank 1 with two, observed
    into `output_dir` (None: not observed); the parameters after training."""
    from torch.nn.parallel import DistributedDataParallel

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    torch.manual_seed(0)
    model = DistributedDataParallel(chain(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if output_dir is not None:
        inject_observer(
            model,
            output_dir=output_dir,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
            global_statistics_timeout=LIBRARY_WAIT,
        )
    torch.manual_seed(10 + rank)
    batches = [torch.randn(2, 4) for _ in range(3 if rank == 0 else 2)]
    with model.join():
        for x in batches:
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
    if output_dir is not None:
        remove_observer(model)
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def join_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """The same uneven DDP training observed, then not: each rank's parameters of both."""
    join(rank, world_size, port, USER_TIMEOUT)
    report: dict[str, object] = {}
    try:
        report["observed"] = train_with_join(rank, output_dir)
        report["plain"] = train_with_join(rank, None)
    except Exception as error:  # the user's collective failed: the test says so
        report["error"] = repr(error)
    Path(output_dir, f"join-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_ddp_join_trains_the_same_with_the_observer_when_the_data_is_uneven(
    pair: Path,
) -> None:
    """DDP's join context shadows the joined rank's collectives on the default group: the
    library's never meet them, so every rank's parameters are those of the same training
    without the observer, and the sample only rank 0 took is null with the reason."""
    tmp_path = pair / "join"
    for rank in range(2):
        report = json.loads((tmp_path / f"join-{rank}.json").read_text())
        assert "error" not in report
        assert report["observed"] == report["plain"]
    rows = layer_rows(tmp_path / "rank-000", "module.0")  # the layer inside DDP's wrapper
    assert rows.filter(pl.col("sample_id") < 2)["value"].null_count() == 0
    extra = rows.filter(pl.col("sample_id") == 2)
    assert extra.height == len(METRICS)
    assert (
        extra["unavailable_reason"].str.starts_with("global statistics stopped at sample 2").all()
    )


def test_groups_that_cannot_be_made_at_inject_leave_null_rows_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One gloo rank whose `dist.new_group` fails: inject goes on, and every globally measured
    tensor has null rows with the reason, warned and said in index.md."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:

        def refused(*args: object, **kwargs: object) -> None:
            raise RuntimeError("no group today")

        monkeypatch.setattr(dist, "new_group", refused)
        model = chain(2)
        inject_observer(
            model,
            output_dir=tmp_path / "run",
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
        )
        with pytest.warns(RuntimeWarning, match="global statistics stopped at inject"):
            model(torch.randn(2, 4)).sum().backward()
        model(torch.randn(2, 4)).sum().backward()
        remove_observer(model)
    finally:
        dist.destroy_process_group()
    directory = tmp_path / "run" / "rank-000"
    rows = layer_rows(directory)
    assert rows["sample_id"].unique().sort().to_list() == [0, 1]
    assert rows["value"].null_count() == rows.height == 2 * len(METRICS)
    assert (
        rows["unavailable_reason"]
        == "global statistics stopped at inject, for the rest of the run: RuntimeError: no "
        "group today"
    ).all()
    assert "global statistics stopped at inject" in (directory / "index.md").read_text("utf-8")


def test_a_forward_one_rank_runs_alone_waits_for_no_one_without_a_dtensor_in_the_model(
    pair: Path,
) -> None:
    """global_statistics=True under DDP, the model holding no DTensor: there is nothing to
    measure over ranks, so no sample exchanges anything. Rank 0's validation batch, which rank 1
    never runs, stops nothing (before, its next sample waited for rank 1, held in DDP's
    all-reduce, and global statistics stopped with RanksApartError): every sample has this
    rank's own rows, measured, and index.md says why no collective is taken."""
    for rank, samples in ((0, 4), (1, 3)):
        directory = pair / "alone" / "ddp" / f"rank-{rank:03d}"
        index = (directory / "index.md").read_text("utf-8")
        assert "no other rank came within 2 s" not in index  # RanksApartError, stopped
        assert "global statistics of a sample failed" not in index
        assert "no sample takes a collective" in index
        rows = layer_rows(directory, "module.0")
        assert sorted(rows["sample_id"].unique().to_list()) == list(range(samples))
        assert rows.height == samples * len(METRICS)
        assert rows["value"].null_count() == 0
        assert rows["population"].null_count() == rows.height  # this rank's tensor
        assert rows.filter(~pl.col("grad_enabled"))["sample_id"].to_list() == (
            [1] * len(METRICS) if rank == 0 else []
        )


def test_a_validation_batch_one_rank_runs_alone_stops_global_statistics_on_every_rank_at_once(
    pair: Path,
) -> None:
    """The same DDP loop with the world group named, the validation batch after step 1: rank 0's
    no_grad batch (model in train mode) pairs with rank 1's next training sample, at the same
    forward_index. The headers tell the kinds of forward apart, so neither rank combines a
    validation batch with a training batch (before, sample 2's rows were one value of both), and both stop global
    statistics there together: every later sample is null with the reason on both ranks, and
    no rank waited for the library's wait (before, rank 0's next sample waited for rank 1, held
    in DDP's all-reduce, until RanksApartError)."""
    kinds = "kind of forward by rank: eval/grad disabled, train/grad enabled"
    for rank, samples in ((0, 4), (1, 3)):
        directory = pair / "alone" / "named" / f"rank-{rank:03d}"
        rows = layer_rows(directory, "module.0")
        assert sorted(rows["sample_id"].unique().to_list()) == list(range(samples))
        assert rows["population"].unique().to_list() == ["global:ranks=0,1"]
        assert rows.filter(pl.col("sample_id") < 2)["value"].null_count() == 0
        later = rows.filter(pl.col("sample_id") >= 2)
        assert later["value"].null_count() == later.height == (samples - 2) * len(METRICS)
        assert (
            later["unavailable_reason"]
            == "global statistics stopped at sample 2, for the rest of the run: "
            f"RanksApartError: the ranks sampled different root forwards ({kinds}): every rank "
            "stopped global statistics here, together (from here on a sample is another root "
            "forward on some rank, and a rank ahead would wait for one no other rank takes)"
        ).all()
        index = (directory / "index.md").read_text("utf-8")
        assert "no other rank came within 2 s" not in index  # no wait ran out
        assert "stopped there on every rank together" in index  # the warning, kept
        assert "or kinds of forward (train or eval mode, grad enabled or not)" in index  # the note


def test_a_dtensor_a_model_without_one_returns_keeps_its_local_rows_and_says_so(
    pair: Path,
) -> None:
    """A layer returning `DTensor.from_local` in a model that held no DTensor at inject: its
    rows are this rank's shard (the mean of rank r's values, r + 1; over both ranks it would be
    1.5), with its placement and a null population, warned and said in index.md."""
    for rank in range(2):
        directory = pair / "alone" / "from-local" / f"rank-{rank:03d}"
        rows = layer_rows(directory)
        assert rows["population"].null_count() == rows.height == len(METRICS)
        assert rows["placement"].unique().to_list() == ["Shard(0)"]
        got = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
        assert got["mean"] == got["min"] == got["max"] == float(rank + 1)
        assert got["std"] == 0.0
        index = (directory / "index.md").read_text("utf-8")
        said = [line for line in index.splitlines() if "returned a DTensor although" in line]
        assert len(said) == 1  # a note of what the rows are, not a recording failure's
        assert "failures of this kind" not in said[0]
