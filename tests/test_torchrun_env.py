"""torchrun launches: ranks come from the environment when inject runs before init_process_group.

Two real processes get exactly what torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), call `inject_observer` first, then `init_process_group("gloo")` (env:// rendezvous),
train, and remove the observer. Without reading the environment both would write one directory
with rank null, and race for it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _ranks import run_ranks_in_sequence
from conftest import cli_in_process, run_status

WORLD_SIZE = 2


def worker(rank: int, world_size: int, port: int, policy: str, output_dir: str) -> None:
    """One torchrun-like rank: environment first, inject before the process group exists."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    returned = inject_observer(
        model, output_dir=output_dir, sampler=EveryNForwardsSampler(1), rank_policy=policy
    )
    initialized_at_inject = dist.is_initialized()
    dist.init_process_group("gloo")
    try:
        for step in range(3 + rank):  # ranks sample different numbers of forwards
            model(torch.full((2, 4), float(rank + 1) * (step + 1))).sum().backward()
        dist.barrier()  # the user's own collective: the process group really works
        removed = remove_observer(model)
        Path(output_dir, f"report-{rank}.txt").write_text(
            f"{initialized_at_inject} {returned} {removed}", encoding="utf-8"
        )
    finally:
        dist.destroy_process_group()


POLICIES = ("rank0", "all")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One pair of ranks runs `worker` for each policy, one after the other, each in a group of
    its own into `root/<policy>` (a pair of spawned ranks takes seconds; each scenario destroys
    its group and removes its observer before the next)."""
    root = tmp_path_factory.mktemp("torchrun")
    for policy in POLICIES:
        (root / policy).mkdir()
    run_ranks_in_sequence(
        [(worker, (policy, str(root / policy))) for policy in POLICIES], world_size=WORLD_SIZE
    )
    return root


def test_rank0_policy_before_init_attaches_only_rank0(two_ranks: Path) -> None:
    output_dir = two_ranks / "rank0"
    assert (output_dir / "report-0.txt").read_text() == f"False {output_dir} {output_dir}"
    assert (output_dir / "report-1.txt").read_text() == "False None None"
    assert not any(p.name.startswith("rank-") for p in output_dir.iterdir())
    history = pl.read_parquet(output_dir / "history.parquet")
    assert history["rank"].unique().to_list() == [0]
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2]
    index = (output_dir / "index.md").read_text("utf-8")
    assert "rank 0 of 2" in index


def test_all_policy_before_init_writes_one_directory_per_rank(two_ranks: Path) -> None:
    output_dir = two_ranks / "all"
    for rank in range(WORLD_SIZE):
        directory = output_dir / f"rank-{rank:03d}"
        assert (output_dir / f"report-{rank}.txt").read_text() == (f"False {directory} {directory}")
        history = pl.read_parquet(directory / "history.parquet")
        assert history["rank"].unique().to_list() == [rank]
        assert history["sample_id"].max() == 2 + rank
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
        reference = nn.Linear(4, 4)
        expected = [
            reference(torch.full((2, 4), float(rank + 1) * (step + 1))).mean().item()
            for step in range(3 + rank)
        ]
        assert means == pytest.approx(expected, rel=1e-6)
        assert run_status(directory) == "complete"


def test_environment_rank_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process with torchrun's variables for rank 1: rank0 attaches nothing, all writes
    rank-001 with the rank in every row; no process group is ever created."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Sequential(nn.Linear(2, 2))
    assert inject_observer(model, output_dir=tmp_path / "s", rank_policy="rank0") is None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # removing on a rank that attached nothing is quiet
        assert remove_observer(model) is None
    assert not said, [str(w.message) for w in said]
    returned = inject_observer(
        model, output_dir=tmp_path / "s", rank_policy="all", sampler=EveryNForwardsSampler(1)
    )
    assert returned == tmp_path / "s" / "rank-001"
    model(torch.ones(1, 2))
    remove_observer(model)
    assert pl.read_parquet(tmp_path / "s" / "rank-001" / "history.parquet")[
        "rank"
    ].unique().to_list() == [1]
    assert not dist.is_initialized()


@pytest.mark.parametrize(("rank", "world_size"), [("zero", "2"), ("2", "2"), ("-1", "2")])
def test_malformed_launcher_environment_is_ignored_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str, world_size: str
) -> None:
    from torchinstruments import inject_observer, remove_observer

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world_size)
    model = nn.Linear(2, 2)
    with pytest.warns(RuntimeWarning, match="RANK"):
        returned = inject_observer(model, output_dir=tmp_path / "s", rank_policy="all")
    remove_observer(model)
    assert returned == tmp_path / "s"  # treated as not distributed


def test_a_job_restarted_on_fewer_ranks_gives_each_ranks_world_size_in_the_parents_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An elastic restart: a job of 3 ranks, then the same run continued (resume=True) by a
    job of 2. rank-002 holds only the first job's samples; the parent's index.md gives each
    rank's world size instead of one world size of 3 that says rank 2 took part throughout."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    parent = tmp_path / "s"

    def job(world_size: int, steps: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        for rank in range(world_size):
            monkeypatch.setenv("RANK", str(rank))
            model = nn.Linear(2, 2)
            inject_observer(
                model,
                output_dir=parent,
                rank_policy="all",
                sampler=EveryNForwardsSampler(1),
                resume=True,
            )
            for _ in range(steps):
                model(torch.ones(1, 2))
            remove_observer(model)

    job(3, 2)
    assert "world size 3." in (parent / "index.md").read_text("utf-8")
    job(2, 1)
    index = (parent / "index.md").read_text("utf-8")
    assert "world size 3" not in index
    assert "World sizes differ: 2 (rank 0-1); 3 (rank 2)" in index
    samples = {
        rank: pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet")["sample_id"]
        .unique()
        .sort()
        .to_list()
        for rank in range(3)
    }
    assert samples == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1]}
    assert "Attempts differ across ranks: 1 (rank 2); 2 (rank 0-1)." in index
    # grown again to 4 ranks: one world size, but rank 2 missed the second job and rank 3 both
    # earlier ones, so sample 2 is the third job's on rank 2 and the second's on ranks 0-1
    job(4, 1)
    index = (parent / "index.md").read_text("utf-8")
    assert "world size 4." in index
    said = "Attempts differ across ranks: 1 (rank 3); 2 (rank 2); 3 (rank 0-1)."
    assert said in index
    for command in ("show", "compare"):  # their headers say it too
        done = cli_in_process(command, parent, "--width", "1000")
        assert done.returncode == 0, done.stderr
        assert any(line.startswith(said) for line in done.stdout.splitlines()), command
    at_2 = {
        rank: pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet").filter(
            pl.col("sample_id") == 2
        )
        for rank in range(3)
    }
    jobs = {rank: frame["attempt"].unique().to_list() for rank, frame in at_2.items()}
    assert jobs == {0: [1], 1: [1], 2: [1]}  # each rank's second attempt, but other jobs:
    assert min(at_2[2]["timestamp"].to_list()) > max(at_2[1]["timestamp"].to_list())  # later


def test_show_of_a_parent_whose_ranks_stopped_at_different_samples_says_each_ranks_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven data: rank 1 ran out of batches after one sample, rank 0 took three. `show` of
    the parent spreads each rank's latest value, which is then sample 2 on rank 0 and sample 0
    on rank 1: its header says so, and says nothing where the ranks' latest samples agree."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
    from torchinstruments.__main__ import main

    def job(parent: Path, steps: dict[int, int]) -> str:
        monkeypatch.setenv("WORLD_SIZE", str(len(steps)))
        for rank, count in steps.items():
            monkeypatch.setenv("RANK", str(rank))
            model = nn.Linear(2, 2)
            inject_observer(
                model, output_dir=parent, rank_policy="all", sampler=EveryNForwardsSampler(1)
            )
            for _ in range(count):
                model(torch.ones(1, 2))
            remove_observer(model)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["show", str(parent), "--format", "json"]) == 0
        return json.loads(out.getvalue())["run"]["rank_gaps"]

    assert job(tmp_path / "even", {0: 2, 1: 2}) == []
    gaps = job(tmp_path / "uneven", {0: 3, 1: 1})
    assert [g for g in gaps if g.startswith("latest sample differs: 0 on rank 1, 2 on rank 0;")]


def one_job(
    parent: Path,
    monkeypatch: pytest.MonkeyPatch,
    world_size: int,
    rank_policy: str,
    resume: bool = False,
) -> None:
    """Every rank of a torchrun job, one after the other in this process: inject, one
    sampled forward, remove."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    for rank in range(world_size):
        monkeypatch.setenv("RANK", str(rank))
        model = nn.Linear(2, 2)
        attached = inject_observer(
            model,
            output_dir=parent,
            sampler=EveryNForwardsSampler(1),
            rank_policy=rank_policy,
            resume=resume,
        )
        if attached is not None:
            model(torch.ones(1, 2))
            remove_observer(model)


def test_a_restart_with_rank_policy_all_into_one_processs_run_is_refused_and_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first job wrote `rank_policy="rank0"` (the run is output_dir itself); its restart
    passes `rank_policy="all"`. Refused at inject, naming rank_policy, instead of starting
    rank-NNN/ runs afresh inside that run (sample_id from 0 again, `resume=True` or not) and
    writing their parent page over its index.md."""
    parent = tmp_path / "stats"
    one_job(parent, monkeypatch, 2, "rank0")
    before = (parent / "index.md").read_bytes()
    for resume in (True, False):
        with pytest.raises(FileExistsError, match=r"rank_policy='all' cannot put rank-000/"):
            one_job(parent, monkeypatch, 2, "all", resume)
    assert not list(parent.glob("rank-*"))
    assert (parent / "index.md").read_bytes() == before


def test_a_restart_that_would_write_a_multi_rank_runs_directory_itself_names_rank_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first job wrote `rank_policy="all"`; its restart passes `rank_policy="rank0"` (or
    runs without a rank at inject). The refusal names rank_policy='all', where it said the
    directory held run files without history."""
    parent = tmp_path / "stats"
    one_job(parent, monkeypatch, 2, "all")
    with pytest.raises(FileExistsError, match=r"holds a multi-rank run .*rank_policy='all'"):
        one_job(parent, monkeypatch, 2, "rank0", resume=True)
    assert sorted(p.name for p in parent.iterdir() if not p.name.startswith(".")) == [
        "index.md",
        "rank-000",
        "rank-001",
    ]


def test_a_trainer_callbacks_fresh_run_directory_passes_a_run_laid_out_for_the_other_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's output directory reused by a job with the other rank_policy: the callbacks'
    fresh run directory is the next free one, not the one inject would refuse."""
    from torchinstruments.integrations._run_dirs import fresh_run_directory

    one_job(tmp_path / "single" / "torchinstruments", monkeypatch, 2, "rank0")
    one_job(tmp_path / "ranks" / "torchinstruments", monkeypatch, 2, "all")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert fresh_run_directory(tmp_path / "single", "all").name == "torchinstruments-2"
    assert fresh_run_directory(tmp_path / "ranks", "rank0").name == "torchinstruments-2"
    assert fresh_run_directory(tmp_path / "single", "rank0").name == "torchinstruments-2"
    assert fresh_run_directory(tmp_path / "ranks", "all").name == "torchinstruments-2"
    assert fresh_run_directory(tmp_path / "new", "all").name == "torchinstruments"
