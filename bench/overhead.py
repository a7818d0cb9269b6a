"""Cost of leaving the observer on: training-step time, uninstrumented vs observed-but-not-sampling.

Run: `uv run bench/overhead.py` (add `--quick` for a short run).

For each model, one process times the same model object in three states: plain, with our
proxies installed (a sampler that never samples, so only the unsampled path runs), and with a
no-op `register_forward_hook` on the same leaves (the reference: any module hook pushes
`nn.Module.__call__` off its fast path). Each round times every state, in rotating order, so
drift and ordering effects hit all variants alike; the table reports the median of the per-round
ratios to plain and the median per-round overhead per observed leaf call in µs.
A micro-benchmark of 200 identity leaves isolates the per-call cost from arithmetic noise.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from torchinstruments import inject_observer, remove_observer

from _machine import print_machine
from _models import cnn, transformer
from _timing import median, time_steps

# The bench never samples on purpose; the library's "no sample was recorded" warning is expected.
warnings.filterwarnings("ignore", message=".*no sample was recorded", category=RuntimeWarning)


class NeverSample:
    """Observed but never sampled: measures the unsampled path alone."""

    def should_sample(self, forward_index: int) -> bool:
        return False


def mlp() -> tuple[nn.Module, torch.Tensor]:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(64, 256)


def identities() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(*[nn.Identity() for _ in range(200)]), torch.zeros(1)


def leaves(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if not any(m.children())]


def leaf_calls_per_step(model: nn.Module, x: torch.Tensor) -> int:
    """How many leaf forwards one step runs (counted once with temporary hooks)."""
    count = [0]
    handles = [
        m.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        for m in leaves(model)
    ]
    model(x)
    for handle in handles:
        handle.remove()
    return count[0]


def step_function(model: nn.Module, x: torch.Tensor, backward: bool) -> Callable[[], None]:
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        out = model(x)
        if backward and params:
            out.float().mean().backward()
            for p in params:
                p.grad = None

    return step


class Variant:
    """Puts the one model into a state (plain, observed or hooked) and takes it out again."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        self.model = model
        self.kind = kind
        self.handles: list = []

    def __enter__(self) -> None:
        if self.kind == "observed":
            directory = Path(tempfile.mkdtemp()) / "stats"
            inject_observer(self.model, output_dir=directory, sampler=NeverSample())
        elif self.kind == "hook":
            self.handles = [m.register_forward_hook(lambda *_: None) for m in leaves(self.model)]

    def __exit__(self, *exc: object) -> None:
        if self.kind == "observed":
            remove_observer(self.model)
        for handle in self.handles:
            handle.remove()
        self.handles = []


def measure(name: str, factory: Callable, steps: int, rounds: int, backward: bool) -> dict:
    """Time one model in three states, in rotating order, round by round.

    One model object (not copies) keeps parameter addresses, and so cache and alignment effects,
    identical across the variants; only the timed steps are measured, not injection or removal.
    """
    torch.manual_seed(0)
    model, x = factory()
    calls = leaf_calls_per_step(model, x)
    step = step_function(model, x, backward)
    order = ["plain", "observed", "hook"]
    times: dict[str, list[float]] = {key: [] for key in order}
    for round_index in range(rounds + 1):
        rotation = order[round_index % 3 :] + order[: round_index % 3]
        for key in rotation:
            with Variant(model, key):
                step()  # one untimed step after each change of state
                elapsed = time_steps(step, steps)
            if round_index > 0:  # round 0 warms every state up
                times[key].append(elapsed)
    plain = median(times["plain"])
    # Per-round pairs: robust to slow drift over the run.
    paired = [o - p for o, p in zip(times["observed"], times["plain"], strict=True)]
    paired_hook = [h - p for h, p in zip(times["hook"], times["plain"], strict=True)]
    return {
        "name": name,
        "calls": calls,
        "plain_us": plain * 1e6,
        "ratio": median([o / p for o, p in zip(times["observed"], times["plain"], strict=True)]),
        "hook_ratio": median([h / p for h, p in zip(times["hook"], times["plain"], strict=True)]),
        "us_per_call": median(paired) / calls * 1e6,
        "hook_us_per_call": median(paired_hook) / calls * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 15, quick 5)")
    parser.add_argument("--only", default="", help="run only models whose name contains this")
    args = parser.parse_args()
    print_machine()
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (5 if args.quick else 15)
    cases = [
        ("identity x200 (forward only)", identities, 200, False),
        ("MLP 8x Linear(256)+ReLU, b64", mlp, 20, True),
        ("CNN 3 conv, b16 32x32", cnn, 5, True),
        ("Transformer 4 blocks d128 s64 b16", transformer, 3, True),
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} rounds\n")
    header = (
        f"{'model':36s} {'leaf calls':>10s} {'plain step':>11s} {'observed/plain':>15s} "
        f"{'µs/leaf call':>13s} {'hook/plain':>11s} {'hook µs/call':>13s}"
    )
    print(header)
    print("-" * len(header))
    for name, factory, steps, backward in cases:
        if args.only.lower() not in name.lower():
            continue
        row = measure(name, factory, steps, rounds, backward)
        print(
            f"{row['name']:36s} {row['calls']:10d} {row['plain_us']:9.0f}µs "
            f"{row['ratio']:15.4f} {row['us_per_call']:13.3f} {row['hook_ratio']:11.4f} "
            f"{row['hook_us_per_call']:13.3f}"
        )


if __name__ == "__main__":
    main()
