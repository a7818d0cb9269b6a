"""Benchmark of the history writer and merge.

1. Time per `HistoryWriter.append` of one sample (50 layers x 9 metrics = 450 rows) near sample 10
   and near sample N (default 100,000): the ratio shows per-sample cost does not grow with history.
2. Peak RSS of `merge_parts` (in a fresh child process) for the history just written, next to its
   size on disk: memory follows the merge range size, not the history.

Note: bench/statistics.py shadows the stdlib `statistics` module here; do not import it.

Run: `uv run bench/history.py [--samples 100000] [--dir /tmp/ti-bench]`.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from torchinstruments.history import HistoryConfig, HistoryWriter, list_parts
from torchinstruments.records import Measurement, MetricValue

METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")
LAYERS = tuple(f"blocks.{i}.mlp" for i in range(50))


def sample(s: int) -> list[Measurement]:
    values = tuple(MetricValue(float(s % 97) + i / 10) for i in range(len(METRICS)))
    return [
        Measurement(
            s,
            4 * s,
            1_700_000_000_000_000 + s,
            None,
            layer,
            "Linear",
            0,
            "output",
            "",
            (32, 128),
            "float32",
            "train",
            True,
            METRICS,
            values,
        )
        for layer in LAYERS
    ]


def write(directory: Path, samples: int, probe: int = 200) -> tuple[float, float]:
    """Median seconds per append around sample 10 and around the last sample."""
    writer = HistoryWriter(directory, HistoryConfig())
    early: list[float] = []
    late: list[float] = []
    for s in range(samples):
        batch = sample(s)  # built outside the timed call: we time the writer only
        t0 = time.perf_counter()
        writer.append(batch)
        dt = time.perf_counter() - t0
        if s < probe:
            early.append(dt)
        elif s >= samples - probe:
            late.append(dt)
    writer.flush()
    # means, so that the part writes falling in each probe (one per ~18 samples) are counted
    return sum(early) / len(early), sum(late) / len(late)


MERGE_CHILD = """
import resource, sys, time
from pathlib import Path
from torchinstruments.history import merge_parts
t0 = time.perf_counter()
merge_parts(Path(sys.argv[1]))
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ti-bench-history"))
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    t0 = time.perf_counter()
    early, late = write(args.dir, args.samples)
    rows = args.samples * len(LAYERS) * len(METRICS)
    print(f"wrote {args.samples} samples = {rows:,} rows in {time.perf_counter() - t0:.1f} s")
    print(f"append, mean of 200 around sample 10:       {early * 1e6:8.1f} us")
    print(f"append, mean of 200 around sample {args.samples:,}: {late * 1e6:8.1f} us")
    print(f"ratio late/early: {late / early:.2f}")
    parts = list_parts(args.dir)
    size = sum(p.stat().st_size for p in parts)
    out = subprocess.run(
        [sys.executable, "-c", MERGE_CHILD, str(args.dir)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    merged = (args.dir / "history.parquet").stat().st_size
    print(
        f"merge of {len(parts)} parts ({size / 2**20:.0f} MiB on disk, {rows:,} rows): "
        f"{float(out[0]):.1f} s, peak RSS {float(out[1]):.0f} MiB; "
        f"history.parquet {merged / 2**20:.0f} MiB"
    )
    print(
        f"bench process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
