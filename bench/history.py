"""Benchmark of the history table: per-sample write cost over a long run, and removal of it.

Acceptance text this measures: "per-sample cost at samples 1-200 vs 9,800-10,000 (ratio must stay
within 1.2), and removal of a 10,000,000-row history: wall time and peak RSS (target: peak RSS
growth under 1 GiB, bytes per row on disk reported)".

1. Writing. A sample is what the observer hands the `HistoryWriter`: one `append` with the
   forward measurements, one with the backward measurements. Here a sample covers 56 layers x 9
   default metrics x 2 signals = 1,008 rows, so the default 10,000 samples give 10,080,000 rows.
   Each sample's two appends are timed together (the measurements are built outside the timed
   region: we time the writer, not this script), including the Parquet part writes that fall
   due (one per `buffer_rows` rows: 65,536 by default, about every 65 samples). Mean and median
   of the first 200 and the last 200 samples are compared: the mean carries the amortised part
   writes, the median the plain buffering cost. A ratio near 1 shows that cost does not grow
   with history.
2. Removal, in a fresh child process so its RSS is the removal's alone: `merge_history`
   (the bounded-memory merge of all parts into history.parquet) and
   `summary.write_result` (result.json), which is what `remove_observer` does with the history.
   The parent flushes its last short part before the child starts, so the child's flush is empty;
   index.md and TensorBoard are not included (they do not depend on history size). Peak RSS is
   the child's `ru_maxrss`; growth is measured over its high-water mark right after the imports.

Values are Gaussian random floats (not a repeating pattern), timestamps advance by real time, so
Parquet's dictionary and run-length encodings get no unrealistic help and bytes per row are honest.

Note: bench/statistics.py shadows the stdlib `statistics` module here; the median comes from
`_timing`.

Run: `uv run bench/history.py` (10,000 samples, ~10 M rows; several minutes), or
`uv run bench/history.py --quick` (1,000 samples), or `--samples N`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

from torchinstruments.history_config import HistoryConfig
from torchinstruments.measurement.reducers import DEFAULT_METRICS
from torchinstruments.records import Measurement, MetricValue
from torchinstruments.rundir.layout import HISTORY_FILE, list_parts
from torchinstruments.rundir.writer import HistoryWriter

from _machine import print_machine
from _timing import median

BLOCKS = 14
SUBLAYERS = (("attn.qkv", (32, 128, 1152)), ("attn.proj", (32, 128, 384)))
SUBLAYERS += (("mlp.fc1", (32, 128, 1536)), ("mlp.fc2", (32, 128, 384)))
LAYERS = tuple(
    (f"blocks.{b}.{name}", shape) for b in range(BLOCKS) for name, shape in SUBLAYERS
)  # 56 layers
ROWS_PER_SAMPLE = len(LAYERS) * len(DEFAULT_METRICS) * 2
PROBE = 200
CONFIG = HistoryConfig()


def measurements(rng: random.Random, s: int, signal: str) -> list[Measurement]:
    """One signal's measurements of sample `s`: every layer, all default metrics, random values."""
    now = time.time_ns() // 1000
    scale = 1.0 if signal == "output" else 1e-4
    return [
        Measurement(
            s,
            4 * s,
            now,
            None,
            layer,
            "Linear",
            0,
            signal,
            "",
            shape,
            "float32",
            "train",
            True,
            DEFAULT_METRICS,
            tuple(MetricValue(rng.gauss(0.0, scale)) for _ in DEFAULT_METRICS),
        )
        for layer, shape in LAYERS
    ]


def write(directory: Path, samples: int) -> list[float]:
    """Write `samples` samples; returns the seconds spent in the writer for each sample."""
    rng = random.Random(12345)
    writer = HistoryWriter(directory, CONFIG)
    cost: list[float] = []
    for s in range(samples):
        forward = measurements(rng, s, "output")
        backward = measurements(rng, s, "output_gradient")
        t0 = time.perf_counter()
        writer.append(forward)
        writer.append(backward)
        cost.append(time.perf_counter() - t0)
    writer.flush()  # the last, short part; see the module docstring
    return cost


REMOVAL_CHILD = """
import json, resource, sys, time
from pathlib import Path
from torchinstruments.records import LayerInfo
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.summary import write_result
from torchinstruments.history_config import HistoryConfig

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

directory = Path(sys.argv[1])
layers = [LayerInfo(name, "Linear") for name in json.loads(sys.argv[2])]
config = HistoryConfig()
baseline = peak_mib()
t0 = time.perf_counter()
merge_history(directory)
t1 = time.perf_counter()
after_merge = peak_mib()
write_result(directory, layers, config.window)
t2 = time.perf_counter()
print(json.dumps({"baseline": baseline, "merge_s": t1 - t0, "merge_peak": after_merge,
                  "result_s": t2 - t1, "peak": peak_mib()}))
"""


def remove(directory: Path) -> dict[str, float]:
    """Run the removal in a fresh child process; returns its timings and peak RSS (MiB)."""
    names = json.dumps([name for name, _ in LAYERS])
    out = subprocess.run(
        [sys.executable, "-c", REMOVAL_CHILD, str(directory), names],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000, help="samples to write")
    parser.add_argument("--quick", action="store_true", help="1,000 samples")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ti-bench-history"))
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args()
    print_machine()
    samples = 1_000 if args.quick else args.samples
    probe = min(PROBE, samples // 2)
    if probe < 1:
        parser.error("--samples must be at least 2")
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)

    rows = samples * ROWS_PER_SAMPLE
    print(
        f"{samples:,} samples x {ROWS_PER_SAMPLE:,} rows ({len(LAYERS)} layers x "
        f"{len(DEFAULT_METRICS)} metrics x 2 signals) = {rows:,} rows; "
        f"buffer_rows={CONFIG.buffer_rows:,}; {os.cpu_count()} CPUs"
    )
    t0 = time.perf_counter()
    cost = write(args.dir, samples)
    parts = list_parts(args.dir)
    parts_bytes = sum(p.stat().st_size for p in parts)
    print(
        f"writing took {time.perf_counter() - t0:.1f} s wall ({sum(cost):.1f} s in the writer); "
        f"{len(parts):,} parts, {parts_bytes / 2**20:.0f} MiB"
    )
    early, late = cost[:probe], cost[-probe:]
    first = f"samples 1-{probe}"
    last = f"samples {samples - probe + 1:,}-{samples:,}"
    print()
    print(f"| per-sample writer cost (2 appends) | {first} | {last} | ratio late/early |")
    print("| --- | ---: | ---: | ---: |")
    for name, stat in (("mean", lambda v: sum(v) / len(v)), ("median", median)):
        a, b = stat(early), stat(late)
        print(f"| {name} | {a * 1e6:,.0f} us | {b * 1e6:,.0f} us | {b / a:.2f} |")

    removal = remove(args.dir)
    merged = args.dir / HISTORY_FILE
    merged_rows = pl.scan_parquet(merged).select(pl.len()).collect().item()
    if merged_rows != rows:
        raise SystemExit(f"history.parquet holds {merged_rows:,} rows, expected {rows:,}")
    size = merged.stat().st_size
    baseline = removal["baseline"]
    print()
    print(f"| removal of {rows:,} rows (fresh process) | value |")
    print("| --- | ---: |")
    print(f"| merge (merge_history) | {removal['merge_s']:.1f} s |")
    print(f"| result.json (summary.write_result) | {removal['result_s']:.1f} s |")
    print(f"| total wall time | {removal['merge_s'] + removal['result_s']:.1f} s |")
    print(f"| RSS after imports (baseline) | {baseline:,.0f} MiB |")
    print(f"| peak RSS after merge | {removal['merge_peak']:,.0f} MiB |")
    print(f"| peak RSS after result.json | {removal['peak']:,.0f} MiB |")
    print(
        f"| peak RSS growth over baseline (target < 1,024) | {removal['peak'] - baseline:,.0f} MiB |"
    )
    print(f"| history.parquet on disk | {size / 2**20:,.1f} MiB |")
    print(f"| bytes per row on disk | {size / rows:.2f} |")
    print(f"| parts on disk before the merge, bytes per row | {parts_bytes / rows:.2f} |")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
