"""The machine a benchmark ran on, printed first by every bench (figures name their machine).

Sorting speed, and so every ratio against `torch.sort`, depends on the CPU and on which SIMD
kernels NumPy dispatches to (x86-simd-sort on AVX-512 is an order of magnitude faster than a
scalar sort on some CPUs and not on others), so a figure without its machine proves little.
The SIMD lines are what `numpy.show_runtime()` reports: the baseline NumPy was built for, and
the dispatched extensions this CPU has and lacks. The benches that measure on the host say how
its order statistics were found (`order_statistics`): sorted where NumPy's sort is quick, else
selected, as timed once per process; `--order-statistics selected` shows on any CPU what one
whose sort is slow (a Zen 4 AMD EPYC's) runs, without slowing NumPy's other loops as switching
its SIMD dispatch off would. The CPU's family and model and the sort's measured speed are
printed too: a virtual machine's CPU name does not tell a Zen 4 EPYC from a Zen 5.

A figure also depends on what else the machine ran meanwhile: on a shared host (a CI runner, a
virtual machine whose neighbours take its cores) the same step can take half again as long. So
each bench says at its end how busy the machine was with other work during the run
(`print_contention`, from Linux's `/proc/stat`: every process's CPU time and the time the
hypervisor gave the virtual cores to others, less this process's own): a figure measured while
others held a core is not a figure of this machine alone.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch


def cpu_model() -> str:
    """The CPU's model name with its family, model and stepping (Linux `/proc/cpuinfo`, else
    `platform.processor()`). A virtual machine often names its CPU only "AMD EPYC": the family
    tells the generations apart (25: Zen 3 and Zen 4, where AVX-512's compress-store, and so
    NumPy's sort, is slow; 26: Zen 5), and with it whether a figure can hold elsewhere."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if not name.strip():
                break  # the first processor's block ends
            fields.setdefault(name.strip(), value.strip())
        if "model name" in fields:
            ids = [f"{key.removeprefix('cpu ')} {fields[key]}" for key in _IDS if key in fields]
            return fields["model name"] + (f" ({', '.join(ids)})" if ids else "")
    except OSError:
        pass
    return platform.processor() or platform.machine()


_IDS = ("cpu family", "model", "stepping")  # /proc/cpuinfo's fields that identify the CPU


def sort_speed(size: int = 1 << 20, tries: int = 3) -> float:
    """Nanoseconds per entry NumPy's sort takes for `size` normal float32 values, best of
    `tries`: what separates a fast SIMD sort from a slow one, measured here rather than read
    from the CPU's name."""
    values = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    best = math.inf
    for _ in range(tries):
        start = time.perf_counter()
        np.sort(values)
        best = min(best, time.perf_counter() - start)
    return best / size * 1e9


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def numpy_simd() -> tuple[list[str], list[str], list[str]]:
    """NumPy's SIMD baseline, and the dispatched extensions found and not found on this CPU."""
    umath = importlib.import_module("numpy._core._multiarray_umath")  # numpy.show_runtime()'s

    features: dict[str, bool] = umath.__cpu_features__
    dispatch: list[str] = list(umath.__cpu_dispatch__)
    found = [name for name in dispatch if features.get(name)]
    missing = [name for name in dispatch if not features.get(name)]
    return list(umath.__cpu_baseline__), found, missing


def describe() -> str:
    """Three lines naming the machine: CPU, cores, torch, NumPy, its SIMD dispatch and how fast
    its sort is here (`sort_speed`)."""
    baseline, found, missing = numpy_simd()
    return (
        f"machine: {cpu_model()}, {cores()} cores, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, NumPy {np.__version__}\n"
        f"NumPy SIMD: baseline {' '.join(baseline) or '-'}; dispatched, found "
        f"{' '.join(found) or '-'}; not found {' '.join(missing) or '-'}\n"
        f"NumPy sort of 2**20 float32: {sort_speed():.1f} ns per entry"
    )


def print_machine(order_statistics: str | None = None) -> None:
    """Prints `describe()`, with `order_statistics` (`--order-statistics`) how the host paths
    find order statistics (`use_order_statistics`), and a blank line; at the process's exit, how
    busy the machine was with other work meanwhile (`print_contention`)."""
    start = _cpu_snapshot()
    if start is not None:
        atexit.register(print_contention, start)
    print(describe(), flush=True)
    if order_statistics is not None:
        use_order_statistics(order_statistics)
    print(flush=True)


def add_order_statistics(parser: argparse.ArgumentParser) -> None:
    """The `--order-statistics` option (see the module docstring)."""
    parser.add_argument(
        "--order-statistics",
        choices=["auto", "sorted", "selected"],
        default="auto",
        help="the host paths' quartiles: as timed on this CPU (auto), or sorted or selected",
    )


def use_order_statistics(choice: str) -> None:
    """Makes the host paths sort or select as `choice` says (auto: as this CPU was timed) and
    prints which they do."""
    from torchinstruments.measurement import order

    if choice != "auto":
        forced = choice == "selected"
        order.selection_is_quicker = lambda *args, **kwargs: forced  # type: ignore[assignment]
    chosen = "selected" if order.selection_is_quicker() else "sorted"
    how = "timed on this CPU" if choice == "auto" else "--order-statistics"
    print(f"host order statistics: {chosen} ({how})", flush=True)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/stat's unit per second


def _cpu_snapshot() -> tuple[float, float, float, float] | None:
    """(wall seconds, the machine's busy seconds over all cores, of which stolen by the
    hypervisor, this process's CPU seconds and its children's) now; None where `/proc/stat` cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    busy = (user + nice + system + irq + softirq + steal) / _TICK
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    return time.monotonic(), busy, steal / _TICK, own


def print_contention(start: tuple[float, float, float, float]) -> None:
    """How many cores other work held, on average, since `start` (`_cpu_snapshot`)."""
    end = _cpu_snapshot()
    if end is None or end[0] <= start[0]:
        return
    others, steal = contention(start, end)
    print(
        f"\nother work during this run: {others:.2f} of {cores()} cores on average "
        f"(of which {steal:.2f} taken by the hypervisor); above about 0.1, the figures are "
        "this machine's while shared",
        flush=True,
    )


def contention(
    start: tuple[float, float, float, float], end: tuple[float, float, float, float]
) -> tuple[float, float]:
    """Cores held on average between two `_cpu_snapshot`s by other work (other processes' CPU
    time and the hypervisor's steal, not this process's), and by the steal alone."""
    wall = end[0] - start[0]
    others = max(0.0, (end[1] - start[1]) - (end[3] - start[3])) / wall
    return others, (end[2] - start[2]) / wall
