"""Cost of one histogram relative to the default statistics of the same tensor (CPU, float32).

For each size, times a histogram alone (`Measurer([DefaultStatistics(())])`'s
`launch_with_histogram`) and `Measurer(None).launch`, each resolved, on the same randn tensor,
interleaved, and prints the medians and their ratio.

Run: `uv run bench/histograms.py [--sizes 1e5,1e6] [--bins 64] [--threads 1]`
"""

from __future__ import annotations

import argparse

import torch

from torchinstruments.measurement import histograms
from torchinstruments.measurement.histograms import DEFAULT_BINS
from torchinstruments.measurement.reducers import DefaultStatistics, Measurer
from torchinstruments.records import LayerInfo, TensorKey

from _machine import print_machine
from _timing import median, timed

# The key a benchmark's histogram is recorded under.
KEY = TensorKey(0, 0, LayerInfo("bench", "Identity"), 0, "output", "", "train", True)


def main() -> None:
    """Prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e4,1e5,1e6")
    parser.add_argument("--bins", type=int, default=DEFAULT_BINS)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0: default")
    args = parser.parse_args()
    print_machine()
    if args.threads:
        torch.set_num_threads(args.threads)
    measurer = Measurer(None)
    histogram_only = Measurer([DefaultStatistics(())])

    def statistics_once(x: torch.Tensor) -> None:
        pending = measurer.launch(x)
        vector = pending.device_vector
        pending.resolve([] if vector is None else vector.tolist())

    def histogram_once(x: torch.Tensor) -> None:
        pending = histogram_only.launch_with_histogram(x, args.bins)[1]
        if isinstance(pending, torch.Tensor):  # the general path's: read with the transfer
            pending = pending.tolist()
        histograms.record(pending or [], args.bins, KEY, "output")

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.bins} bins, median ms"
    )
    print(f"{'n':>10} {'histogram':>10} {'statistics':>10} {'hist/stats':>10}")
    torch.manual_seed(0)
    for n in (int(float(s)) for s in args.sizes.split(",")):
        x = torch.randn(n)
        histogram_once(x)
        statistics_once(x)
        hist, stats = [], []
        for _ in range(args.repeats):
            hist.append(timed(lambda x=x: histogram_once(x)))
            stats.append(timed(lambda x=x: statistics_once(x)))
        h, s = median(hist) * 1e3, median(stats) * 1e3
        print(f"{n:>10} {h:10.3f} {s:10.3f} {h / s:10.3f}")


if __name__ == "__main__":
    main()
