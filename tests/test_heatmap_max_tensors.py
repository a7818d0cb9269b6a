"""`torchinstruments heatmap` of more tensors than its rows can label: the first 60 (traversal
order) by default, `--max-tensors N` for another count, the rest counted in the image and named
on stderr. Each drawn cell is checked against history.parquet (`conftest.check_heatmap`) over
the drawn tensors' rows alone, as the image's colour scale is."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import check_heatmap, read_heatmap
from conftest import cli_in_process as cli

PAIRS = 35  # 35 x (Linear, Tanh): 70 tensors
STEPS = 3
NAMES = [str(i) for i in range(2 * PAIRS)]  # nn.Sequential's layer names, in traversal order


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deep") / "stats"
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(PAIRS) for m in (nn.Linear(4, 4), nn.Tanh())])
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(STEPS):
        model(torch.randn(8, 4)).sum().backward()
    remove_observer(model)
    return directory


def drawn_history(run: Path, names: list[str]) -> pl.DataFrame:
    return pl.read_parquet(run / "history.parquet").filter(pl.col("layer").is_in(names))


def test_heatmap_of_many_tensors_draws_the_first_60_and_says_how_many_it_left_out(
    deep: Path, tmp_path: Path
) -> None:
    result = cli("heatmap", deep, "--metrics", "mean,std", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "60 tensors x 3 samples" in result.stdout
    assert "10 tensors left out (60, 61, 62, 63, 64, ...)" in result.stderr
    assert "raise --max-tensors" in result.stderr
    history = drawn_history(deep, NAMES[:60])
    for metric in ("mean", "std"):  # the same tensors in every image
        png = tmp_path / f"heatmap-{metric}.png"
        tensors = [(name, 0, "") for name in NAMES[:60]]
        _, meta = check_heatmap(png, history, metric, tensors, "sample_id")
        assert meta["left_out"] == NAMES[60:]
        assert meta["panels"][0]["cell_height"] > 1  # each row readable, not a pixel


def test_max_tensors_draws_that_many_and_every_tensor_when_it_is_enough(
    deep: Path, tmp_path: Path
) -> None:
    few = tmp_path / "few"
    few.mkdir()
    result = cli("heatmap", deep, "--metrics", "std", "--max-tensors", "5", "-o", few)
    assert result.returncode == 0, result.stderr
    assert "65 tensors left out" in result.stderr
    tensors = [(name, 0, "") for name in NAMES[:5]]
    check_heatmap(
        few / "heatmap-std.png", drawn_history(deep, NAMES[:5]), "std", tensors, "sample_id"
    )

    every = tmp_path / "every"
    every.mkdir()
    result = cli("heatmap", deep, "--metrics", "std", "--max-tensors", "70", "-o", every)
    assert result.returncode == 0, result.stderr
    assert "left out" not in result.stderr
    _, meta = read_heatmap(every / "heatmap-std.png")
    assert [row[0] for row in meta["rows"]] == NAMES
    assert meta["left_out"] == []
    with pytest.raises(SystemExit) as refused:  # a usage error, as plot's --max-tensors 0
        cli("heatmap", deep, "--max-tensors", "0", "-o", every)
    assert refused.value.code == 2


def test_heatmap_of_a_parent_keeps_max_tensors_ranks_and_says_which_it_left_out(
    tmp_path: Path,
) -> None:
    """On a directory of rank runs the rows are one tensor's ranks: `--max-tensors N` keeps the
    N lowest, as `plot PARENT` does (by default, every rank)."""
    parent = tmp_path / "stats"
    for rank in range(3):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", str(rank))
            env.setenv("WORLD_SIZE", "3")
            model = nn.Linear(4, 4)
            inject_observer(
                model, output_dir=parent, sampler=EveryNForwardsSampler(1), rank_policy="all"
            )
        model(torch.randn(2, 4)).sum().backward()
        remove_observer(model)
    result = cli("heatmap", parent, "--metrics", "std", "--max-tensors", "2")
    assert result.returncode == 0, result.stderr
    assert "1 rank left out (rank 2" in result.stderr
    _, meta = read_heatmap(parent / "heatmap-ranks-std.png")
    assert [row[0] for row in meta["rows"]] == ["rank 000: <root>", "rank 001: <root>"]
    result = cli("heatmap", parent, "--metrics", "std")
    assert "left out" not in result.stderr
    _, meta = read_heatmap(parent / "heatmap-ranks-std.png")
    assert len(meta["rows"]) == 3
