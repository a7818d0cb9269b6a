"""Run directories are used literally: glob characters, `~`, spaces, non-ASCII, and `os.chdir`.

Polars reads a path string as a glob pattern unless told otherwise, so a directory named like a
sweep (`exp[lr=0.1]`) or one whose name matches a sibling's as a pattern (`a?b` next to `axb`)
must still read exactly its own parts. Every run here writes several parts (`buffer_rows` is one
sample's forward rows), so the merge really has parts to find.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)

from conftest import read_result, run_status

STEPS = 4
LAYERS = 2  # Linear, ReLU
FORWARD_ROWS = LAYERS * len(DEFAULT_METRICS)
CONFIG = HistoryConfig(buffer_rows=FORWARD_ROWS)

NAMES = [
    "exp[lr=0.1]",
    "a?b",
    "st*r",
    "{x,y}",
    "~tilde",
    "with space",
    "ünïcödé ✓ 実験",
    "[",
    "]?*{}~ all",
]


def run(directory: str | Path, scale: float = 1.0) -> tuple[Path | None, list[float]]:
    """Observe STEPS forwards (no backward) of a tiny model; returns inject's directory and the
    Linear output means, computed independently of the library."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    returned = inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    expected = []
    try:
        for step in range(STEPS):
            x = torch.full((2, 3), scale * (step + 1))
            with torch.no_grad():
                model(x)
                expected.append(model[0](x).mean().item())
    finally:
        remove_observer(model)
    return returned, expected


def linear_means(directory: Path) -> list[float]:
    history = pl.read_parquet(directory / "history.parquet", glob=False)
    return (
        history.filter((pl.col("layer") == "0") & (pl.col("metric") == "mean"))
        .sort("sample_id")["value"]
        .to_list()
    )


def assert_complete(directory: Path, expected_means: list[float]) -> None:
    """history.parquet holds exactly this run's rows; parts merged; summaries; index complete."""
    history = pl.read_parquet(directory / "history.parquet", glob=False)
    assert history.height == STEPS * FORWARD_ROWS
    assert linear_means(directory) == pytest.approx(expected_means, rel=1e-6)
    assert not (directory / "history.parts").exists()
    result = read_result(directory)
    assert result[0]["tensors"][0]["observations"] == STEPS
    assert run_status(directory) == "complete"


@pytest.mark.parametrize("name", NAMES)
def test_glob_characters_spaces_and_non_ascii_names_are_literal(tmp_path: Path, name: str) -> None:
    directory = tmp_path / name
    returned, expected = run(directory)
    assert returned == directory
    assert_complete(directory, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written elsewhere


def test_sibling_matching_as_a_glob_contributes_no_rows(tmp_path: Path) -> None:
    _, expected_other = run(tmp_path / "axb", scale=100.0)
    _, expected = run(tmp_path / "a?b", scale=1.0)
    assert_complete(tmp_path / "a?b", expected)
    assert_complete(tmp_path / "axb", expected_other)  # and the sibling is untouched


def test_sibling_pattern_directory_is_not_read_while_live(tmp_path: Path) -> None:
    """The other way round: `a*` exists first, then `ab` runs; `a*` keeps only its rows."""
    _, expected_star = run(tmp_path / "a*", scale=3.0)
    _, expected = run(tmp_path / "ab", scale=1.0)
    assert_complete(tmp_path / "a*", expected_star)
    assert_complete(tmp_path / "ab", expected)


def test_tilde_is_expanded_once_at_inject(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    returned, expected = run("~/runs/x")
    assert returned == home / "runs" / "x"
    assert returned is not None
    assert returned.is_absolute()
    assert_complete(home / "runs" / "x", expected)
    assert list(work.iterdir()) == []  # no literal ./~ directory


def test_relative_dir_survives_chdir_after_inject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    returned = inject_observer(
        model, output_dir="rel/stats", sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    assert returned == start / "rel" / "stats"
    os.chdir(elsewhere)  # what Hydra-style launchers do after the program started
    expected = []
    try:
        for step in range(STEPS):
            x = torch.full((2, 3), float(step + 1))
            with torch.no_grad():
                model(x)
                expected.append(model[0](x).mean().item())
    finally:
        remove_observer(model)
    assert_complete(start / "rel" / "stats", expected)
    assert list(elsewhere.iterdir()) == []


def deep_folder(tmp_path: Path, length: int) -> Path:
    """An existing folder whose absolute path is at least `length` bytes (200-byte names)."""
    folder = tmp_path
    while len(os.fsencode(folder)) < length:
        folder = folder / ("d" * min(200, length - len(os.fsencode(folder)) + 1))
    folder.mkdir(parents=True)
    return folder


def test_a_deep_output_dir_with_room_for_the_runs_files_writes_a_complete_run(
    tmp_path: Path,
) -> None:
    directory = deep_folder(tmp_path, 3000)
    returned, expected = run(directory)
    assert returned == directory
    assert_complete(directory, expected)


def test_an_output_dir_too_deep_for_the_runs_files_is_refused_at_inject(tmp_path: Path) -> None:
    """Inject succeeding there would lose every row: no part path fits under PATH_MAX."""
    directory = deep_folder(tmp_path, os.pathconf("/", "PC_PATH_MAX") - 200)
    model = nn.Linear(3, 4)
    with pytest.raises(ValueError, match=r"output_dir is \d+ bytes long.*PATH_MAX"):
        inject_observer(model, output_dir=directory)
    assert "forward" not in model.__dict__
    assert list(directory.iterdir()) == []


def test_an_output_dir_with_a_folder_name_over_name_max_is_refused_naming_the_argument(
    tmp_path: Path,
) -> None:
    """`Path.exists` raised a bare `OSError: File name too long` from inject, naming neither."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    for directory in (tmp_path / ("x" * (limit + 1)), tmp_path / ("x" * (limit + 1)) / "run"):
        model = nn.Linear(3, 4)
        with pytest.raises(ValueError, match=rf"^output_dir has a folder name of {limit + 1} "):
            inject_observer(model, output_dir=directory)
        assert "forward" not in model.__dict__
    assert list(tmp_path.iterdir()) == []


def test_an_output_dir_below_a_symbolic_link_to_nothing_is_refused_naming_the_link(
    tmp_path: Path,
) -> None:
    link = tmp_path / "runs"
    link.symlink_to(tmp_path / "missing-volume")
    for directory in (link, link / "exp"):
        model = nn.Linear(3, 4)
        with pytest.raises(
            FileNotFoundError, match=r"output_dir=.*symbolic link to.*missing-volume"
        ):
            inject_observer(model, output_dir=directory)
        assert "forward" not in model.__dict__
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


@pytest.mark.skipif(sys.getfilesystemencoding() != "utf-8", reason="names are bytes as UTF-8")
def test_an_output_dir_whose_name_is_not_utf8_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """A Latin-1 folder name: index.md and the state file are UTF-8, so no run can name it."""
    model = nn.Linear(3, 4)
    with pytest.raises(ValueError, match="output_dir holds bytes that are not UTF-8"):
        inject_observer(model, output_dir=tmp_path / os.fsdecode(b"caf\xe9"))
    assert "forward" not in model.__dict__
    assert list(tmp_path.iterdir()) == []
