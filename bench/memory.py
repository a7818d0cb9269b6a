"""Peak memory of one sampled training step over the same step unobserved (CPU, subprocesses).

Run: `uv run bench/memory.py [--elements 3e7] [--repeats 3]`

The model is elementwise (PReLU then Tanh) on one input of `--elements` float32 entries, so every
measured tensor (the two outputs and the gradients into them) has that size; the largest is
reported as the reference. Each variant runs in a fresh subprocess: imports, the model and (for
`observed`) `inject_observer(..., sampler=EveryNForwardsSampler(1))` are set up and one small
step is run first (so lazy imports and first-call allocations are out of the way); then the
process reads its resident set size (`/proc/self/statm`), runs one full-size training step and
reads `ru_maxrss` (the peak). The step's peak rise is peak - resident-before; the table reports,
per variant, the median over `--repeats` subprocesses, and observed - plain as the extra memory,
in MiB and as a multiple of the largest measured tensor.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from _machine import print_machine
from _timing import median

MIB = 2**20


def child(variant: str, elements: int) -> None:
    """One step in this process; prints the peak rise in bytes."""
    import torch
    from torch import nn

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    torch.set_num_threads(1)
    model = nn.Sequential(nn.PReLU(), nn.Tanh())
    if variant == "observed":
        directory = Path(tempfile.mkdtemp()) / "stats"
        inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    small = torch.randn(1000, requires_grad=True)
    model(small).sum().backward()
    x = torch.randn(elements)
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as statm:
        before = int(statm.read().split()[1]) * page
    model(x).sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if variant == "observed":
        remove_observer(model)
    print(peak - before)


def main() -> None:
    """Runs the subprocesses and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=float, default=3e7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    print_machine()
    elements = int(args.elements)
    if args.child:
        child(args.child, elements)
        return
    rises: dict[str, list[float]] = {"plain": [], "observed": []}
    for _ in range(args.repeats):
        for variant in rises:
            result = subprocess.run(
                [sys.executable, __file__, "--elements", str(elements), "--child", variant],
                check=True,
                capture_output=True,
                text=True,
            )
            rises[variant].append(int(result.stdout.strip().splitlines()[-1]) / MIB)
    tensor = elements * 4 / MIB
    plain, observed = median(rises["plain"]), median(rises["observed"])
    print(f"{elements} float32 elements: largest measured tensor {tensor:.0f} MiB")
    for variant, values in rises.items():
        spread = ", ".join(f"{v:.0f}" for v in values)
        print(f"{variant:9s} step peak rise {median(values):7.0f} MiB  (runs: {spread})")
    print(f"extra     {observed - plain:7.0f} MiB = {(observed - plain) / tensor:.2f}x the tensor")


if __name__ == "__main__":
    main()
