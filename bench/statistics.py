"""Cost of the default statistics profile (and histogram) of one float32 tensor on the CPU.

Compares, per size, the whole default profile (`Measurer.launch` + `PendingReduction.resolve`)
with `x.sum()` (the floor: one read of the tensor), `torch.sort(x)` (the reference the budget is
stated in) and the obvious approach (`torch.quantile` for the three quartiles plus separate
count, mean, std, min and max passes). `stats+hist` is what one focus tensor costs: the profile
plus its 64-bin histogram, as the observer measures it (`Measurer.launch_with_histogram`); `hand` is the hand-rolled equivalent
(`var_mean`, `aminmax`, `torch.quantile`, two `count_nonzero`, `torch.histc`, one `.tolist()`),
which `torch.quantile` limits to 2**24 elements. `leaf` is what the observer adds per sample for
one observed `nn.ReLU` leaf whose output is the tensor, under `no_grad` (every forward sampled,
rows and the focus histogram written as in a real run): the observed forward minus the plain one
of a second, unobserved model, per repeat.

Timing: each repeat runs every candidate in a rotating order (drift hits all alike), and each
timed call comes right after an untimed call of the same candidate, so that no candidate is timed
in what the one before left behind. That matters on the AMD EPYC the goals were set on: a call
timed right after `torch.sort` of another tensor of 1e5 entries runs about 0.5 ms slower whatever
it is (a pass over an unrelated array of 1e5 entries takes 3 to 5 times as long; a first call
of the same function on another tensor takes most of it, a sum of the tensor or a 5 ms sleep
in between does not), and in a single rotating order `ours` came right after `hand`'s
`torch.quantile` in every repeat. `aft/sort` shows that cost as it is: `ours` timed right after
`torch.sort` of another tensor of the same size (up to 2**20 entries). The medians are reported as milliseconds and the ratios as medians
of the per-repeat ratios. Budgets: stats+hist <= 0.3x sort at 1e6 and 1e7, and <= hand at 1e4.

Each size also checks that our quartiles equal NumPy-style linear interpolation between the order
statistics read from `torch.sort` (exact equality, not a tolerance).

Run: `uv run bench/statistics.py [--sizes 1e4,1e6] [--repeats 7] [--threads 1]
[--order-statistics selected]` (`_machine.py`: as on a CPU whose NumPy sort is slow)

On a shared machine, multi-threaded ops wait for a scheduler time slice whenever another process
holds a core, which inflates every short parallel op; `--threads 1` gives stable numbers there.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.measurement import histograms
from torchinstruments.measurement.histograms import DEFAULT_BINS
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.records import LayerInfo, TensorKey

from _machine import add_order_statistics, print_machine
from _timing import median, timed

QUARTILES = (0.25, 0.5, 0.75)
QUANTILE_LIMIT = 2**24
# `after sort` is timed up to this size (torch.sort of 1e7 entries takes a second here).
AFTER_SORT_LIMIT = 2**20

# The key a benchmark's histogram is recorded under.
KEY = TensorKey(0, 0, LayerInfo("bench", "Identity"), 0, "output", "", "train", True)


def ours(measurer: Measurer, x: torch.Tensor) -> dict[str, float | None]:
    """The default profile, both halves."""
    pending = measurer.launch(x)
    vector = pending.device_vector
    values = pending.resolve([] if vector is None else vector.tolist())
    return {name: mv.value for name, mv in zip(measurer.metrics, values, strict=True)}


def with_histogram(measurer: Measurer, x: torch.Tensor) -> None:
    """The profile and the histogram of one focus tensor, both halves, as the observer runs them."""
    reduction, pending = measurer.launch_with_histogram(x)
    vector = reduction.device_vector
    reduction.resolve([] if vector is None else vector.tolist())
    if isinstance(pending, torch.Tensor):  # the general path's: read with the sample's transfer
        pending = pending.tolist()
    histograms.record(pending or [], DEFAULT_BINS, KEY, "output")


def forward(model: nn.Module, x: torch.Tensor) -> None:
    """One root forward under `no_grad`."""
    with torch.no_grad():
        model(x)


def obvious(x: torch.Tensor) -> list[float]:
    """torch.quantile for the quartiles plus one pass per other statistic."""
    finite = torch.isfinite(x)
    values = x[finite]
    quartiles = torch.quantile(values, torch.tensor(QUARTILES, dtype=values.dtype))
    out = [
        values.mean(),
        values.std(correction=0),
        values.min(),
        values.max(),
        (x == 0).sum() / x.numel(),
        (~finite).sum() / x.numel(),
    ]
    return [float(v) for v in out] + quartiles.tolist()


def hand(x: torch.Tensor, quartiles: torch.Tensor) -> list[float]:
    """What a careful user writes: the nine statistics and a 64-bin histc, one host transfer."""
    var, mean = torch.var_mean(x, correction=0)
    low, high = torch.aminmax(x)
    q = torch.quantile(x, quartiles)
    zeros = x.numel() - torch.count_nonzero(x)
    nonfinite = x.numel() - torch.count_nonzero(torch.isfinite(x))
    parts = torch.stack([mean, var.sqrt(), low, high, zeros / x.numel(), nonfinite / x.numel()])
    return torch.cat([parts, q, torch.histc(x, 64)]).tolist()


def lerp(a: float, b: float, t: float) -> float:
    """numpy's _lerp for one scalar."""
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def reference_quartiles(sorted_values: torch.Tensor) -> list[float]:
    """Quartiles from a full sort, interpolated as numpy.percentile(method='linear')."""
    n = sorted_values.numel()
    out = []
    for q in QUARTILES:
        position = (n - 1) * q
        low = math.floor(position)
        high = min(low + 1, n - 1)
        a, b = float(sorted_values[low]), float(sorted_values[high])
        out.append(a if a == b else lerp(a, b, position - low))
    return out


def main() -> None:
    """Prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e4,1e5,1e6,1e7,3e7")
    parser.add_argument("--repeats", type=int, default=0, help="0: 9 below 1e7 elements, else 3")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0: default")
    add_order_statistics(parser)
    args = parser.parse_args()
    print_machine(args.order_statistics)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    torch.manual_seed(0)
    measurer = Measurer(None)
    quartiles = torch.tensor(QUARTILES)
    plain, observed = nn.Sequential(nn.ReLU()), nn.Sequential(nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        directory = Path(tempfile.mkdtemp()) / "stats"
        inject_observer(observed, output_dir=directory, sampler=EveryNForwardsSampler(1))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 randn, median ms")
    header = (
        f"{'n':>10} {'ours':>9} {'sum':>9} {'sort':>9} {'obvious':>9} {'stats+hist':>10} "
        f"{'hand':>9} {'leaf':>9} | {'ours/sort':>9} {'aft/sort':>9} {'sum/sort':>9} {'obv/sort':>9} "
        f"{'s+h/sort':>9} {'s+h/hand':>9} {'leaf/sort':>9} {'leaf ns/el':>10}  quartiles"
    )
    print(header)
    for n in sizes:
        x = torch.randn(n)
        repeats = args.repeats or (9 if n < 10**7 else 3)
        runs: dict[str, list[float]] = {
            name: []
            for name in (
                "ours",
                "sum",
                "sort",
                "obvious",
                "stats+hist",
                "hand",
                "plain",
                "observed",
                "after sort",
            )
        }
        candidates: dict[str, Callable[[], object]] = {
            "ours": lambda x=x: ours(measurer, x),
            "sum": lambda x=x: x.sum(),
            "sort": lambda x=x: torch.sort(x),
            "stats+hist": lambda x=x: with_histogram(measurer, x),
            "plain": lambda x=x: forward(plain, x),
            "observed": lambda x=x: forward(observed, x),
        }
        if n <= QUANTILE_LIMIT:
            candidates["obvious"] = lambda x=x: obvious(x)
            candidates["hand"] = lambda x=x: hand(x, quartiles)
        other = torch.randn(n) if n <= AFTER_SORT_LIMIT else None
        for repeat in range(repeats):  # rotating order, so drift hits every candidate alike
            names = list(candidates)
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                candidates[name]()  # untimed: the timed call follows a call of its own
                runs[name].append(timed(candidates[name]))
            if other is not None:
                torch.sort(other)
                runs["after sort"].append(timed(candidates["ours"]))
        runs["leaf"] = [o - p for o, p in zip(runs["observed"], runs["plain"], strict=True)]
        ms = {name: median(r) * 1e3 if r else math.nan for name, r in runs.items()}

        def ratio(a: str, b: str, runs: dict[str, list[float]] = runs) -> float:
            """Median of the per-repeat ratios (robust to load that shifts between repeats)."""
            return median([x / y for x, y in zip(runs[a], runs[b], strict=True)])

        got = ours(measurer, x)
        want = reference_quartiles(torch.sort(x).values)
        exact = [got[f"p{int(q * 100)}"] for q in QUARTILES] == want
        limited = n <= QUANTILE_LIMIT
        obvious_ms = f"{ms['obvious']:9.3f}" if limited else f"{'refuses':>9}"
        hand_ms = f"{ms['hand']:9.3f}" if limited else f"{'refuses':>9}"
        obvious_ratio = f"{ratio('obvious', 'sort'):9.3f}" if limited else f"{'-':>9}"
        hand_ratio = f"{ratio('stats+hist', 'hand'):9.3f}" if limited else f"{'-':>9}"
        after_ratio = f"{ratio('after sort', 'sort'):9.3f}" if other is not None else f"{'-':>9}"
        print(
            f"{n:>10} {ms['ours']:9.3f} {ms['sum']:9.3f} {ms['sort']:9.3f} {obvious_ms} "
            f"{ms['stats+hist']:10.3f} {hand_ms} {ms['leaf']:9.3f} | "
            f"{ratio('ours', 'sort'):9.3f} {after_ratio} {ratio('sum', 'sort'):9.3f} {obvious_ratio} "
            f"{ratio('stats+hist', 'sort'):9.3f} {hand_ratio} {ratio('leaf', 'sort'):9.3f} "
            f"{ms['leaf'] * 1e6 / n:10.3f}  {'exact' if exact else 'MISMATCH'}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remove_observer(observed)
    print("torch.quantile refuses inputs over 2**24 elements ('refuses').")
    print("leaf: per-sample cost of one observed ReLU leaf under no_grad (observed - plain).")
    print(
        f"aft/sort: ours timed right after torch.sort of another tensor (up to {AFTER_SORT_LIMIT})."
    )


if __name__ == "__main__":
    main()
