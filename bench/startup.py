"""Start-up: what `import torchinstruments` and the first `inject_observer` add to `import torch`.

Each round starts fresh processes (imports are cached within one): `python -c "import torch"`,
then one process that imports torch, imports torchinstruments, and observes a two-layer model
for one sampled step, timing each phase; and `python -X importtime` of that process, to name the
imports the first `inject_observer` pays for (tensorboard's summary package, Polars, wrapt), the
least of three runs (one run's figure can hold a pause of the machine). The figures are medians
over the rounds, reported as ratios to `import torch` in the same round.

Run: `uv run bench/startup.py [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

from _machine import print_machine

PHASES = """
import json, sys, tempfile, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import torchinstruments
from torch import nn
t2 = time.perf_counter()
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
torchinstruments.inject_observer(model, output_dir=tempfile.mkdtemp() + "/run")
t3 = time.perf_counter()
model(torch.randn(2, 4)).sum().backward()
t4 = time.perf_counter()
torchinstruments.remove_observer(model)
t5 = time.perf_counter()
print(json.dumps({"import torch": t1 - t0, "import torchinstruments": t2 - t1,
                  "first inject_observer": t3 - t2, "first sampled step": t4 - t3,
                  "remove_observer": t5 - t4}))
"""

# Top-level packages whose import the first inject_observer triggers, by their cumulative time.
NAMED = ("tensorboard.summary", "polars", "wrapt", "torch.utils.tensorboard")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"OMP_NUM_THREADS": "1", "PATH": ""}  # nothing else of this shell
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=True, env=env
    )


def import_times() -> dict[str, float]:
    """Cumulative seconds of the NAMED imports, and of the library's own modules (self time)."""
    err = run("-X", "importtime", "-c", PHASES).stderr
    found: dict[str, float] = {}
    own = 0.0
    for line in err.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        first, cumulative_us, name = (part.strip() for part in line.split("|", 2))
        self_us = first.removeprefix("import time:").strip()
        if not self_us.isdigit():
            continue  # the header line
        if name in NAMED and name not in found:
            found[name] = int(cumulative_us) / 1e6
        if name.startswith("torchinstruments"):
            own += int(self_us) / 1e6
    found["torchinstruments' own modules (self time)"] = own
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    print_machine()
    phases: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory():
        for _ in range(rounds):
            plain = json.loads(run("-c", PHASES).stdout)
            torch_alone = float(
                run(
                    "-c",
                    "import time; t = time.perf_counter(); import torch; "
                    "print(time.perf_counter() - t)",
                ).stdout
            )
            for name, seconds in plain.items():
                phases.setdefault(name, []).append(seconds)
                ratios.setdefault(name, []).append(seconds / torch_alone)
            phases.setdefault("import torch (alone)", []).append(torch_alone)
    print(f"{rounds} rounds, medians: seconds, and / import torch alone in the same round")
    for name, values in phases.items():
        ratio = statistics.median(ratios[name]) if name in ratios else 1.0
        print(f"  {name:32s} {statistics.median(values):8.3f} s  {ratio:6.3f}")
    print("imports the first inject_observer pays for (s, the least of 3 -X importtime runs):")
    runs = [import_times() for _ in range(3)]
    for name in runs[0]:
        print(f"  {name:42s} {min(r.get(name, 0.0) for r in runs):6.3f}")


if __name__ == "__main__":
    main()
