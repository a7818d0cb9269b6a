"""global_statistics=: the extra time of a sampled step and the bytes exchanged per sample.

The case: data parallel on `--ranks` gloo processes (2 and 4 by default) on 127.0.0.1, each a
chain of `--layers` `Linear(--width, --width)` + `ReLU` (default 30 x 256) on a batch of 64, every
forward sampled (`EveryNForwardsSampler(1)`), forward and backward. Per world size, in one
process per rank, the median step time over `--steps` steps of: the plain model, the model
observed locally (`rank_policy="all"`), and observed with `global_statistics=<the world group>`;
figures are ratios to the plain step and the global option's extra over the local one.

Bytes: the payload the library hands to torch.distributed per sample on each rank (the packed
tensors' sizes, counted by wrapping the collectives; a ring all-reduce sends about twice that
over the wire), and the number of collective calls.

Run: `uv run bench/global_statistics.py [--ranks 2,4] [--layers 30] [--steps 20]`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from _machine import print_machine
from _timing import median


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def payload(step: object) -> tuple[int, int]:
    """Collective calls and the bytes of the tensors handed to them during one `step()`."""
    sent = {"calls": 0, "bytes": 0}
    saved = {n: getattr(dist, n) for n in ("all_reduce", "all_gather")}

    def wrap(name: str, fn: object) -> object:
        def counted(*a: object, **k: object) -> object:
            tensor = a[0] if name == "all_reduce" else a[1]
            sent["calls"] += 1
            sent["bytes"] += tensor.numel() * tensor.element_size()  # type: ignore[union-attr]
            return fn(*a, **k)  # type: ignore[operator]

        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        step()  # type: ignore[operator]
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
    return sent["calls"], sent["bytes"]


def worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    width = args["width"]
    layers = []
    for _ in range(args["layers"]):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    x = torch.randn(64, width)

    def step() -> None:
        model(x).sum().backward()

    def timed(n: int) -> float:
        times = []
        for _ in range(n):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return median(times)

    report: dict[str, float] = {}
    step()
    report["plain"] = timed(args["steps"])
    for name, option in (("local", False), ("global", dist.group.WORLD)):
        directory = Path(out) / name
        inject_observer(
            model,
            output_dir=directory,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=option,
            max_histogram_modules=1,
        )
        step()
        report[name] = timed(args["steps"])
        if name == "global":
            report["calls"], report["bytes"] = payload(lambda: model(x))
        remove_observer(model)
    if rank == 0:
        Path(out, "report.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run(world: int, args: dict) -> dict:
    out = tempfile.mkdtemp(prefix="global-bench-")
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=worker, args=(r, world, port, args, out)) for r in range(world)
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    return json.loads(Path(out, "report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    a = parser.parse_args()
    args = {"layers": a.layers, "width": a.width, "steps": a.steps}
    print_machine()
    print(f"{a.layers} x (Linear({a.width}, {a.width}), ReLU), batch 64")
    print(
        f"{'ranks':>5} {'plain ms':>9} {'local x':>8} {'global x':>9} {'extra ms':>9} "
        f"{'calls':>6} {'KiB/sample':>11}"
    )
    for world in (int(w) for w in a.ranks.split(",")):
        r = run(world, args)
        print(
            f"{world:>5} {r['plain'] * 1e3:9.1f} {r['local'] / r['plain']:8.2f} "
            f"{r['global'] / r['plain']:9.2f} {(r['global'] - r['local']) * 1e3:9.1f} "
            f"{r['calls']:6d} {r['bytes'] / 1024:11.1f}"
        )


if __name__ == "__main__":
    main()
