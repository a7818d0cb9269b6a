"""Torch ops the observer adds to one sampled forward (and its backward), counted by torch.profiler.

Run: `uv run bench/ops.py [--leaves 100] [--width 64] [--sync-free]`

`--sync-free` measures with the path a GPU takes (no host synchronisation, everything stays on
the device until the sample's one transfer), forced on the CPU: there each op is a kernel launch.

A 100-leaf MLP (Linear + ReLU pairs) is profiled on the CPU for one forward + backward, plain and
then with `inject_observer(..., sampler=EveryNForwardsSampler(1))`. Counted are the top-level
`aten::` ops (ops called from Python or from the autograd engine, not the ops those ops call
internally), split into the forward (up to the end of the root forward, which includes the
sample's host transfer) and the backward (which includes the end-of-backward transfer). The
difference observed - plain is what the observer adds; divided by the number of measured tensors
it shows whether the op count grows per layer.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import torchinstruments.config as observer_config
from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.measurement.reducers import Measurer

from _machine import print_machine


def mlp(leaves: int, width: int) -> nn.Sequential:
    """`leaves` leaf modules: Linear and ReLU alternating."""
    layers: list[nn.Module] = []
    for index in range(leaves):
        layers.append(nn.Linear(width, width) if index % 2 == 0 else nn.ReLU())
    return nn.Sequential(*layers)


def count_ops(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Top-level aten ops of one forward and of one backward."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("bench::forward"):
            out = model(x)
        with record_function("bench::backward"):
            out.mean().backward()
    counts = {"bench::forward": 0, "bench::backward": 0}
    events = prof.events() or []
    ranges = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.name in counts]
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "bench::")):
            parent = parent.cpu_parent
        if parent is not None and parent.name.startswith("aten::"):
            continue  # called by another op
        for name, start, end in ranges:
            if start <= event.time_range.start <= end:
                counts[name] += 1
                break
        else:  # autograd-engine thread ops of the backward
            counts["bench::backward"] += 1
    return counts["bench::forward"], counts["bench::backward"]


class GeneralPathMeasurer(Measurer):
    """The observer's `Measurer` with the NumPy paths off (`host_paths=False`)."""

    def __init__(self, reducers: object) -> None:
        super().__init__(reducers, host_paths=False)  # type: ignore[arg-type]


def main() -> None:
    """Prints the counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=100)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sync-free", action="store_true", help="the device path, on the CPU")
    args = parser.parse_args()
    print_machine()
    if args.sync_free:  # every tensor on the general path (Measurer's host_paths), as on a GPU
        observer_config.Measurer = GeneralPathMeasurer  # type: ignore[misc]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp(args.leaves, args.width)
    x = torch.randn(args.batch, args.width)
    count_ops(model, x)  # warm-up
    plain = count_ops(model, x)
    inject_observer(
        model, output_dir=Path(tempfile.mkdtemp()) / "stats", sampler=EveryNForwardsSampler(1)
    )
    try:
        count_ops(model, x)
        observed = count_ops(model, x)
    finally:
        remove_observer(model)
    tensors = args.leaves  # one output tensor per leaf, and one gradient into it
    print(f"torch {torch.__version__}; MLP with {args.leaves} leaves, top-level aten ops")
    print(f"{'':10s} {'plain':>7s} {'observed':>9s} {'added':>7s} {'added/tensor':>13s}")
    for index, name in enumerate(("forward", "backward")):
        added = observed[index] - plain[index]
        print(
            f"{name:10s} {plain[index]:7d} {observed[index]:9d} {added:7d} {added / tensors:13.1f}"
        )


if __name__ == "__main__":
    main()
