"""What a sampled step pays besides the arithmetic: bench/sampled.py's models with the host
path's and the small-tensor lane's statistics canned.

Run: `uv run bench/bookkeeping.py [--rounds 15] [--steps 10] [--only mlp] [--clock cpu]
[--order-statistics selected]` (`_machine.py`)

Every step is sampled (`EveryNForwardsSampler(1)`), as in bench/sampled.py. In one process, the
same model object is timed round by round in rotating order in three states:

* `plain`: the training step alone;
* `observed`: `inject_observer` with defaults;
* `canned`: the same, with `numerics.measure_array` (one CPU tensor's statistics and histogram,
  what bench/statistics.py times) and `lane.measure` (a pass's small tensors) returning the
  result they gave the first time for arrays of those sizes: what is left over `plain` is the
  library's own work per tensor and per sample (proxies, hooks, copies, records, rows, history
  parts, TensorBoard events).

Figures are medians over rounds of (state - plain) in ms per step. `--clock cpu` (the default)
counts the training thread's CPU time only, which a machine shared with other jobs disturbs
less; `wall` counts what the step takes, the writer threads' hold on the GIL included.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sampled import MODELS, training_step

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.measurement import lane, numerics

from _machine import add_order_statistics, print_machine
from _timing import median

CLOCK = {"cpu": time.thread_time, "wall": time.perf_counter}


@contextmanager
def canned_statistics() -> Iterator[None]:
    """`numerics.measure_array` and `lane.measure` answer from caches keyed by the sizes, dtype,
    metrics and histograms asked for."""
    real_array, real_lane = numerics.measure_array, lane.measure
    cache: dict[Any, Any] = {}

    def canned(array: np.ndarray, bins: int | None, select: bool | None = None) -> Any:
        key = (array.size, str(array.dtype), bins, select)
        if key not in cache:
            cache[key] = real_array(array, bins, select)
        result = cache[key]
        histogram = None if result.histogram is None else list(result.histogram)
        return numerics.CpuResult(dict(result.raw), histogram)

    def canned_lane(
        copies: Sequence[np.ndarray],
        metrics: tuple[str, ...],
        focus: Sequence[bool],
        bins: int,
        buffers: Any = None,
        select: bool | None = None,
    ) -> Any:
        key = (tuple(copy.size for copy in copies), metrics, tuple(focus), bins, select)
        if key not in cache:
            cache[key] = real_lane(copies, metrics, focus, bins, buffers, select)
        values, why, vectors = cache[key]
        return list(values), list(why), [None if v is None else list(v) for v in vectors]

    numerics.measure_array, lane.measure = canned, canned_lane
    try:
        yield
    finally:
        numerics.measure_array, lane.measure = real_array, real_lane


def per_step(step: Callable[[], None], steps: int, clock: Callable[[], float]) -> float:
    """Milliseconds per step (after one untimed step)."""
    step()
    start = clock()
    for _ in range(steps):
        step()
    return (clock() - start) / steps * 1e3


def measure(name: str, rounds: int, steps: int, clock: Callable[[], float]) -> dict[str, float]:
    """Median ms over plain of `observed` and `canned`, and the plain step's ms."""
    torch.manual_seed(0)
    model, x = MODELS[name]()

    def step() -> None:
        training_step(model, x, lambda: None)

    def observed() -> float:
        directory = Path(tempfile.mkdtemp()) / "stats"
        inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
        try:
            return per_step(step, steps, clock)
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                remove_observer(model)

    def canned() -> float:
        with canned_statistics():
            return observed()

    variants = {"plain": lambda: per_step(step, steps, clock), "observed": observed}
    variants["canned"] = canned
    order = list(variants)
    times: dict[str, list[float]] = {key: [] for key in order}
    for round_index in range(rounds + 1):
        for kind in order[round_index % 3 :] + order[: round_index % 3]:
            elapsed = variants[kind]()
            if round_index > 0:  # round 0 warms every state up
                times[kind].append(elapsed)
    over = {
        kind: median([t - p for t, p in zip(times[kind], times["plain"], strict=True)])
        for kind in ("observed", "canned")
    }
    return {"plain": median(times["plain"]), **over}


def main() -> None:
    """Prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per state per round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--only", default="", help="run only models whose name contains this")
    parser.add_argument("--clock", choices=list(CLOCK), default="cpu")
    add_order_statistics(parser)
    args = parser.parse_args()
    print_machine(args.order_statistics)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.rounds} rounds x "
        f"{args.steps} steps, {args.clock} time; medians over rounds of (state - plain)"
    )
    print(f"{'model':12s} {'plain ms':>9s} {'observed - plain':>17s} {'canned - plain':>15s}")
    for name in MODELS:
        if args.only.lower() not in name:
            continue
        row = measure(name, args.rounds, args.steps, CLOCK[args.clock])
        print(f"{name:12s} {row['plain']:9.2f} {row['observed']:17.2f} {row['canned']:15.2f}")


if __name__ == "__main__":
    main()
