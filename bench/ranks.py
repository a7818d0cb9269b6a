"""Readers of a multi-rank run: time and peak memory of each at 64 ranks (issue 28).

The case: `--ranks` rank directories (default 64) under one parent, each a finished run of
`--layers` layers (default 300) and `--samples` samples (default 1,000), 2 signals x the 9
default metrics: 5.4 M rows per rank, 346 M in all. They are generated directly, without
training: history.parquet in the library's layout (its schema, order and row groups, written by
`rundir.layout.sink_history`) and a complete `.state.json` (`rundir.state.write_state`), so the
readers see exactly what a `rank_policy="all"` run leaves. Values are random normals, per rank
and row (8 bytes a row: incompressible, the worst case for reading).

Each reader runs in a fresh child process that reports its wall time, CPU time and peak RSS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`, which includes the interpreter and imports:
about 150 MiB for Polars alone, see `show one rank`):

* `show PARENT` (every series: the spread across ranks), `compare PARENT` (every series: the
  first departure), `plot PARENT` and `heatmap PARENT --metrics mean` (one tensor, rank by
  rank), `finalize`'s parent index.md (rendered from the 64 states), the parent index.md's
  "first sample where one rank departs" query (as printed, for one metric), and `show` of one
  rank for scale.
* `ranks finishing together`: every rank's removal rewrites the parent index.md as it ends
  (`rundir.parent_rewrite`); `--ranks` processes forked from this one ask at once, as the ranks
  of a job ending together do. Reported: the median and the longest time one waited (what the
  slowest rank's `remove_observer` pays for the page).

Run: `uv run bench/ranks.py [--ranks 64 --layers 300 --samples 1000] [--dir DIR] [--only NAMES]`
(`--dir` keeps the generated directories, and reuses them when they are already there).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import LayerInfo, RunCounts, RunInfo
from torchinstruments.rundir.layout import HISTORY_FILE, HISTORY_SCHEMA, sink_history
from torchinstruments.rundir.state import RunState, write_state

from _machine import print_machine

METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")
SIGNALS = ("output", "output_gradient")

CHILD = r"""
import contextlib, io, json, resource, sys, time
start, cpu = time.perf_counter(), time.process_time()
what, argv = sys.argv[1], json.loads(sys.argv[2])
out = io.StringIO()
with contextlib.redirect_stdout(out):
    if what == "cli":
        from torchinstruments.__main__ import main
        code = main(argv)
    elif what == "page":
        from pathlib import Path
        from torchinstruments.rundir.parent_rewrite import write_parent_index
        write_parent_index(Path(argv[0]), wait=True)
        code = 0
    else:
        import re
        from pathlib import Path
        text = (Path(argv[0]) / "index.md").read_text()
        blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
        scope = {}
        exec(blocks[0], scope)
        exec(blocks[-1].replace('X = 0.0', 'X = 0.5'), scope)
        code = 0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"code": code, "wall_s": time.perf_counter() - start,
                  "cpu_s": time.process_time() - cpu, "peak_mib": peak,
                  "output_chars": len(out.getvalue())}))
"""


def keys_frame(layers: int, samples: int) -> pl.DataFrame:
    """Every column but `rank` and `value`, in history.parquet's order."""
    per_sample = 2 * layers * len(METRICS)
    sample = np.repeat(np.arange(samples, dtype=np.int64), per_sample)
    within = np.tile(np.arange(per_sample, dtype=np.int64), samples)
    signal = within // (layers * len(METRICS))
    layer = (within // len(METRICS)) % layers
    metric = within % len(METRICS)
    names = pl.Series([f"blocks.{i // 3}.{i % 3}" for i in range(layers)])
    types = pl.Series([("Linear", "ReLU", "LayerNorm")[i % 3] for i in range(layers)])
    n = sample.size
    columns = {
        "sample_id": pl.Series(sample),
        "forward_index": pl.Series(sample * 10),
        "timestamp": pl.Series(sample * 1_000_000 + layer).cast(pl.Datetime("us", "UTC")),
        "layer": names.gather(layer),
        "module_type": types.gather(layer),
        "call_index": pl.Series(np.zeros(n, dtype=np.int32)),
        "signal": pl.Series(list(SIGNALS)).gather(signal),
        "tensor_path": pl.repeat("", n, eager=True),
        "dtype": pl.repeat("float32", n, eager=True),
        "mode": pl.repeat("train", n, eager=True),
        "grad_enabled": pl.repeat(True, n, eager=True),
        "metric": pl.Series(list(METRICS)).gather(metric),
    }
    frame = pl.DataFrame(columns).with_columns(
        shape=pl.lit([8, 64], pl.List(pl.Int64)), rank=pl.lit(0, pl.Int32)
    )
    missing = [c for c in HISTORY_SCHEMA if c not in frame.columns and c != "value"]
    frame = frame.with_columns(pl.lit(None, HISTORY_SCHEMA[c]).alias(c) for c in missing)
    return frame


def run_info(directory: Path, rank: int, world_size: int, layers: int) -> RunInfo:
    infos = tuple(
        LayerInfo(f"blocks.{i // 3}.{i % 3}", ("Linear", "ReLU", "LayerNorm")[i % 3])
        for i in range(layers)
    )
    return RunInfo(
        output_dir=directory,
        library_version="bench",
        torch_version="none",
        model_class="Blocks",
        layers=infos,
        focus_layers=tuple(li.name for li in infos[:8]),
        sampler="EveryNForwardsSampler(n=10)",
        metrics=METRICS,
        rank=rank,
        world_size=world_size,
        rank_policy="all",
        capture_direct_forwards=True,
        history=HistoryConfig(buffer_rows=8192, window=10, flush_seconds=60.0),
        started_at="2026-01-01T00:00:00+00:00",
    )


def generate(parent: Path, ranks: int, layers: int, samples: int) -> float:
    """Write the rank directories (skipping those already there); returns seconds spent."""
    start = time.perf_counter()
    keys = None
    for rank in range(ranks):
        directory = parent / f"rank-{rank:03d}"
        if (directory / ".state.json").exists():
            continue
        if keys is None:
            keys = keys_frame(layers, samples)
        directory.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(rank)
        values = rng.standard_normal(keys.height) * (1 + rank / 100)
        frame = keys.with_columns(rank=pl.lit(rank, pl.Int32), value=pl.Series(values)).select(
            list(HISTORY_SCHEMA)
        )
        frame = frame.cast(dict(HISTORY_SCHEMA))  # type: ignore[arg-type]
        sink_history(frame.lazy(), directory / HISTORY_FILE)
        state = RunState(
            run_info(directory, rank, ranks, layers),
            counts=RunCounts(
                samples * 10,
                samples,
                samples,
                {f"blocks.{i // 3}.{i % 3}": samples for i in range(layers)},
            ),
            rows_recorded=frame.height,
        )
        write_state(directory, state)
    return time.perf_counter() - start


def measure(kind: str, argv: list[str]) -> dict[str, float]:
    """One reader in a fresh child process: its JSON report."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, kind, json.dumps(argv)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {argv}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _finish(parent: str, start: Any, waited: Any) -> None:
    """One rank's end: wait for the others, then ask for the parent page, as its finish does."""
    from torchinstruments.rundir.parent_rewrite import write_parent_index

    start.wait()
    began = time.perf_counter()
    write_parent_index(Path(parent))
    waited.put(time.perf_counter() - began)


def finishing_together(parent: Path, ranks: int) -> list[float]:
    """The seconds each rank waited for its page request, sorted."""
    context = multiprocessing.get_context("fork")
    start, waited = context.Barrier(ranks + 1), context.Queue()
    children = [
        context.Process(target=_finish, args=(str(parent), start, waited)) for _ in range(ranks)
    ]
    for child in children:
        child.start()
    start.wait()
    waits = sorted(waited.get(timeout=3600) for _ in children)
    for child in children:
        child.join()
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--layers", type=int, default=300)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--only", help="comma-separated reader names")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="ranks-bench-"))
    parent = root / "stats"
    parent.mkdir(parents=True, exist_ok=True)
    seconds = generate(parent, args.ranks, args.layers, args.samples)
    rows = args.ranks * args.samples * args.layers * 2 * len(METRICS)
    size = sum(p.stat().st_size for p in parent.glob(f"rank-*/{HISTORY_FILE}"))
    print_machine()
    print(f"Polars {pl.__version__}")
    print(
        f"case: {args.ranks} ranks x {args.layers} layers x {args.samples} samples = "
        f"{rows:,} rows, {size / 2**20:,.0f} MiB of history.parquet (generated in {seconds:.0f} s)"
    )
    out = root / "out"
    out.mkdir(exist_ok=True)
    p = str(parent)
    readers = {
        "show one rank": ("cli", ["show", p, "--rank", "0", "--format", "csv"]),
        "show PARENT": ("cli", ["show", p, "--format", "csv"]),
        "compare PARENT": ("cli", ["compare", p, "--format", "csv", "--tolerance", "0.5"]),
        "plot PARENT": ("cli", ["plot", p, "-o", str(out / "p.png"), "--max-tensors", "64"]),
        "heatmap PARENT": ("cli", ["heatmap", p, "-o", str(out), "--metrics", "mean"]),
        "parent index.md": ("page", [p]),
        "index.md departure query": ("query", [p]),
    }
    only = set(args.only.split(",")) if args.only else None
    print(f"{'reader':28} {'wall s':>8} {'cpu s':>8} {'peak MiB':>9}")
    for name, (kind, argv) in readers.items():
        if only is not None and name not in only:
            continue
        r = measure(kind, argv)
        print(f"{name:28} {r['wall_s']:8.1f} {r['cpu_s']:8.1f} {r['peak_mib']:9.0f}", flush=True)
    if only is None or "ranks finishing together" in only:
        waits = finishing_together(parent, args.ranks)
        print(
            f"ranks finishing together: {args.ranks} ranks asked for the parent index.md at once; "
            f"each waited {waits[len(waits) // 2]:.2f} s (median), {waits[-1]:.2f} s at most"
        )


if __name__ == "__main__":
    main()
