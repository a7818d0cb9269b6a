"""Benchmark: `torchinstruments heatmap` on a 3,000-layer run with 500 samples.

Acceptance text this measures (issue 21): "a few seconds at 3,000 layers x 500 samples".

The run directory has the shape of the 3,000-layer model of bench/many_layers.py (1,000 blocks of
`Linear`, `ReLU`, `LayerNorm`, named `0.0` ... `999.2`), every layer measured at every sample, both
signals, the nine default metrics: 27,000,000 history rows. A real run that long takes hours on a
shared CPU, so the rows are written here (random values; the heatmap's cost does not depend on
them) as parts in the library's order and merged with the library's own `merge_history`; the
state file and index.md are the library's, from a `RunState`. Timed: `torchinstruments heatmap`
as a user runs it, in a fresh process (imports included, byte-compiled as in an installed
environment, so PYTHONDONTWRITEBYTECODE is dropped for it; one warm-up run), for one metric (one image: read,
grid, draw, PNG), then for all nine; wall and CPU seconds (user + system, all threads) and the
peak RSS of that process, best and median of `--rounds`.

Run: `uv run bench/heatmap.py` (or `--blocks 100 --samples 50` for a quick look; `--keep DIR`
builds the run once, about 8 minutes on a shared 2-core machine, and reuses it after).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import LayerInfo, RunCounts, RunInfo
from torchinstruments.rundir.index_page import write_index
from torchinstruments.rundir.layout import HISTORY_SCHEMA, part_path, write_parquet_atomic
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.state import RunState, write_state

from _machine import print_machine
from _timing import median

METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")
TYPES = ("Linear", "ReLU", "LayerNorm")
SAMPLES_PER_PART = 25


def layers(blocks: int) -> list[LayerInfo]:
    return [LayerInfo(f"{b}.{i}", TYPES[i]) for b in range(blocks) for i in range(3)]


def samples_frame(catalog: list[LayerInfo], first: int, count: int, seed: int) -> pl.DataFrame:
    """`count` samples from `first` on: every layer, both signals, every metric."""
    n_layers, n_metrics = len(catalog), len(METRICS)
    per_sample = 2 * n_layers * n_metrics
    rows = count * per_sample
    sample = np.repeat(np.arange(first, first + count), per_sample)
    signal = np.tile(
        np.repeat(np.array(["output", "output_gradient"]), n_layers * n_metrics), count
    )
    layer = np.tile(np.repeat(np.arange(n_layers), n_metrics), 2 * count)
    metric = np.tile(np.arange(n_metrics), 2 * n_layers * count)
    names = pl.Series([li.name for li in catalog])
    types = pl.Series([li.module_type for li in catalog])
    frame = pl.DataFrame(
        {
            "sample_id": sample,
            "forward_index": sample,
            "timestamp": (1_700_000_000_000_000 + sample).astype("datetime64[us]"),
            "rank": pl.Series([None] * rows, dtype=pl.Int32),
            "layer": names.gather(layer),
            "module_type": types.gather(layer),
            "call_index": np.zeros(rows, dtype=np.int32),
            "signal": signal,
            "tensor_path": pl.Series([""] * rows),
            "shape": pl.Series([[4, 8]] * rows, dtype=pl.List(pl.Int64)),
            "dtype": pl.Series(["float32"] * rows),
            "mode": pl.Series(["train"] * rows),
            "grad_enabled": np.ones(rows, dtype=bool),
            "metric": pl.Series(METRICS).gather(metric),
            "value": np.random.default_rng(seed).normal(size=rows),
            "unavailable_reason": pl.Series([None] * rows, dtype=pl.String),
        }
    )
    return frame.with_columns(pl.col("timestamp").dt.replace_time_zone("UTC")).cast(HISTORY_SCHEMA)


def build(directory: Path, blocks: int, samples: int) -> int:
    """Write the run directory; returns its number of history rows."""
    catalog = layers(blocks)
    (directory / "history.parts").mkdir(parents=True)
    rows = 0
    for number, first in enumerate(range(0, samples, SAMPLES_PER_PART)):
        frame = samples_frame(catalog, first, min(SAMPLES_PER_PART, samples - first), number)
        write_parquet_atomic(frame, part_path(directory, number))
        rows += frame.height
    merge_history(directory)
    run = RunInfo(
        output_dir=directory,
        library_version="bench",
        torch_version="bench",
        model_class="Sequential",
        layers=tuple(catalog),
        focus_layers=tuple(li.name for li in catalog[:8]),
        sampler="EveryNForwardsSampler(n=1)",
        metrics=METRICS,
        rank=None,
        world_size=None,
        rank_policy="rank0",
        capture_direct_forwards=True,
        history=HistoryConfig(buffer_rows=8192, window=10, flush_seconds=60.0),
        started_at="2026-01-01T00:00:00+00:00",
    )
    counts = RunCounts(samples, samples, samples, {li.name: samples for li in catalog})
    state = RunState(run, counts, rows_recorded=rows)
    write_state(directory, state)
    write_index(directory, state)
    return rows


def timed(directory: Path, out: Path, metrics: tuple[str, ...]) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MiB) of `torchinstruments heatmap` in a fresh process."""
    argv = [sys.executable, "-m", "torchinstruments", "heatmap", str(directory), "-o", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    child = subprocess.Popen(
        [*argv, "--metrics", ",".join(metrics)], stdout=subprocess.DEVNULL, env=env
    )
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"heatmap failed with exit code {child.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="build the run in DIR once and reuse it after"
    )
    args = parser.parse_args()
    print_machine()
    with tempfile.TemporaryDirectory() as tmp:
        directory, out = args.keep or Path(tmp) / "run", Path(tmp) / "images"
        out.mkdir()
        start = time.perf_counter()
        if not (directory / "history.parquet").exists():
            build(directory, args.blocks, args.samples)
        rows = pl.scan_parquet(directory / "history.parquet", glob=False).select(pl.len())
        print(
            f"{3 * args.blocks} layers x {args.samples} samples: {rows.collect().item():,} rows, "
            f"history.parquet {(directory / 'history.parquet').stat().st_size / 2**20:.0f} MiB "
            f"(ready in {time.perf_counter() - start:.0f} s)"
        )
        timed(directory, out, ("mean",))  # warm-up: compiles the imports once, as installs do
        for label, metrics in (("one metric (std)", ("std",)), ("all nine metrics", METRICS)):
            runs = [timed(directory, out, metrics) for _ in range(args.rounds)]
            walls, cpus, peaks = zip(*runs, strict=True)
            print(
                f"{label}: wall best {min(walls):.2f} s, median {median(list(walls)):.2f} s; "
                f"CPU (all threads) best {min(cpus):.2f} s, median {median(list(cpus)):.2f} s; "
                f"peak RSS {max(peaks):.0f} MiB"
            )
        image = out / "heatmap-std.png"
        print(
            f"{image.name}: {image.stat().st_size / 2**10:.0f} KiB (random values compress badly)"
        )


if __name__ == "__main__":
    main()
