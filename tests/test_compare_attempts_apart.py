"""`compare` matches samples on sample_id, which each run directory continues from the rows it
holds when a job is restarted into it (resume=True). Where the runs (or a parent's ranks) were
restarted at different sample_ids, one sample_id is then another attempt's sample in each, and
both comparisons say so before the table, naming the first such sample and each run's attempt
there, instead of pairing them silently (real observers, the launcher's RANK and WORLD_SIZE;
the ranks' first job ran on uneven data, rank 1 one sample short, as a rank whose last sample a
kill lost leaves it)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import cli_in_process


def job(parent: Path, samples: dict[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """One job of the ranks of `samples` (rank -> its samples), continued into `parent`."""
    monkeypatch.setenv("WORLD_SIZE", str(len(samples)))
    for rank, count in samples.items():
        monkeypatch.setenv("RANK", str(rank))
        torch.manual_seed(rank)
        model = nn.Linear(2, 2)
        inject_observer(
            model,
            output_dir=parent,
            rank_policy="all",
            sampler=EveryNForwardsSampler(1),
            resume=True,
        )
        for _ in range(count):
            model(torch.randn(1, 2)).sum().backward()
        remove_observer(model)


def attempt_at(directory: Path, sample_id: int) -> int:
    frame = pl.read_parquet(directory / "history.parquet")
    (attempt,) = frame.filter(pl.col("sample_id") == sample_id)["attempt"].unique().to_list()
    return attempt


def test_compare_says_where_one_sample_id_is_another_attempt_in_each_run_or_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = tmp_path / "stats"
    job(parent, {0: 3, 1: 2}, monkeypatch)
    job(parent, {0: 2, 1: 2}, monkeypatch)  # the job restarted: each rank continues its own ids
    zero, one = parent / "rank-000", parent / "rank-001"
    assert (attempt_at(zero, 2), attempt_at(one, 2)) == (0, 1)

    ranks = cli_in_process("compare", parent, "--format", "json")
    assert ranks.returncode == 0, ranks.stderr
    assert json.loads(ranks.stdout)["run"]["warnings"] == [
        "warning: the ranks' attempts begin at different samples: sample_id 2 is rank 0: "
        "attempt 0; rank 1: attempt 1. Each rank's directory continues sample_id from the rows "
        "it holds when a job is restarted into it, so from there on the same sample_id may be "
        "another job's step on each rank (each rank's index.md lists its attempts)."
    ]
    runs = cli_in_process("compare", zero, one, "--format", "json")
    assert runs.returncode == 0, runs.stderr
    assert json.loads(runs.stdout)["run"]["warnings"] == [
        "warning: the runs' attempts begin at different samples: sample_id 2 is A: attempt 0; "
        "B: attempt 1. Each run's directory continues sample_id from the rows it holds when a "
        "job is restarted into it, so from there on the same sample_id may be another job's "
        "step in each run (each run's index.md lists its attempts)."
    ]
    page = (parent / "index.md").read_text(encoding="utf-8")  # the parent's, as compare says
    assert (
        "Attempts begin at different samples across ranks: sample_id 2 is attempt 0 on rank 0; "
        "attempt 1 on rank 1."
    ) in page
    # the same restart in both runs: the attempts begin together, nothing to say
    alike = cli_in_process("compare", zero, zero, "--format", "json")
    assert json.loads(alike.stdout)["run"]["warnings"] == []
