"""`compare PARENT` departs where a rank has a sample but no row of a series there (a layer it
skipped, a branch it did not take), as the two-run `compare` differs where one run has a row and
the other none at a sample both have; a rank that stopped earlier (no such sample at all) is no
departure. Every rank is written by a real observer (the launcher's RANK and WORLD_SIZE) on the
same data; the parent's index.md departure query finds the same first departures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from test_rank_departure_nonfinite import _query_departures, key
from torch import nn

from conftest import cli_in_process

SERIES = ["layer", "call_index", "signal", "tensor_path", "mode", "metric"]


class Branch(nn.Module):
    """Two linear layers, the second skipped at forward `skip` (None: never)."""

    def __init__(self, skip: int | None) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.skip = skip
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.forwards += 1
        return h if self.forwards - 1 == self.skip else self.b(h)


def observe(parent: Path, rank: int, world_size: int, forwards: int, skip: int | None) -> None:
    """Rank `rank` observes `Branch` on the batches every rank sees (one seed)."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", str(rank))
        env.setenv("WORLD_SIZE", str(world_size))
        torch.manual_seed(0)
        model = Branch(skip)
        inject_observer(
            model, output_dir=parent, sampler=EveryNForwardsSampler(1), rank_policy="all"
        )
    torch.manual_seed(1)
    for _ in range(forwards):
        model(torch.randn(5, 4)).sum().backward()
    remove_observer(model)


def rows_of(done: Any) -> dict[tuple[Any, ...], dict[str, Any]]:
    assert done.returncode == 0, done.stderr
    return {tuple(r[k] for k in SERIES): r for r in json.loads(done.stdout)["rows"]}


def test_two_ranks_depart_where_one_skipped_a_layer_as_the_two_run_compare_differs(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stats"
    observe(parent, 0, 2, forwards=6, skip=None)
    observe(parent, 1, 2, forwards=5, skip=2)  # no row of b at sample 2; stops after 4
    ranks = rows_of(cli_in_process("compare", parent, "--format", "json"))
    runs = rows_of(
        cli_in_process("compare", parent / "rank-000", parent / "rank-001", "--format", "json")
    )
    assert set(ranks) == set(runs)
    for series, r in ranks.items():
        assert r["first_departure"] == runs[series]["first_difference"], series
        assert r["matched_samples"] == runs[series]["matched_samples"], series
    for signal in ("output", "output_gradient"):
        b = ranks[key("b", signal, "mean")]
        assert b["first_departure"] == 2
        assert b["departing_ranks"] == [0, 1]
        assert b["departing_values"][1] is None
        assert b["departing_reasons"] == [None, "no row"]
        assert b["nearest_other"] is None
    assert ranks[key("a", "output", "mean")]["first_departure"] is None  # measured alike
    text = cli_in_process("compare", parent, "--metrics", "mean").stdout
    assert "no row of the series" in " ".join(text.split())


def test_of_three_ranks_the_one_that_skipped_a_layer_departs_alone(tmp_path: Path) -> None:
    parent = tmp_path / "stats"
    for rank, skip in ((0, None), (1, 3), (2, None)):
        observe(parent, rank, 3, forwards=5, skip=skip)
    ranks = rows_of(cli_in_process("compare", parent, "--format", "json"))
    b = {s: r for s, r in ranks.items() if s[0] == "b"}
    assert b
    for r in b.values():
        assert (r["first_departure"], r["departing_ranks"]) == (3, [1])
        assert r["departing_reasons"] == ["no row"]
        assert r["matched_samples"] == 5  # ranks 0 and 2 agree at every sample
    # a's output is the same on every rank; its gradient on rank 1 skips b at sample 3
    a = {s: r["first_departure"] for s, r in ranks.items() if s[0] == "a"}
    assert {first for s, first in a.items() if s[2] == "output"} == {None}
    departed = {
        s: (r["first_departure"], r["departing_ranks"])
        for s, r in ranks.items()
        if r["first_departure"] is not None and s[-1] in ("mean", "std")
    }
    found = _query_departures(parent, "0.0", ["mean", "std"])
    assert set(found) == set(departed)
    for series, (sample, rank) in found.items():
        assert sample == departed[series][0], series
        assert rank in departed[series][1], series
    # a rank's result.json lost: its state file still names its layers, for compare and the query
    (parent / "rank-001" / "result.json").unlink()
    assert rows_of(cli_in_process("compare", parent, "--format", "json")) == ranks
    assert _query_departures(parent, "0.0", ["mean", "std"]) == found


def test_a_rank_that_stopped_earlier_does_not_depart_after_its_last_sample(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stats"
    observe(parent, 0, 2, forwards=6, skip=None)
    observe(parent, 1, 2, forwards=3, skip=None)
    ranks = rows_of(cli_in_process("compare", parent, "--format", "json"))
    assert all(r["first_departure"] is None for r in ranks.values())
    assert {r["matched_samples"] for r in ranks.values()} == {3}
    found = _query_departures(parent, "0.0", ["mean"])
    assert found == {}


def test_ranks_running_different_layers_do_not_depart_on_the_layers_one_lacks(
    tmp_path: Path,
) -> None:
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    parent = tmp_path / "stats"
    for rank in (0, 1):  # a pipeline split: rank 0 selects only a, rank 1 only b
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", str(rank))
            env.setenv("WORLD_SIZE", "2")
            torch.manual_seed(0)
            model = Branch(None)
            inject_observer(
                model,
                output_dir=parent,
                sampler=EveryNForwardsSampler(1),
                rank_policy="all",
                selector=lambda name, _, mine="ab"[rank]: name == mine,
            )
        for _ in range(3):
            model(torch.randn(5, 4)).sum().backward()
        remove_observer(model)
    ranks = rows_of(cli_in_process("compare", parent, "--format", "json"))
    assert {s[0] for s in ranks} == {"a", "b"}
    assert all(r["first_departure"] is None for r in ranks.values())
    assert all(r["ranks"] == 1 for r in ranks.values())
    assert _query_departures(parent, "0.0", ["mean"]) == {}


def test_missing_row_departures_are_the_same_read_in_ranges_of_one_sample_or_all_at_once(
    tmp_path: Path,
) -> None:
    from torchinstruments.cli import ranks
    from torchinstruments.cli.selection import Selection

    parent = tmp_path / "stats"
    for rank, skip in ((0, None), (1, 2), (2, 4)):
        observe(parent, rank, 3, forwards=6 - rank, skip=skip)
    one = ranks.departures(parent, Selection(), budget_rows=1).frame
    whole = ranks.departures(parent, Selection(), budget_rows=10**9).frame
    assert one.to_dicts() == whole.to_dicts()
    b = whole.filter(pl.col("layer") == "b", pl.col("signal") == "output")
    assert set(b["first_departure"]) == {2}
    assert b["departing_ranks"].to_list() == [[1]] * b.height
