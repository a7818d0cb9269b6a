"""Cost of a sampled step on models with many small layers: the fixed cost per tensor and layer.

Acceptance text this measures (issue 21): "the chain sampled at most 0.5x hand-rolled hooks, the
3,000-layer sampled step at most 4x plain".

Two models, each timed in one process, its variants in rotating order round by round (so drift
and ordering hit all alike), an SGD step included in every variant:

* `chain`: 128 x (`Linear(8,8)`, `Tanh`) = 256 layers, batch 4. Variants: `none` (plain step),
  `hand` (bench/sampled.py's `HandRolled`: forward hooks + tensor hooks computing the same nine
  statistics with `var_mean`, `aminmax`, `quantile` and counts, `histc` on the same 8 focus
  layers, results kept in a list and moved to the host once per step), `observed` (defaults,
  every step sampled).
* `deep`: 1,000 x (`Linear(8,8)`, `ReLU`, `LayerNorm(8)`) = 3,000 layers, batch 4. Variants:
  `none`, `unsampled` (observer attached, never sampling), `observed` (every step sampled),
  `hand` as above.

Ratios are medians of per-round ratios, with min..max. `--profile` prints a cProfile of sampled
steps of the chosen model instead (where the fixed cost goes).

Python's full garbage collections are counted in every timed window (`gc.callbacks`): on the
3,000-layer model one scans about 400,000 objects (torch's, its imports' and the model's), about
160 ms here, and comes once the objects promoted out of the young generations reach a quarter of
the long-lived ones. A sampled step keeps a few objects per hooked output until its backward
(torch's hook dict, the `grad_fn`'s and the tensor's Python objects; the observer's hook, the
output's key too, is made once per series and armed again) and promotes about five times as many as
a plain one (about 9,700 objects against 1,800): one full collection in about thirteen sampled
steps (five before the twenty-second session, six to eight before hooks were reused), so a window
of 10 steps that starts after a collection meets at most one, and `--steps 40` gives the fairer
rate. The lines `full collections` give their count and time per step by variant, and
`observed/none without full collections` the ratio with their time taken out of both sides: what
the step costs apart from when the collector happens to run (not a goal figure; the goal counts
everything). Each variant's untimed step follows a full collection of its own: otherwise a window
also pays for what was promoted before it (`inject_observer` leaves about 25,000 objects on this
model, the variant timed before leaves its own), so which variant a collection fell into depended
on the order and on the process (the `unsampled` step, a root call more than the plain one,
measured 1.24 to 1.33 times it; docs/benchmarks.md, twenty-first session).

`--buffer-memory` prints the bytes per row the history buffer holds for the 3,000-layer model's
samples instead (tracemalloc; no part is written meanwhile).

Run: `uv run bench/many_layers.py [--rounds 7] [--steps 5] [--only chain|deep] [--profile]
[--clock wall] [--buffer-memory] [--order-statistics selected]` (`_machine.py`).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from sampled import HandRolled
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from _machine import add_order_statistics, print_machine
from _timing import median

warnings.filterwarnings("ignore", message=".*no sample was recorded", category=RuntimeWarning)


class NeverSample:
    """Observed but never sampled."""

    def should_sample(self, forward_index: int) -> bool:
        return False


def chain() -> tuple[nn.Module, torch.Tensor]:
    """128 x (Linear(8,8), Tanh): 256 layers, batch 4."""
    layers: list[nn.Module] = []
    for _ in range(128):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers), torch.randn(4, 8)


def deep() -> tuple[nn.Module, torch.Tensor]:
    """1,000 x (Linear(8,8), ReLU, LayerNorm(8)): 3,000 layers, batch 4."""
    layers: list[nn.Module] = []
    for _ in range(1000):
        layers += [nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8)]
    return nn.Sequential(*layers), torch.randn(4, 8)


MODELS = {
    "chain": (chain, ("none", "hand", "observed")),
    "deep": (deep, ("none", "unsampled", "observed", "hand")),
}


def make_step(model: nn.Module, x: torch.Tensor, after: Callable[[], None]) -> Callable[[], None]:
    """Forward, loss, backward, SGD step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        after()
        optimizer.step()

    return step


class Timing(NamedTuple):
    """One timed window, per step: seconds (by `clock`), full collections, their wall seconds."""

    seconds: float
    full_collections: float
    collector_seconds: float


def time_variant(kind: str, model: nn.Module, x: torch.Tensor, steps: int) -> Timing:
    """One window of `kind`, after one untimed step in that state (`_time`)."""
    if kind in ("observed", "unsampled"):
        directory = Path(tempfile.mkdtemp()) / "stats"
        sampler = EveryNForwardsSampler(1) if kind == "observed" else NeverSample()
        inject_observer(model, output_dir=directory, sampler=sampler)
        try:
            return _time(make_step(model, x, lambda: None), steps)
        finally:
            remove_observer(model)
    if kind == "hand":
        layers = [m for m in model.modules() if not any(m.children())]
        with HandRolled(layers) as hand:
            return _time(make_step(model, x, hand.flush), steps)
    return _time(make_step(model, x, lambda: None), steps)


# CPU time of the process by default (torch on one thread; the writer's Polars threads and
# TensorBoard's writer thread count too, as they should): on a shared machine wall time
# mostly measures the neighbours. `--clock wall` for wall time.
CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
clock = time.process_time


def _time(step: Callable[[], None], steps: int) -> Timing:
    gc.collect()  # nothing promoted before the window: it pays for its own steps (and one more)
    step()  # after the collection, which leaves the caches cold
    counted = [0, 0.0]
    started = [0.0]

    def count(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counted[0] += 1
            counted[1] += time.perf_counter() - started[0]

    gc.callbacks.append(count)
    try:
        start = clock()
        for _ in range(steps):
            step()
        elapsed = clock() - start
    finally:
        gc.callbacks.remove(count)
    return Timing(elapsed / steps, counted[0] / steps, counted[1] / steps)


def measure(name: str, rounds: int, steps: int) -> None:
    """Rotating rounds of the model's variants; prints one line per ratio."""
    build, order = MODELS[name]
    torch.manual_seed(0)
    model, x = build()
    timings: dict[str, list[Timing]] = {kind: [] for kind in order}
    for round_index in range(rounds + 1):
        shift = round_index % len(order)
        for kind in order[shift:] + order[:shift]:
            timing = time_variant(kind, model, x, steps)
            if round_index > 0:  # round 0 warms every state up
                timings[kind].append(timing)
    times = {kind: [t.seconds for t in got] for kind, got in timings.items()}
    print(f"{name}: " + ", ".join(f"{k} {median(v) * 1e3:.2f} ms" for k, v in times.items()))
    pairs = [("observed", "none"), ("observed", "hand"), ("hand", "none"), ("unsampled", "none")]
    for a, b in pairs:
        if a in times and b in times:
            ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
            print(f"  {a}/{b}: {median(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}]")
    collected = ", ".join(
        f"{kind} {sum(t.full_collections for t in got) / len(got):.2f} "
        f"({sum(t.collector_seconds for t in got) / len(got) * 1e3:.1f})"
        for kind, got in timings.items()
    )
    print(f"  full collections per step (ms per step): {collected}")
    apart = [
        (a.seconds - a.collector_seconds) / (b.seconds - b.collector_seconds)
        for a, b in zip(timings["observed"], timings["none"], strict=True)
    ]
    print(
        f"  observed/none without full collections: {median(apart):.2f} "
        f"[{min(apart):.2f}..{max(apart):.2f}]"
    )


def profile(name: str, steps: int, sort: str = "tottime") -> None:
    """cProfile of `steps` sampled steps (after one warm-up step)."""
    torch.manual_seed(0)
    model, x = MODELS[name][0]()
    directory = Path(tempfile.mkdtemp()) / "stats"
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    step = make_step(model, x, lambda: None)
    step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    remove_observer(model)
    pstats.Stats(profiler).sort_stats(sort).print_stats(45)


def buffer_memory(steps: int = 3) -> None:
    """Bytes per row the history buffer holds for the 3,000-layer model's samples (tracemalloc,
    no part written meanwhile)."""
    import tracemalloc

    from torchinstruments import HistoryConfig

    torch.manual_seed(0)
    model, x = deep()
    config = HistoryConfig(buffer_rows=10**7, max_buffered_rows=10**7, flush_seconds=3600.0)
    directory = Path(tempfile.mkdtemp()) / "stats"
    inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=config
    )
    step = make_step(model, x, lambda: None)
    step()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(steps):
        step()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    rows = steps * 3000 * 2 * 9
    print(f"history buffer: {held / rows:.1f} bytes per row ({rows} rows buffered)")
    remove_observer(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--only", default="", help="run only this model (chain or deep)")
    parser.add_argument("--profile", action="store_true", help="cProfile sampled steps instead")
    parser.add_argument("--clock", choices=list(CLOCK), default="cpu")
    parser.add_argument(
        "--buffer-memory", action="store_true", help="bytes per buffered history row instead"
    )
    add_order_statistics(parser)
    args = parser.parse_args()
    print_machine(args.order_statistics)
    if args.buffer_memory:
        buffer_memory()
        return
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    names = [args.only] if args.only else list(MODELS)
    if args.profile:
        for name in names:
            profile(name, args.steps)
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.rounds} rounds x "
        f"{args.steps} steps, {args.clock} time; ratios: median of per-round ratios [min..max]"
    )
    for name in names:
        measure(name, args.rounds, args.steps)


if __name__ == "__main__":
    main()
