"""`compare PARENT` when one rank ran an evaluation forward the others did not, in a plain loop
without steps: with `EveryNForwardsSampler` every rank samples the same forward_index, so only
the rows themselves tell that sample 1 is an evaluation on rank 1 and a training step on rank 0
(and every later sample one step apart): the warning says so first."""

from __future__ import annotations

from pathlib import Path

import polars as pl
from test_rank_parent_readers import history, observe_rank

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
