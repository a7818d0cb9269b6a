"""Benchmark: what small, frequent parts cost the merge at removal.

Why: a part is written when the buffer holds `buffer_rows` rows or when its oldest row is older
than the flush interval (`HistoryConfig.flush_seconds`, default 60 s). A model sampled once a
minute therefore writes about one part per sample: a day of training is 1,440 parts. This
measures the merge of those 1,440 parts against the merge of exactly the same rows written in
large parts (the default `buffer_rows=8192`, and a few parts of 400,000 rows).

Each sample covers 56 layers x 9 default metrics x 2 signals = 1,008 rows (the transformer of
bench/history.py), one sample per simulated minute: 1,440 samples, 1,451,520 rows. Parts are
written by the library's own `HistoryWriter`; the timed region is `merge_history(directory)`
alone (listing, reading, sorting in sample ranges, writing history.parquet, deleting the parts),
on a fresh copy of the parts for every round. Best and median of `--rounds` are reported.

Run: `uv run bench/merge_parts.py` (or `--rounds 5`, `--samples 2880` for two days).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from torchinstruments.history_config import HistoryConfig
from torchinstruments.measurement.reducers import DEFAULT_METRICS
from torchinstruments.records import Measurement, MetricValue
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.writer import HistoryWriter

from _machine import print_machine
from _timing import median

BLOCKS = 14
SUBLAYERS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
LAYERS = tuple(f"blocks.{b}.{name}" for b in range(BLOCKS) for name in SUBLAYERS)  # 56
ROWS_PER_SAMPLE = len(LAYERS) * len(DEFAULT_METRICS) * 2
START_US = 1_700_000_000_000_000
MINUTE_US = 60_000_000


def sample(sample_id: int, rng: random.Random) -> list[Measurement]:
    """One sampled forward and its backward: 1,008 rows, one simulated minute after the last."""
    timestamp = START_US + sample_id * MINUTE_US
    return [
        Measurement(
            sample_id=sample_id,
            forward_index=sample_id * 50,
            timestamp_us=timestamp,
            rank=None,
            layer=layer,
            module_type="Linear",
            call_index=0,
            signal=signal,
            tensor_path="",
            shape=(32, 128, 384),
            dtype="float32",
            mode="train",
            grad_enabled=True,
            metrics=DEFAULT_METRICS,
            values=tuple(MetricValue(rng.gauss(0.0, 1.0)) for _ in DEFAULT_METRICS),
        )
        for signal in ("output", "output_gradient")
        for layer in LAYERS
    ]


def write_parts(directory: Path, samples: int, buffer_rows: int) -> int:
    """Write `samples` samples as parts of `buffer_rows` rows; returns the number of parts."""
    rng = random.Random(0)
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=buffer_rows))
    for sample_id in range(samples):
        writer.append(sample(sample_id, rng))
    writer.flush()
    return sum(1 for _ in (directory / "history.parts").iterdir())


def time_merge(source: Path, scratch: Path, rounds: int, rows: int) -> list[float]:
    """Seconds of `merge_history` on a fresh copy of `source`, `rounds` times."""
    times = []
    for i in range(rounds):
        copy = scratch / f"round-{i}"
        shutil.copytree(source, copy)
        start = time.perf_counter()
        result = merge_history(copy)
        times.append(time.perf_counter() - start)
        assert result.rows == rows, (result.rows, rows)
        shutil.rmtree(copy)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1440, help="one per simulated minute")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print_machine()
    rows = args.samples * ROWS_PER_SAMPLE
    layouts = (
        ("one part per sample (flush interval)", ROWS_PER_SAMPLE),
        ("default buffer_rows=8192", 8192),
        ("a few large parts (400,000 rows)", 400_000),
    )
    print(f"{args.samples} samples x {ROWS_PER_SAMPLE} rows = {rows:,} rows; {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, buffer_rows in layouts:
            source = root / f"parts-{buffer_rows}"
            parts = write_parts(source, args.samples, buffer_rows)
            times = time_merge(source, root, args.rounds, rows)
            print(
                f"{name}: {parts} parts, merge best {min(times):.2f} s, "
                f"median {median(times):.2f} s"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
