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

`--buffer-memory` prints the bytes per row the history buffer holds for the 3,000-layer model's
samples instead (tracemalloc; no part is written meanwhile).

Run: `uv run bench/many_layers.py [--rounds 7] [--steps 5] [--only chain|deep] [--profile]
[--clock wall] [--buffer-memory] [--order-statistics selected]` (`_machine.py`).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

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


def time_variant(kind: str, model: nn.Module, x: torch.Tensor, steps: int) -> float:
    """Seconds per step of `kind`, after one untimed step in that state."""
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


def _time(step: Callable[[], None], steps: int) -> float:
    step()
    start = clock()
    for _ in range(steps):
        step()
    return (clock() - start) / steps


def measure(name: str, rounds: int, steps: int) -> None:
    """Rotating rounds of the model's variants; prints one line per ratio."""
    build, order = MODELS[name]
    torch.manual_seed(0)
    model, x = build()
    times: dict[str, list[float]] = {kind: [] for kind in order}
    for round_index in range(rounds + 1):
        shift = round_index % len(order)
        for kind in order[shift:] + order[:shift]:
            elapsed = time_variant(kind, model, x, steps)
            if round_index > 0:  # round 0 warms every state up
                times[kind].append(elapsed)
    print(f"{name}: " + ", ".join(f"{k} {median(v) * 1e3:.2f} ms" for k, v in times.items()))
    pairs = [("observed", "none"), ("observed", "hand"), ("hand", "none"), ("unsampled", "none")]
    for a, b in pairs:
        if a in times and b in times:
            ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
            print(f"  {a}/{b}: {median(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}]")


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
    import gc
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
