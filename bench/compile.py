"""Cost of observing a torch.compile'd model: unsampled steps, and one sampled step.

Run: `uv run bench/compile.py` (add `--quick` for a short run; `--backend aot_eager` to skip the
C++ compilation of inductor).

A transformer (4 encoder blocks) is copied twice in one process; both copies are compiled with
inductor, the second after `inject_observer` with a sampler that declines until armed, so it
runs only the unsampled path. Timed rounds alternate between the two in rotating order, and the
median of the per-round step-time ratios is reported, with the graphs and graph breaks of both
compilations and any compiled during the rounds (there should be none).

A sampled step runs eagerly (that is the design: see docs/design-notes.md, "torch.compile"), so
its cost is reported as a ratio to a compiled step, next to a plain eager step for reference.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from torchinstruments import inject_observer, remove_observer

from _machine import print_machine
from _timing import median, time_steps


def unshadow_standard_library() -> None:
    """Drop this folder from sys.path: inductor imports the standard library's `statistics`,
    which bench/statistics.py would shadow."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]


class OnDemand:
    """Samples the next root forward only when asked to (`arm()`)."""

    def __init__(self) -> None:
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def should_sample(self, forward_index: int) -> bool:
        armed, self.armed = self.armed, False
        return armed


def transformer() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    return model, torch.randn(16, 64, 128)


def graphs_and_breaks() -> tuple[int, int]:
    """Graphs compiled so far (recompiles included) and graph breaks, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def step_function(
    call: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, x: torch.Tensor
) -> Callable[[], None]:
    """Forward, backward, gradients dropped (no optimizer: the weights stay fixed)."""
    params = list(model.parameters())

    def step() -> None:
        call(x).float().square().mean().backward()
        for p in params:
            p.grad = None

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 15, quick 5)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and model")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args()
    print_machine()
    unshadow_standard_library()
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch.set_num_threads(args.threads)
    rounds = args.rounds or (5 if args.quick else 15)
    torch.manual_seed(0)
    base, x = transformer()
    plain_model, observed_model = copy.deepcopy(base), copy.deepcopy(base)
    sampler = OnDemand()
    run_dir = Path(tempfile.mkdtemp()) / "stats"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), backend "
        f"{args.backend}, {rounds} rounds x {args.steps} steps\n"
        "model: TransformerEncoder, 4 blocks, d_model 128, seq 64, batch 16; "
        "step = forward + backward"
    )

    # Two copies of one model, compiled the same way; the second observed (inject, then compile).
    counters.clear()
    plain = step_function(torch.compile(plain_model, backend=args.backend), plain_model, x)
    plain()
    plain()
    plain_counts = graphs_and_breaks()
    counters.clear()
    inject_observer(observed_model, output_dir=run_dir, sampler=sampler)
    observed = step_function(torch.compile(observed_model, backend=args.backend), observed_model, x)
    observed()
    observed()
    observed_counts = graphs_and_breaks()
    print(
        f"graphs/breaks: plain compiled {plain_counts[0]}/{plain_counts[1]}, observed compiled "
        f"{observed_counts[0]}/{observed_counts[1]}"
    )

    # Paired rounds, rotating order: the observed model never samples here.
    times: dict[str, list[float]] = {"plain": [], "observed": []}
    steps = {"plain": plain, "observed": observed}
    order = ["plain", "observed"]
    for round_index in range(rounds + 1):
        for key in order[round_index % 2 :] + order[: round_index % 2]:
            elapsed = time_steps(steps[key], args.steps)
            if round_index > 0:  # round 0 warms both up
                times[key].append(elapsed)
    ratios = [o / p for o, p in zip(times["observed"], times["plain"], strict=True)]
    print(
        f"compiled step: plain {median(times['plain']) * 1e3:.1f} ms, observed without a sample "
        f"{median(times['observed']) * 1e3:.1f} ms; observed/plain median {median(ratios):.4f} "
        f"(per-round {min(ratios):.3f} .. {max(ratios):.3f}); new graphs/breaks during the "
        f"rounds: {graphs_and_breaks()[0] - observed_counts[0]}/"
        f"{graphs_and_breaks()[1] - observed_counts[1]}"
    )

    # One sampled step (eager, measured) against the compiled steps around it.
    sampled: list[float] = []
    compiled_steps: list[float] = []
    for _ in range(max(3, rounds // 3)):
        compiled_steps.append(time_steps(observed, args.steps))
        sampler.arm()
        sampled.append(time_steps(observed, 1))
    eager = step_function(base, base, x)
    eager()
    eager_time = median([time_steps(eager, args.steps) for _ in range(3)])
    compiled_time = median(compiled_steps)
    print(
        f"sampled step: {median(sampled) * 1e3:.1f} ms = {median(sampled) / compiled_time:.2f} "
        f"x a compiled step ({compiled_time * 1e3:.1f} ms); a plain eager step: "
        f"{eager_time * 1e3:.1f} ms = {eager_time / compiled_time:.2f} x; new graphs/breaks: "
        f"{graphs_and_breaks()[0] - observed_counts[0]}/"
        f"{graphs_and_breaks()[1] - observed_counts[1]}"
    )
    remove_observer(observed_model)
    per_forward_overhead(args.backend, rounds)


def per_forward_overhead(backend: str, rounds: int) -> None:
    """The unsampled path's absolute cost: a tiny compiled model, forward only, many calls."""
    tiny = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    plain_model, observed_model = copy.deepcopy(tiny), copy.deepcopy(tiny)
    inject_observer(observed_model, output_dir=Path(tempfile.mkdtemp()) / "s", sampler=OnDemand())
    x = torch.randn(4, 8)
    calls = {
        "plain": torch.compile(plain_model, backend=backend),
        "observed": torch.compile(observed_model, backend=backend),
    }
    times: dict[str, list[float]] = {"plain": [], "observed": []}
    with torch.no_grad():
        for round_index in range(rounds + 1):
            for key in ("plain", "observed") if round_index % 2 else ("observed", "plain"):
                call = calls[key]
                elapsed = time_steps(lambda call=call: call(x), 2000)
                if round_index > 0:
                    times[key].append(elapsed)
    extra = [o - p for o, p in zip(times["observed"], times["plain"], strict=True)]
    print(
        f"tiny compiled model (2 Linear, forward only): plain {median(times['plain']) * 1e6:.1f} "
        f"µs per call, observed without a sample +{median(extra) * 1e6:.2f} µs per root forward"
    )
    remove_observer(observed_model)


if __name__ == "__main__":
    main()
