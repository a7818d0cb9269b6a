"""`compare` against a run that recorded no samples (observed, then removed before any sampled
forward): its history holds no rows, which `compare` says first, not as every layer of the other
run being "only in A"."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import cli_in_process as cli

LAYERS = 3


def observed(directory: Path, forwards: int) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(forwards):
        model(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no sample was recorded": the run this test needs
        remove_observer(model)
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("runs")
    return observed(base / "sampled", 3), observed(base / "unsampled", 0)


def test_compare_against_a_run_without_samples_says_it_recorded_none(
    runs: tuple[Path, Path],
) -> None:
    sampled, unsampled = runs
    for a, b, empty, other in ((sampled, unsampled, "B", "A"), (unsampled, sampled, "A", "B")):
        result = cli("compare", a, b, "--width", "200")
        assert result.returncode == 0, result.stderr
        first = result.stdout.splitlines()[0]
        assert first.startswith(f"warning: {empty} recorded no samples"), first
        assert f"only in {other}" not in result.stdout
        assert "only in" not in result.stdout
        data = json.loads(cli("compare", a, b, "--format", "json").stdout)
        assert any(f"{empty} recorded no samples" in w for w in data["run"]["warnings"])
        # every series of the sampled run is still listed, absent in the other
        assert {r["layer"] for r in data["rows"]} == {str(i) for i in range(LAYERS)}
        assert {r[f"samples_{empty.lower()}"] for r in data["rows"]} == {0}


def test_compare_of_two_sampled_runs_or_a_narrow_selection_says_no_such_thing(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    sampled, _ = runs
    other = observed(tmp_path / "other", 2)
    result = cli("compare", sampled, other, "--layers", "^0$")
    assert result.returncode == 0, result.stderr
    assert "recorded no samples" not in result.stdout


def test_compare_of_two_runs_without_samples_or_a_choice_they_lack_speaks_of_both(
    runs: tuple[Path, Path],
) -> None:
    """Two runs are "these runs", and their pages and layers "their": the messages said "its
    index.md says why" and "its layers" of two runs."""
    sampled, unsampled = runs
    result = cli("compare", unsampled, unsampled)
    assert result.returncode == 1
    assert result.stderr.strip().endswith(
        "these runs recorded no rows (no sample was taken; their index.md files say why): "
        "nothing to show"
    )
    result = cli("compare", sampled, sampled, "--layers", "zzz")
    assert result.returncode == 1
    assert "matches no layer with rows in these runs; their layers with rows: '0'" in result.stderr
