"""`compare PARENT` when one rank ran an evaluation forward the others did not, in a plain loop
without steps: with `EveryNForwardsSampler` every rank samples the same forward_index, so only
the rows themselves tell that sample 1 is an evaluation on rank 1 and a training step on rank 0
(and every later sample one step apart): the warning says so first. So do they where rank 1's
extra forward was a training forward whose loss it never backpropagated (no optimizer step)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch
from test_rank_parent_readers import history, observe_rank
from torch import nn

from conftest import cli_in_process


def test_compare_parent_warns_when_a_rank_evaluated_where_the_others_trained(
    tmp_path: Path,
) -> None:
    observe_rank(tmp_path, 0)
    observe_rank(tmp_path, 1, eval_forwards=True)
    for rank, kinds in ((0, [True, True, True]), (1, [True, False, True])):
        samples = history(tmp_path, rank).group_by("sample_id", maintain_order=True)
        grad = samples.agg(pl.col("grad_enabled").any()).sort("sample_id")
        assert grad["grad_enabled"].to_list()[:3] == kinds
    done = cli_in_process("compare", tmp_path, "--metrics", "mean", "--width", "400")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        "warning: the ranks sampled different root forwards: sample_id 1 is rank 0: "
        "forward_index 1, step none, a training forward (a module in train mode, or grad "
        "enabled); rank 1: forward_index 1, step none, "
        "an evaluation forward (eval mode, grad disabled); from there on the same sample_id "
        "may be a different step in each."
    )


def test_compare_parent_does_not_warn_when_every_rank_evaluated_alike(tmp_path: Path) -> None:
    """Every rank with the same evaluation forwards: the same root forwards, no warning."""
    observe_rank(tmp_path, 0, eval_forwards=True)
    observe_rank(tmp_path, 1, eval_forwards=True)
    done = cli_in_process("compare", tmp_path, "--metrics", "mean", "--width", "400")
    assert done.returncode == 0, done.stderr
    assert not done.stdout.startswith("warning")


def test_compare_parent_warns_when_a_rank_ran_a_training_forward_no_backward_reached(
    tmp_path: Path,
) -> None:
    """Rank 1 runs one training forward more than rank 0 before its second step, and never
    backpropagates it (no optimizer step): its sample 1 has output rows of a training forward,
    as rank 0's step 1 has, but no gradient row, though later samples have theirs. Before, nothing
    said the ranks' sample_ids were a step apart from there on."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    for rank in range(2):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", str(rank))
            env.setenv("WORLD_SIZE", "2")
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            inject_observer(
                model, output_dir=tmp_path, sampler=EveryNForwardsSampler(1), rank_policy="all"
            )
        for step in range(3):
            if rank == 1 and step == 1:
                model(torch.randn(5, 4))  # its loss is never backpropagated
            model(torch.randn(5, 4)).sum().backward()
        remove_observer(model)
    done = cli_in_process("compare", tmp_path, "--metrics", "mean", "--width", "400")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        "warning: the ranks sampled different root forwards: sample_id 1 is rank 0: "
        "forward_index 1, step none, a training forward (a module in train mode, or grad "
        "enabled); rank 1: forward_index 1, step none, a training forward no backward reached "
        "(no gradient row, where a later sample has one: a forward the others did not run, say); "
        "from there on the same sample_id may be a different step in each."
    )
