"""index.md: content, run-info round trip, and every Polars query in it runs on real files."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import polars as pl
import pytest

from torchinstruments.records import LayerInfo, Measurement, MetricValue, RunCounts, RunInfo
from torchinstruments.rundir.index_page import read_run_info, render_index, write_index
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.writer import HistoryConfig, HistoryWriter


def run_info(directory: Path, rank: int | None = None) -> RunInfo:
    return RunInfo(
        output_dir=directory,
        library_version="0.1.0",
        torch_version="2.15.0",
        model_class="tests.Net",
        layers=(LayerInfo("encoder.0", "Linear"), LayerInfo("head", "Linear")),
        focus_layers=("encoder.0",),
        sampler="EveryNForwardsSampler(every=4)",
        metrics=("mean", "std"),
        rank=rank,
        world_size=None if rank is None else 2,
        rank_policy="all" if rank is not None else "rank0",
        capture_direct_forwards=True,
        buffer_rows=8192,
        window=10,
        started_at="2026-01-01T00:00:00+00:00",
    )


def write_history(directory: Path, rank: int | None, keep_parts: bool = False) -> None:
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=5))
    for s in range(6):
        for signal in ("output", "output_gradient"):
            writer.append(
                [
                    Measurement(
                        s,
                        s,
                        s,
                        rank,
                        layer,
                        "Linear",
                        0,
                        signal,
                        "",
                        (2, 2),
                        "float32",
                        "train",
                        True,
                        ("mean", "std"),
                        (MetricValue(s * 1.0), MetricValue(None, "empty tensor")),
                    )
                    for layer in ("encoder.0", "head")
                ]
            )
    writer.flush()
    if keep_parts:
        shutil.copytree(directory / "history.parts", directory / "parts.copy")
    writer.close()
    merge_history(directory)
    if keep_parts:
        (directory / "parts.copy").rename(directory / "history.parts")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_page_documents_the_run(tmp_path: Path) -> None:
    text = render_index(run_info(tmp_path), RunCounts(100, 25, 24))
    for needle in (
        "torchinstruments 0.1.0",
        "torch 2.15.0",
        "tests.Net",
        "`encoder.0` (Linear)",
        "EveryNForwardsSampler(every=4)",
        "rank_policy='rank0'",
        "100 root forwards",
        "25 samples",
        "empty tensor",
        "no finite entries",
        "unsupported dtype",
        "unsupported layout",
        "non-finite result",
        "reducer error: <Type>: <message>",
        "reducer returned no value",
        "measurement error",
        "population standard deviation",
        "linear interpolation",
        "original element count",
        "parameter gradients",
        "not the statistic of the pooled elements",
        "`[1]['k']`",
        ".hidden",
        "rank-*/history.parquet",
    ):
        assert needle in text, needle
    for column in ("sample_id", "unavailable_reason", "shape", "grad_enabled"):
        assert f"| {column} |" in text
    assert "in progress" in render_index(run_info(tmp_path), None)


def test_run_info_round_trip(tmp_path: Path) -> None:
    run = run_info(tmp_path, rank=1)
    write_index(tmp_path, run, None)
    assert read_run_info(tmp_path) == run


def test_missing_block_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "index.md").write_text("# hand-written\n", encoding="utf-8")
    with pytest.raises(ValueError, match="run-info"):
        read_run_info(tmp_path)


def test_every_query_runs_on_a_real_history(tmp_path: Path) -> None:
    write_history(tmp_path, rank=None, keep_parts=True)
    blocks = python_blocks(render_index(run_info(tmp_path), RunCounts(6, 6, 6)))
    assert len(blocks) == 5
    for code in blocks:
        namespace: dict = {}
        exec(compile(code, "<index.md>", "exec"), namespace)
        frames = [v for v in namespace.values() if isinstance(v, pl.DataFrame)]
        assert frames, code
        assert all(f.height > 0 for f in frames), code


def test_rank_comparison_query_runs(tmp_path: Path) -> None:
    for rank in (0, 1):
        write_history(tmp_path / f"rank-{rank:03d}", rank=rank)
    text = render_index(run_info(tmp_path / "rank-001", rank=1), RunCounts(6, 6, 6))
    blocks = [b for b in python_blocks(text) if "rank-*" in b]
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "<index.md>", "exec"), namespace)
    ranks = namespace["ranks"].select(pl.col("rank").unique().sort()).collect()
    assert ranks["rank"].to_list() == [0, 1]
