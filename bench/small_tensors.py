"""Small CPU tensors of one sample: one segmented batch, or one NumPy sort each?

Times `numerics.measure_batch_on_cpu` over k tensors of n entries (every other one with a 64-bin
histogram, as focus layers are mixed with others) against `numerics.measure_on_cpu` of each, in
one process, and prints both in microseconds per call with their ratio. `numerics.BATCH_MIN` is
the k from which the batch is used; this is the table it was read from.

Run: `uv run bench/small_tensors.py [--sizes 16,640,4096] [--counts 1,2,4,8,16,32,64]`
"""

from __future__ import annotations

import argparse

import torch

from torchinstruments.measurement import numerics

from _machine import print_machine
from _timing import median, time_steps

WANTED = frozenset(
    {"mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction"}
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,640,4096")
    parser.add_argument("--counts", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print_machine()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, BATCH_MIN = {numerics.BATCH_MIN}")
    print(f"{'entries':>8} {'tensors':>8} {'batch us':>10} {'each us':>10} {'batch/each':>11}")
    for size in (int(float(s)) for s in args.sizes.split(",")):
        for count in (int(c) for c in args.counts.split(",")):
            segments = [torch.randn(size) for _ in range(count)]
            bins = [64 if index % 2 else None for index in range(count)]

            def batch(segments: list[torch.Tensor] = segments, bins: list = bins) -> None:
                numerics.measure_batch_on_cpu(segments, WANTED, bins)

            def each(segments: list[torch.Tensor] = segments, bins: list = bins) -> None:
                for segment, segment_bins in zip(segments, bins, strict=True):
                    numerics.measure_on_cpu(segment, WANTED, segment_bins)

            batched, single = [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                batched.append(time_steps(batch, 20))
                single.append(time_steps(each, 20))
            b, e = median(batched) * 1e6, median(single) * 1e6
            print(f"{size:>8} {count:>8} {b:>10.1f} {e:>10.1f} {b / e:>11.2f}")


if __name__ == "__main__":
    main()
