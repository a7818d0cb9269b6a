"""Cost of the general (sync-free) path's default profile and histogram of one CPU tensor.

The general path (`numerics.raw_on_device`, order statistics by `order.on_device`) is what a
GPU runs, and on the CPU what a tensor subclass NumPy cannot read runs: `Measurer(...,
host_paths=False)` sends every tensor there. Its radix select counts 16 bits of each key a pass
(few kernels, where each is a launch), 8 on a CPU tensor of at most 2**14 entries, whose
2**16 buckets per rank cost more than the entries. Per size and dtype: the median ms of
`launch_with_histogram` and `resolve` (both halves, as the observer runs them), after warm-up
calls.

Run: `uv run bench/general_path.py [--sizes 1e3,16384,1e5] [--repeats 15] [--threads 1]`
"""

from __future__ import annotations

import argparse
import time

import torch

from torchinstruments.measurement.reducers import Measurer

from _machine import print_machine
from _timing import median


def one_tensor(measurer: Measurer, x: torch.Tensor) -> None:
    """The default profile and 64-bin histogram of `x`, both halves."""
    reduction, _ = measurer.launch_with_histogram(x)
    vector = reduction.device_vector
    reduction.resolve([] if vector is None else vector.tolist())


def ms_per_tensor(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Median ms of `one_tensor` on `n` random entries of `dtype`."""
    x = torch.randn(n, dtype=dtype)
    measurer = Measurer(None, host_paths=False)
    for _ in range(3):
        one_tensor(measurer, x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_tensor(measurer, x)
        times.append(time.perf_counter() - start)
    return median(times) * 1e3


def main() -> None:
    """Prints one line per size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e3,16384,1e5")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    print_machine()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median ms per tensor")
    print(f"{'n':>10} {'float32':>9} {'float64':>9}")
    for n in (int(float(size)) for size in args.sizes.split(",")):
        f32, f64 = (
            ms_per_tensor(n, dtype, args.repeats) for dtype in (torch.float32, torch.float64)
        )
        print(f"{n:>10} {f32:9.2f} {f64:9.2f}")


if __name__ == "__main__":
    main()
