"""Two real gloo processes on 127.0.0.1: rank policies, per-rank directories, no collectives,
and what a run says when it was placed before its process had a rank."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from _ranks import joined, run_ranks_in_sequence
from conftest import read_history


def worker(rank: int, world_size: int, port: int, policy: str, output_dir: str) -> None:
    """One rank: observe a model, feed rank-specific inputs, and record what it saw."""
    from torchinstruments import (
        EveryNForwardsSampler,
        has_observer,
        inject_observer,
        remove_observer,
    )

    with joined(rank, world_size, port):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        returned = inject_observer(
            model, output_dir=output_dir, sampler=EveryNForwardsSampler(1), rank_policy=policy
        )
        attached = has_observer(model)
        dicts = [("forward" in m.__dict__) for m in model.modules()]
        for step in range(3 + rank):  # ranks sample different numbers of forwards
            x = torch.full((2, 4), float(rank + 1) * (step + 1))
            model(x).sum().backward()
        removed = remove_observer(model)
        Path(output_dir, f"report-{rank}.txt").write_text(
            f"{attached} {any(dicts)} {returned} {removed}"
        )


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One pair of ranks for the file's scenarios, one after the other, each in a group of its
    own (a pair of spawned ranks takes seconds): first `late_group_worker` (in processes that
    never had a group before it) into `root/late`, then `worker` under each rank policy into
    `root/<policy>/stats`."""
    root = tmp_path_factory.mktemp("pair")
    (root / "late").mkdir()
    for policy in ("rank0", "all"):
        (root / policy / "stats").mkdir(parents=True)
    run_ranks_in_sequence(
        [
            (late_group_worker, (str(root / "late"),)),
            (worker, ("rank0", str(root / "rank0" / "stats"))),
            (worker, ("all", str(root / "all" / "stats"))),
        ]
    )
    return root


def test_rank0_policy_attaches_nothing_on_rank1(pair: Path) -> None:
    output_dir = pair / "rank0" / "stats"
    assert (output_dir / "report-1.txt").read_text() == "False False None None"
    assert (output_dir / "report-0.txt").read_text() == f"True True {output_dir} {output_dir}"
    assert not any(output_dir.glob("rank-*"))
    history = pl.read_parquet(output_dir / "history.parquet")
    assert history["rank"].unique().to_list() == [0]
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2]


def test_all_policy_writes_one_complete_directory_per_rank(pair: Path) -> None:
    output_dir = pair / "all" / "stats"
    for rank in range(2):
        directory = output_dir / f"rank-{rank:03d}"
        for artifact in ("history.parquet", "result.json", "index.md", "tensorboard"):
            assert (directory / artifact).exists(), (rank, artifact)
        history = pl.read_parquet(directory / "history.parquet")
        assert history["rank"].unique().to_list() == [rank]
        assert history["sample_id"].max() == 2 + rank
        # each rank fed (rank + 1) * (step + 1): its Linear means are its own inputs' alone
        means = (
            history.filter(
                (pl.col("layer") == "0")
                & (pl.col("metric") == "mean")
                & (pl.col("signal") == "output")
            )
            .sort("sample_id")["value"]
            .to_list()
        )
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        expected = [
            reference[0](torch.full((2, 4), float(rank + 1) * (step + 1))).mean().item()
            for step in range(3 + rank)
        ]
        assert means == pytest.approx(expected, rel=1e-6)
    both = pl.scan_parquet(str(output_dir / "rank-*" / "history.parquet")).collect()
    assert sorted(both["rank"].unique().to_list()) == [0, 1]


def test_invalid_rank_policy_raises_at_inject(tmp_path: Path) -> None:
    from torchinstruments import inject_observer

    with pytest.raises(ValueError, match="rank_policy must be one of 'rank0', 'all'"):
        inject_observer(nn.Linear(2, 2), output_dir=tmp_path / "s", rank_policy="every")


def late_group_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """One rank of a job that injects before `init_process_group`, without torchrun's RANK and
    WORLD_SIZE (`mp.spawn` passing the rank itself): each rank its own output_dir here."""
    import warnings

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    own = Path(output_dir, f"process-{rank}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_observer(model, output_dir=own, sampler=EveryNForwardsSampler(1), rank_policy="all")
        with joined(rank, world_size, port):
            model(torch.ones(2, 4)).sum().backward()
            remove_observer(model)
    Path(output_dir, f"warnings-{rank}.txt").write_text("\n".join(str(w.message) for w in caught))


def test_a_run_placed_before_the_process_group_existed_says_so(pair: Path) -> None:
    """Injected before init_process_group and without the launcher's environment, a process
    cannot know its rank: its run is a single process's (rank null, output_dir itself). Once
    it is rank r of a group, the run says so at removal (a warning and index.md), with the fix."""
    tmp_path = pair / "late"
    for rank in range(2):
        directory = tmp_path / f"process-{rank}"
        assert not any(directory.glob("rank-*"))
        assert read_history(directory)["rank"].null_count() == read_history(directory).height
        said = f"this process became rank {rank} of 2 (torch.distributed) after inject_observer"
        assert said in (tmp_path / f"warnings-{rank}.txt").read_text()
        page = (directory / "index.md").read_text(encoding="utf-8")
        assert said in page
        assert "Call inject_observer after init_process_group" in page


def test_a_second_process_for_a_live_runs_directory_is_told_how_to_place_ranks(
    tmp_path: Path,
) -> None:
    """Ranks that inject before init_process_group (no launcher environment) all take
    output_dir: the first gets it, the next is refused with a message that says a live process
    writes it (not "pass resume=True", which would be refused too) and how to place ranks. A
    second observer in this process holds its own lock, as another process would."""
    from torchinstruments import inject_observer, remove_observer

    first = nn.Linear(2, 2)
    inject_observer(first, output_dir=tmp_path / "stats")
    try:
        with pytest.raises(FileExistsError) as refused:
            inject_observer(nn.Linear(2, 2), output_dir=tmp_path / "stats")
        message = str(refused.value)
        assert f"holds a run that a live process (pid {os.getpid()}) is writing now" in message
        assert "resume=True would be refused too" in message
        assert "Call inject_observer after init_process_group" in message
    finally:
        remove_observer(first)
    with pytest.raises(FileExistsError, match="pass resume=True") as refused:  # ended: as before
        inject_observer(nn.Linear(2, 2), output_dir=tmp_path / "stats")
    assert "live process" not in str(refused.value)
