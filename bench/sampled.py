"""Cost of a sampled training step: observer vs hand-rolled hooks vs nothing.

Run: `uv run bench/sampled.py [--rounds 9] [--only mlp] [--threads 1] [--device cuda]
[--order-statistics selected]` (`_machine.py`: as on a CPU whose NumPy sort is slow)

Every step is sampled. For each model, one process times the same model object in three states,
round by round in rotating order (so drift and ordering hit all alike):

* `none`: the plain training step (forward, mean loss, backward);
* `hand`: what a careful user would hand-write: a forward hook on every layer the observer
  observes, computing the same nine statistics of each output tensor and, through
  `Tensor.register_hook`, of the gradient into it, with plain torch ops (`var_mean`, `aminmax`,
  `torch.quantile`, `count_nonzero`), plus `torch.histc` 64-bin histograms on the same 8 focus
  layers; the results are moved to the host once per step (one `torch.stack(...).tolist()`);
* `observed`: `inject_observer` with defaults and `EveryNForwardsSampler(1)` (so every step also
  writes its rows and TensorBoard histograms, as a real run does).

The layers are the ones the observer's default selection proxies (read from the installed
proxies, not re-derived), and the focus layers are the first 8 of them. The table reports the
medians of the per-round ratios observed/hand and observed/none, with their spread (min..max
over rounds), of wall time. With fewer torch threads than cores (`--threads 1` on a machine of
two or more), the observer measures plain CPU tensors on the idle core (spare_core.py), which
the wall time does not count: `cpu obs/hand` is the ratio of the process's CPU time over all its
threads (that worker, the history and event writers, Polars' pool), the work done wherever it
ran.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from _machine import add_order_statistics, print_machine
from _models import cnn, transformer
from _timing import median

FOCUS = 8
BINS = 64
QUARTILES = (0.25, 0.5, 0.75)


def mlp() -> tuple[nn.Module, torch.Tensor]:
    """8 x (Linear(256) + ReLU) + Linear(256, 10): 17 leaf calls."""
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    layers.append(nn.Linear(256, 10))
    return nn.Sequential(*layers), torch.randn(64, 256)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
}


def observed_layers(model: nn.Module) -> list[nn.Module]:
    """The modules the observer's default selection measures, in traversal order.

    Read from the run's catalog (result.json, written at inject): layer proxies exist only
    during sampled forwards, so the installed proxies cannot be read between forwards.
    """
    directory = Path(tempfile.mkdtemp()) / "stats"
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    try:
        names = [entry["layer"] for entry in json.loads((directory / "result.json").read_text())]
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no sample recorded: intended
            remove_observer(model)
    modules = dict(model.named_modules())
    return [modules[name] for name in names if name in modules and modules[name] is not model]


def tensors_of(output: Any) -> Iterator[torch.Tensor]:
    """Tensors in a (possibly nested) layer output."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, tuple | list):
        for item in output:
            yield from tensors_of(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from tensors_of(item)


class HandRolled:
    """Forward hooks + tensor hooks computing the nine statistics (and histc on focus layers)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.focus = {id(m) for m in layers[:FOCUS]}
        self.handles: list[Any] = []
        self.pending: list[torch.Tensor] = []
        self.quartiles: dict[torch.device, torch.Tensor] = {}  # on each device, made once

    def measure(self, tensor: torch.Tensor, focus: bool) -> None:
        """Nine statistics (and a histogram) of one tensor, left on its device."""
        with torch.no_grad():
            x = tensor.detach().reshape(-1).float()
            var, mean = torch.var_mean(x, correction=0)
            low, high = torch.aminmax(x)
            q = self.quartiles.get(x.device)
            if q is None:
                q = self.quartiles[x.device] = torch.tensor(QUARTILES, device=x.device)
            quartiles = torch.quantile(x, q)
            zeros = x.numel() - torch.count_nonzero(x)
            nonfinite = x.numel() - torch.count_nonzero(torch.isfinite(x))
            parts = [mean, var.sqrt(), low, high, zeros / x.numel(), nonfinite / x.numel()]
            self.pending.append(torch.cat([torch.stack(parts), quartiles]))
            if focus:
                self.pending.append(torch.histc(x, BINS))

    def hook(self, module: nn.Module, args: Any, output: Any) -> None:
        """Measure every output tensor and hook the gradient into it."""
        focus = id(module) in self.focus
        for tensor in tensors_of(output):
            self.measure(tensor, focus)
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, focus=focus: self.measure(grad, focus))

    def flush(self) -> None:
        """One host transfer per step."""
        if self.pending:
            torch.cat(self.pending).tolist()
            self.pending = []

    def __enter__(self) -> HandRolled:
        self.handles = [m.register_forward_hook(self.hook) for m in self.layers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def training_step(model: nn.Module, x: torch.Tensor, after: Callable[[], None]) -> None:
    """Forward, mean loss, backward, gradients dropped."""
    model(x).float().mean().backward()
    after()
    for p in model.parameters():
        p.grad = None


def time_variant(
    kind: str, model: nn.Module, x: torch.Tensor, layers: list[nn.Module], steps: int
) -> tuple[float, float]:
    """Seconds per step of `kind`, wall and the process's CPU (after one untimed step)."""
    if kind == "observed":
        directory = Path(tempfile.mkdtemp()) / "stats"
        inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
        try:
            return _time(lambda: training_step(model, x, lambda: None), steps)
        finally:
            remove_observer(model)
    if kind == "hand":
        with HandRolled(layers) as hand:
            return _time(lambda: training_step(model, x, hand.flush), steps)
    return _time(lambda: training_step(model, x, lambda: None), steps)


def _synchronize() -> None:
    """Wait for queued accelerator work, so a timed step includes its kernels."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(step: Callable[[], None], steps: int) -> tuple[float, float]:
    step()
    _synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    _synchronize()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def measure(name: str, rounds: int, steps: int, device: str = "cpu") -> dict[str, Any]:
    """Rotating rounds of the three variants on one model object."""
    torch.manual_seed(0)
    model, x = MODELS[name]()
    model, x = model.to(device), x.to(device)
    layers = observed_layers(model)
    order = ["none", "hand", "observed"]
    times: dict[str, list[float]] = {key: [] for key in order}
    cpu: dict[str, list[float]] = {key: [] for key in order}
    for round_index in range(rounds + 1):
        rotation = order[round_index % 3 :] + order[: round_index % 3]
        for kind in rotation:
            elapsed, used = time_variant(kind, model, x, layers, steps)
            if round_index > 0:  # round 0 warms every state up
                times[kind].append(elapsed)
                cpu[kind].append(used)
    vs_hand = [o / h for o, h in zip(times["observed"], times["hand"], strict=True)]
    vs_none = [o / n for o, n in zip(times["observed"], times["none"], strict=True)]
    hand_none = [h / n for h, n in zip(times["hand"], times["none"], strict=True)]
    cpu_hand = [o / h for o, h in zip(cpu["observed"], cpu["hand"], strict=True)]
    return {
        "layers": len(layers),
        "none_ms": median(times["none"]) * 1e3,
        "hand_ms": median(times["hand"]) * 1e3,
        "observed_ms": median(times["observed"]) * 1e3,
        "vs_hand": (median(vs_hand), min(vs_hand), max(vs_hand)),
        "vs_none": (median(vs_none), min(vs_none), max(vs_none)),
        "hand_none": median(hand_none),
        "cpu_hand": median(cpu_hand),
    }


def main() -> None:
    """Prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--only", default="", help="run only models whose name contains this")
    parser.add_argument("--device", default="cpu", help="where the models run, e.g. cuda")
    add_order_statistics(parser)
    args = parser.parse_args()
    print_machine(args.order_statistics)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} thread(s), "
        f"{args.rounds} rounds x "
        f"{args.steps} steps; ratios: median of per-round ratios [min..max]"
    )
    header = (
        f"{'model':12s} {'layers':>6s} {'none ms':>8s} {'hand ms':>8s} {'obs ms':>8s} "
        f"{'observed/hand':>22s} {'observed/none':>22s} {'hand/none':>9s} {'cpu obs/hand':>12s}"
    )
    print(header)
    print("-" * len(header))
    for name in MODELS:
        if args.only.lower() not in name:
            continue
        row = measure(name, args.rounds, args.steps, args.device)
        h, n = row["vs_hand"], row["vs_none"]
        print(
            f"{name:12s} {row['layers']:6d} {row['none_ms']:8.2f} {row['hand_ms']:8.2f} "
            f"{row['observed_ms']:8.2f} {h[0]:8.2f} [{h[1]:5.2f}..{h[2]:5.2f}] "
            f"{n[0]:8.2f} [{n[1]:5.2f}..{n[2]:5.2f}] {row['hand_none']:9.2f} "
            f"{row['cpu_hand']:12.2f}"
        )


if __name__ == "__main__":
    main()
