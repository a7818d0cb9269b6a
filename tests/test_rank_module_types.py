"""One layer name, a different module on each rank (a pipeline split: rank 0's `layers.0` a
Linear, rank 1's a Conv1d): `show PARENT` and `compare PARENT` keep the two apart (a row per
module type, over the ranks that have it) and say so; `compare A B` matches them by name and
warns. Each rank is written by a real observer (RANK and WORLD_SIZE as torchrun sets them);
expected values come from each rank's own history.parquet."""

from __future__ import annotations

import io
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from conftest import cli_in_process

FORWARDS = 3


class Stage(nn.Module):
    """A pipeline stage: `layers.0` is a Linear on rank 0 and a Conv1d on rank 1; `layers.1` a
    ReLU on both."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        first = nn.Linear(4, 4) if rank == 0 else nn.Conv1d(1, 1, 3, padding=1)
        self.layers = nn.ModuleList([first, nn.ReLU()])
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.rank == 0 else x.unsqueeze(1)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    parent = tmp_path_factory.mktemp("pipeline") / "stats"
    for rank in (0, 1):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", str(rank))
            env.setenv("WORLD_SIZE", "2")
            torch.manual_seed(0)
            model = Stage(rank)
            inject_observer(
                model, output_dir=parent, sampler=EveryNForwardsSampler(1), rank_policy="all"
            )
        for _ in range(FORWARDS):
            model(torch.randn(5, 4)).sum().backward()
        remove_observer(model)
    return parent


def latest_mean(parent: Path, rank: int, layer: str, signal: str) -> float:
    rows = pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet")
    chosen = rows.filter(
        pl.col("layer") == layer, pl.col("signal") == signal, pl.col("metric") == "mean"
    )
    return chosen.sort("sample_id")["value"][-1]


def csv(*args: str | Path) -> pl.DataFrame:
    done = cli_in_process(*args, "--metrics", "mean", "--format", "csv")
    assert done.returncode == 0, done.stderr
    return pl.read_csv(io.StringIO(done.stdout))


def test_the_ranks_hold_one_layer_name_of_two_module_types(parent: Path) -> None:
    kinds = {
        rank: set(
            pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet")
            .filter(pl.col("layer") == "layers.0")["module_type"]
            .to_list()
        )
        for rank in (0, 1)
    }
    assert kinds == {0: {"Linear"}, 1: {"Conv1d"}}


def test_show_parent_spreads_each_module_type_over_its_own_ranks_only(parent: Path) -> None:
    frame = csv("show", parent).filter(pl.col("at") == "latest")
    first = frame.filter(pl.col("layer") == "layers.0")
    assert sorted(first["module_type"].unique().to_list()) == ["Conv1d", "Linear"]
    for module_type, rank in (("Linear", 0), ("Conv1d", 1)):
        for signal in ("output", "output_gradient"):
            row = first.filter(pl.col("module_type") == module_type, pl.col("signal") == signal)
            assert row.height == 1
            own = latest_mean(parent, rank, "layers.0", signal)
            assert row.select("ranks", "ranks_without_row", "min", "max", "farthest_rank").row(
                0
            ) == (1, 1, own, own, rank)
    relu = frame.filter(pl.col("layer") == "layers.1", pl.col("signal") == "output")
    assert relu.select("module_type", "ranks").row(0) == ("ReLU", 2)

    done = cli_in_process("show", parent, "--metrics", "mean", "--width", "200")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert (
        "1 layer of a different module type on different ranks, kept apart (a row per type, "
        "over the ranks that have it, named `layer (Type)`): layers.0 (Linear on rank 0; "
        "Conv1d on rank 1)"
    ) in text
    names = {line.split("  ")[0] for line in done.stdout.splitlines() if line.startswith("layers.")}
    assert names == {"layers.0 (Linear)", "layers.0 (Conv1d)", "layers.1"}


def test_compare_parent_never_matches_one_module_type_with_another(parent: Path) -> None:
    frame = csv("compare", parent)
    first = frame.filter(pl.col("layer") == "layers.0")
    assert first.height == 4  # 2 module types x 2 signals
    assert first["ranks"].to_list() == [1, 1, 1, 1]
    assert first["matched_samples"].to_list() == [0, 0, 0, 0]
    assert first["first_departure"].is_null().all()
    relu = frame.filter(pl.col("layer") == "layers.1")
    assert relu["matched_samples"].to_list() == [FORWARDS, FORWARDS]

    done = cli_in_process("compare", parent, "--metrics", "mean", "--width", "200")
    assert done.returncode == 0, done.stderr
    assert "layers.0 (Linear on rank 0; Conv1d on rank 1)" in " ".join(done.stdout.split())


def test_compare_of_the_two_rank_directories_matches_by_name_and_warns_first(
    parent: Path,
) -> None:
    a, b = parent / "rank-000", parent / "rank-001"
    done = cli_in_process("compare", a, b, "--metrics", "mean", "--width", "200")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        "warning: 1 layer of a different module type in A and B, compared by name: "
        "layers.0 (Linear in A; Conv1d in B)."
    )


def own_types(parent: Path, layer: str) -> str:
    """`Linear on rank 0; Conv1d on rank 1`: each rank's module type of `layer`, from its own
    history."""
    each = []
    for rank in (0, 1):
        rows = pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet")
        (module_type,) = set(rows.filter(pl.col("layer") == layer)["module_type"].to_list())
        each.append(f"{module_type} on rank {rank}")
    return "; ".join(each)


def test_plot_and_heatmap_of_the_parent_name_each_module_type_with_its_ranks(
    parent: Path, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    named = f"tensor layers.0 ({own_types(parent, 'layers.0')})"
    assert named == "tensor layers.0 (Linear on rank 0; Conv1d on rank 1)"
    done = cli_in_process("plot", parent, "--output", tmp_path / "trends.png")
    assert done.returncode == 0, done.stderr
    assert f"{named}, 2 ranks" in done.stdout
    done = cli_in_process("heatmap", parent, "--output-dir", tmp_path, "--metrics", "mean")
    assert done.returncode == 0, done.stderr
    assert f"mean of {named}, 2 ranks" in done.stdout

    # A layer of one module type on every rank keeps its plain name.
    done = cli_in_process("plot", parent, "--layers", "layers.1", "--output", tmp_path / "r.png")
    assert done.returncode == 0, done.stderr
    assert "tensor layers.1, 2 ranks" in done.stdout


def test_the_parent_pages_queries_keep_module_types_apart_as_compare_parent(
    parent: Path,
) -> None:
    """index.md's departure query keys a series on its module type, as `compare PARENT` does:
    rank 0's Linear `layers.0` is never compared with rank 1's Conv1d, and the latest-value
    query gives each type its own row."""
    from test_rank_parent_queries import csv as query_csv
    from test_rank_parent_queries import run_blocks

    key = ["layer", "module_type", "call_index", "signal", "tensor_path", "mode", "metric"]
    rows = pl.concat(
        [pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet") for rank in (0, 1)]
    ).filter(pl.col("metric") == "mean")
    # Independently: two ranks depart at the first sample where both have the series (of one
    # module type) and their values differ.
    pairs = rows.filter(pl.col("rank") == 0).join(
        rows.filter(pl.col("rank") == 1), on=[*key, "sample_id"], suffix="_1"
    )
    firsts = (
        pairs.filter(pl.col("value") != pl.col("value_1"))
        .group_by(key)
        .agg(pl.col("sample_id").min())
    )
    expected = dict(zip(firsts.select(key).rows(), firsts["sample_id"], strict=True))
    assert not any(k[0] == "layers.0" for k in expected)  # no type is on both ranks
    assert any(k[0] == "layers.1" for k in expected)  # the ReLUs differ

    outputs = run_blocks(parent / "index.md")
    found = query_csv(outputs[4])
    assert dict(zip(found.select(key).rows(), found["first_sample"], strict=True)) == expected
    assert set(found["layer"]) == {"layers.1"}

    compared = csv("compare", parent).filter(pl.col("first_departure").is_not_null())
    assert (
        dict(zip(compared.select(key).rows(), compared["first_departure"], strict=True)) == expected
    )

    latest = query_csv(outputs[2])
    first = latest.filter(pl.col("layer") == "layers.0")
    assert sorted(first["module_type"].to_list()) == ["Conv1d", "Conv1d", "Linear", "Linear"]
