"""Readers of a directory of rank runs while a rank's continued run is removed: the removal
puts a history.parquet that holds the parts in place, then takes the parts away. A reader that
listed a rank's files before that and read them after reads the parts' rows twice, or finds
them gone; the readers of a parent list again (`reader.read_each_with`), as the readers of one
run do (`reader.read_with`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from torchinstruments.cli.reader import RunFiles
from torchinstruments.rundir import merge

from conftest import wait_for_rows

ROWS_PER_PART = 2 * len(DEFAULT_METRICS)  # one Linear: its output and its output gradient


def observe(parent: Path, rank: int, *, resume: bool = False, forwards: int) -> nn.Module:
    """Rank `rank` of 2 observes one Linear for `forwards` sampled steps, a part per sample."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", str(rank))
        env.setenv("WORLD_SIZE", "2")
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        inject_observer(
            model,
            output_dir=parent,
            sampler=EveryNForwardsSampler(1),
            history_config=HistoryConfig(buffer_rows=ROWS_PER_PART),
            rank_policy="all",
            resume=resume,
        )
    for i in range(forwards):
        torch.manual_seed(i)
        model(torch.randn(2, 4)).sum().backward()
    return model


@pytest.fixture
def live_parent(tmp_path: Path) -> Iterator[tuple[Path, nn.Module]]:
    """Rank 0 finished with samples 0-2; rank 1 finished with samples 0-2, then continued
    (samples 3-4 in parts beside its history.parquet, not yet removed)."""
    parent = tmp_path / "stats"
    remove_observer(observe(parent, 0, forwards=3))
    remove_observer(observe(parent, 1, forwards=3))
    model = observe(parent, 1, resume=True, forwards=2)
    wait_for_rows(parent / "rank-001", 2 * ROWS_PER_PART)
    yield parent, model
    remove_observer(model)


def merging_once(
    monkeypatch: pytest.MonkeyPatch, module: Any, rank_dir: Path, *, take_parts_away: bool
) -> list[bool]:
    """Make `module.scan_files` of `rank_dir`'s files (listed before) run its removal merge
    first, once: in full, or up to the parts' removal."""
    scan_files: Callable[..., pl.LazyFrame] = module.scan_files
    merged: list[bool] = []

    def merge_first(files: RunFiles, *args: Any, **kwargs: Any) -> pl.LazyFrame:
        if not merged and files.directory == rank_dir:
            with monkeypatch.context() as patch:
                if not take_parts_away:
                    patch.setattr(merge, "_take_parts_away", lambda *_: [])
                merge.merge_history(rank_dir)
            merged.append(True)
        return scan_files(files, *args, **kwargs)

    monkeypatch.setattr(module, "scan_files", merge_first)
    return merged


def test_compare_parent_overtaken_by_a_ranks_removal_lists_the_files_again(
    live_parent: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a rank's removal took its parts away after they were listed, `compare PARENT`
    lists again rather than failing on a file that is gone, and matches each series on the
    3 samples both ranks hold, each rank's rows read once."""
    from torchinstruments.cli import ranks
    from torchinstruments.cli.selection import Selection

    parent, _ = live_parent
    merged = merging_once(monkeypatch, ranks, parent / "rank-001", take_parts_away=True)
    found = ranks.departures(parent, Selection()).frame
    assert merged
    # Independently: each rank's own rows, once each, per series.
    both = [pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet") for rank in (0, 1)]
    assert both[1].height == 5 * ROWS_PER_PART
    assert both[1].select("sample_id", "signal", "metric").is_unique().all()
    assert found.height == 2 * len(DEFAULT_METRICS)
    assert found["matched_samples"].to_list() == [3] * found.height
    assert found["ranks"].to_list() == [2] * found.height


def test_the_samples_apart_check_overtaken_by_a_ranks_removal_lists_the_files_again(
    live_parent: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check that one sample_id is the same root forward on every rank reads each rank's
    files; when a rank's removal took its parts away after they were listed, it lists again
    rather than failing on a file that is gone."""
    from torchinstruments.cli import rank_runs, selection

    parent, _ = live_parent
    merged = merging_once(monkeypatch, selection, parent / "rank-001", take_parts_away=True)
    runs, _ = rank_runs.ranks_with_history(parent, None)
    assert selection.first_sample_apart(runs) is None
    assert merged


def test_a_rank_restarted_into_its_directory_rewrites_the_parent_page_as_it_starts(
    live_parent: tuple[Path, nn.Module],
) -> None:
    """Rank 1 finished, then its job was restarted into the same directory (resume=True): from
    its start, before it finishes, the parent's index.md calls it in progress, never finished
    as the page its earlier attempt wrote did, and how each of its attempts ended."""
    parent, _ = live_parent
    text = (parent / "index.md").read_text(encoding="utf-8")
    assert "**Ranks: 2 rank directories, 1 finished (removed or finalized), world size 2.**" in text
    cells = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 |")]
    state = (
        "in progress when this page was written (its process held its lock; a kill since is "
        "not said here); attempts: 2, continued with resume=True "
        "(removed: attempt 0; in progress: attempt 1)"
    )
    assert cells == [["| 1", "`rank-001/`", state, "-", "- |"]]
    assert [line for line in text.splitlines() if line.startswith("| 0 |")] == [
        "| 0 | `rank-000/` | complete | 3 | 3 |"
    ]


def test_a_parent_page_slow_to_render_never_holds_a_restarted_ranks_inject_nor_loses_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page a restarted rank rewrites at its start reads every rank's state, long on a big
    job: inject waits for it only so long (`PAGE_WAIT_S`) and is never refused for it; the
    rank's removal waits for that render, then writes the page with its own end."""
    from torchinstruments.rundir import parent_rewrite
    from torchinstruments.sinks import directory

    parent = tmp_path / "stats"
    remove_observer(observe(parent, 0, forwards=1))
    remove_observer(observe(parent, 1, forwards=1))
    render, go_on, renders = parent_rewrite.render_parent_index, threading.Event(), []

    def slow(*args: Any) -> str:
        renders.append(True)
        go_on.wait(timeout=120)
        return render(*args)

    monkeypatch.setattr(parent_rewrite, "render_parent_index", slow)
    monkeypatch.setattr(directory, "PAGE_WAIT_S", 0.01)
    model = observe(parent, 1, resume=True, forwards=1)  # returns while the render waits
    assert renders == [True]
    assert "| 1 | `rank-001/` | complete | 1 | 1 |" in (parent / "index.md").read_text()
    go_on.set()
    remove_observer(model)
    assert len(renders) == 2  # the start's, then the removal's own
    ended = "complete; attempts: 2, continued with resume=True (removed: attempts 0-1)"
    assert f"| 1 | `rank-001/` | {ended} | 2 | 2 |" in (parent / "index.md").read_text()
