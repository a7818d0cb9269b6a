"""Removal of a long history from a real run: peak memory and time of `remove_observer`.

Acceptance text this measures (issue 21): "at 1 M rows / 18k series: at most +256 MiB and no
slower than the peer; at 10 M rows / 54k series (3,000 layers) still bounded", and the artifact
sizes (history bytes per row, result.json, index.md).

Each case trains a model with every step sampled, in a fresh child process, then times
`remove_observer` (wall and CPU time: on a shared machine the CPU time is the steadier figure)
and reads the process's peak RSS during it: the kernel's high-water mark
(`VmHWM`) is reset just before the call (`/proc/self/clear_refs`), so the figure is the peak of
the removal alone, over the RSS just before it (`VmRSS`). Cases:

* `chain`: 512 x (`Linear(16,16)`, `Tanh`) = 1,024 layers, batch 8, SGD, 55 steps: 1,013,760
  rows, 18,432 series (layers x 2 signals x 9 metrics), `HistoryConfig(buffer_rows=8192)`,
  8 focus layers. The case of the issue, also run with the peer.
* `skips`: the chain's 512 blocks (`Linear(16,16)`, `Tanh`), a quarter of them run on every
  third forward only and a quarter only on the first 20, 55 steps: series that skip samples or
  stop, whose windows are read back from the end of history (`rundir.windows`' second read).
* `deep`: 1,000 x (`Linear(8,8)`, `ReLU`, `LayerNorm(8)`) = 3,000 layers, batch 4, SGD; with
  `--steps 186` about 10 M rows and 54,000 series.

The peer is the published `torchinstruments==0.10.2` (a different project of the same name).
It cannot share an environment with this one, so it runs in its own interpreter, given by
`--peer-python`; its API is `inject_observer(model, sampler=AlwaysSampler(),
selector=leaf_modules(), max_histogram_modules=8, history_config=HistoryConfig(8192))`, the same
layers, sampling, focus and chunk size as ours. A throwaway environment for it that borrows this
checkout's torch and polars:

    uv venv /tmp/peer-venv && uv pip install --python /tmp/peer-venv --no-deps \
        torchinstruments==0.10.2
    echo "$PWD/.venv/lib/python3.11/site-packages" \
        > /tmp/peer-venv/lib/python3.11/site-packages/_deps.pth

Run: `uv run bench/removal.py [--case chain|skips|deep|all] [--repeats 3] [--peer-python PY]`.
Figures: medians over repeats with min..max; the machine may be shared (say so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _machine import print_machine
from _timing import median

CHILD = r"""
import json, sys, time, warnings
from pathlib import Path
import torch
from torch import nn

case, steps, impl, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
torch.manual_seed(0)
torch.set_num_threads(1)
if case == "chain":
    layers = []
    for _ in range(512):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model, x = nn.Sequential(*layers), torch.randn(8, 16)
elif case == "skips":
    class Skips(nn.Module):
        # The chain's blocks, some run on some forwards only: series that skip samples, or stop.

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(512))
            self.calls = 0

        def forward(self, x):
            k, self.calls = self.calls, self.calls + 1
            for i, block in enumerate(self.blocks):
                if (i % 4 == 1 and k % 3) or (i % 4 == 2 and k >= 20):
                    continue
                x = block(x)
            return x

    model, x = Skips(), torch.randn(8, 16)
else:
    layers = []
    for _ in range(1000):
        layers += [nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8)]
    model, x = nn.Sequential(*layers), torch.randn(4, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

if impl == "ours":
    from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer
    from torchinstruments import remove_observer
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1),
                    history_config=HistoryConfig(buffer_rows=8192))
else:
    from torchinstruments import AlwaysSampler, HistoryConfig, inject_observer, leaf_modules
    from torchinstruments import remove_observer
    inject_observer(model, output_dir=directory, sampler=AlwaysSampler(), selector=leaf_modules(),
                    max_histogram_modules=8, history_config=HistoryConfig(buffer_rows=8192))

t0 = time.perf_counter()
for _ in range(steps):
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
train_s = time.perf_counter() - t0

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB -> MiB
    raise KeyError(key)

before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
t0, c0 = time.perf_counter(), time.process_time()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    remove_observer(model)
remove_s, remove_cpu = time.perf_counter() - t0, time.process_time() - c0
peak = status("VmHWM")
print(json.dumps({"train_s": train_s, "remove_s": remove_s, "remove_cpu": remove_cpu,
                  "rss_before": before, "peak": peak}))
"""

CASES = {"chain": 55, "deep": 186, "skips": 55}


def run_child(
    python: str, case: str, steps: int, impl: str, source: str | None = None
) -> dict[str, Any]:
    """One training run and removal in a fresh process; adds artifact sizes to its figures.

    `source`: a `src` folder of another checkout of this project, put first on the child's
    path (the "before" of a change).
    """
    directory = Path(tempfile.mkdtemp(prefix=f"ti-removal-{impl}-")) / "stats"
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = source
    try:
        out = subprocess.run(
            [python, "-c", CHILD, case, str(steps), impl, str(directory)],
            capture_output=True,
            text=True,
            check=False,
            env=env,
        )
        if out.returncode:
            raise SystemExit(f"{impl} {case} failed:\n{out.stderr[-4000:]}")
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        figures.update(artifacts(directory))
        return figures
    finally:
        shutil.rmtree(directory.parent, ignore_errors=True)


def artifacts(directory: Path) -> dict[str, Any]:
    """Rows, series and the sizes of history.parquet, result.json and index.md."""
    import polars as pl

    history = directory / "history.parquet"
    lf = pl.scan_parquet(history, glob=False)
    keys = ["layer", "call_index", "signal", "tensor_path", "metric"]
    rows = lf.select(pl.len()).collect().item()
    series = lf.select(keys).unique().select(pl.len()).collect().item()
    sizes = {
        name: (directory / name).stat().st_size if (directory / name).exists() else 0
        for name in ("history.parquet", "result.json", "index.md")
    }
    return {"rows": rows, "series": series, **sizes}


def spread(values: list[float], fmt: str) -> str:
    """`median [min..max]`."""
    return f"{format(median(values), fmt)} [{format(min(values), fmt)}..{format(max(values), fmt)}]"


def report(case: str, impl: str, runs: list[dict[str, Any]]) -> None:
    """One table row per case and implementation."""
    first = runs[0]
    growth = [r["peak"] - r["rss_before"] for r in runs]
    print(
        f"| {case} | {impl} | {first['rows']:,} | {first['series']:,} "
        f"| {spread([r['remove_s'] for r in runs], '.2f')} s "
        f"| {spread([r['remove_cpu'] for r in runs], '.2f')} s "
        f"| {spread(growth, ',.0f')} MiB | {median([r['rss_before'] for r in runs]):,.0f} MiB "
        f"| {first['history.parquet'] / first['rows']:.2f} "
        f"| {first['result.json'] / 2**20:.1f} MiB | {first['index.md'] / 1024:.0f} KiB "
        f"| {median([r['train_s'] for r in runs]):.1f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="chain")
    parser.add_argument("--steps", type=int, default=None, help="override the case's steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer-python", default=None, help="interpreter with the peer installed")
    parser.add_argument(
        "--before", default=None, help="src/ of an older checkout, run as 'before' next to ours"
    )
    args = parser.parse_args()
    print_machine()
    cases = list(CASES) if args.case == "all" else [args.case]
    impls: list[tuple[str, str, str | None]] = [("ours", sys.executable, None)]
    if args.before:
        impls.append(("ours before", sys.executable, args.before))
    if args.peer_python:
        impls.append(("peer 0.10.2", args.peer_python, None))
    print(
        "| case | impl | rows | series | remove_observer wall | its CPU | peak over RSS before "
        "| RSS before | history B/row | result.json | index.md | training wall |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in cases:
        steps = args.steps or CASES[case]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in impls}
        for _ in range(args.repeats):  # alternating, so drift hits all alike
            for name, python, source in impls:
                runs[name].append(run_child(python, case, steps, name.split()[0], source))
        for name, _, _ in impls:
            report(case, name, runs[name])


if __name__ == "__main__":
    main()
