"""CPU time of TensorBoard's writer thread per sampled step, as the run directory writes events.

Run: `uv run bench/event_writer.py [--steps 200]` (Linux: reads /proc/self/task/*/stat)

The MLP of `bench/sampled.py` (17 leaf calls, 8 focus layers: 16 histograms per step), every
step sampled, in three variants one after the other in this process:

* `per histogram, TB checksum`: one event per histogram and TensorBoard's pure-Python CRC-32C
  (what the run directory did before `torchinstruments.events`);
* `per record, TB checksum`: one event per sampled forward or backward;
* `per record, Crc32c`: the same with the NumPy checksum (the default).

Printed per step: the writer thread's CPU time (all of it holds the GIL, so it is taken from the
training thread), the training thread's CPU time and the wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from sampled import mlp, training_step

import torchinstruments.events as events
from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from _machine import print_machine


def thread_cpu_seconds(native_id: int) -> float:
    """User + system CPU seconds of one thread of this process."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Patches `torchinstruments.events` into the named variant for the duration."""
    hand_over = events._hand_over_checksum
    add_histograms = events.EventFile.add_histograms
    if "TB checksum" in name:
        events._hand_over_checksum = lambda *args: None  # type: ignore[assignment]
    if "per histogram" in name:

        def one_event_each(self: Any, histograms: Any, step: int) -> None:
            for histogram in histograms:
                add_histograms(self, [histogram], step)

        events.EventFile.add_histograms = one_event_each  # type: ignore[method-assign]
    try:
        yield
    finally:
        events._hand_over_checksum = hand_over  # type: ignore[assignment]
        events.EventFile.add_histograms = add_histograms  # type: ignore[method-assign]


def measure(name: str, steps: int) -> tuple[float, float, float]:
    """Writer-thread CPU, training-thread CPU and wall milliseconds per step."""
    model, x = mlp()
    with variant(name):
        inject_observer(
            model, output_dir=Path(tempfile.mkdtemp()) / "s", sampler=EveryNForwardsSampler(1)
        )
        try:
            for _ in range(10):  # warm-up
                training_step(model, x, lambda: None)
            writers = [
                t.native_id
                for t in threading.enumerate()
                if t.name.startswith("Thread-") and t.native_id is not None
            ]
            main = threading.main_thread().native_id
            assert main is not None
            start = {i: thread_cpu_seconds(i) for i in [*writers, main]}
            wall = time.perf_counter()
            for _ in range(steps):
                training_step(model, x, lambda: None)
            wall = time.perf_counter() - wall
            writer = sum(thread_cpu_seconds(i) - start[i] for i in writers)
            training = thread_cpu_seconds(main) - start[main]
        finally:
            remove_observer(model)
    return writer / steps * 1e3, training / steps * 1e3, wall / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print_machine()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, MLP, every step sampled, ms per step")
    print(f"{'variant':30s} {'writer CPU':>11s} {'training CPU':>13s} {'wall':>7s}")
    for name in ("per histogram, TB checksum", "per record, TB checksum", "per record, Crc32c"):
        writer, training, wall = measure(name, args.steps)
        print(f"{name:30s} {writer:11.2f} {training:13.2f} {wall:7.2f}")


if __name__ == "__main__":
    main()
