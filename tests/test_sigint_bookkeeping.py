"""Ctrl-C storms aimed at sampled steps: an interrupt inside the library's own bookkeeping.

A KeyboardInterrupt lands at an arbitrary bytecode of the main thread, the library's own code
included (restoring the layer proxies, ending a sample, a gradient hook, TensorBoard's queue).
Real SIGINTs are sent 2 ms apart to a child that samples every forward and catches
KeyboardInterrupt and goes on (a notebook cell run again). The model never changes (no
optimizer step) and each step's input is seeded by its step, so an uninterrupted twin run (in
the same child, before the first Ctrl-C) gives every sample's values: after each step no layer
keeps a proxy, after removal every forward is restored exactly, each sample has all its rows
or an `interrupted` marker, unmarked samples equal the twin's, and nothing hangs or prints a
thread traceback.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import (
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
    set_step,
)
from torchinstruments.interrupts import STUCK_S

SECONDS = 4.0
KEY = ["signal", "layer", "call_index", "tensor_path", "metric"]


def build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 1))


def inputs(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step % 4))


def proxies_left(model: nn.Module) -> int:
    """Modules (root excluded) with an instance `forward`: a layer proxy left installed."""
    return sum("forward" in module.__dict__ for module in list(model.modules())[1:])


def twin_main(run: Path) -> None:
    """The uninterrupted twin: one sampled step of each input (steps 1-4), then removal."""
    model = build()
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    for step in range(1, 5):
        set_step(model, step)
        model(inputs(step)).sum().backward()
    remove_observer(model)


def child_main(run: Path, seconds: float, twin: Path) -> None:
    """The twin run first, before any Ctrl-C is sent (one interpreter importing torch serves
    both), then sample every forward for `seconds`, catching Ctrl-C; print what the loop saw."""
    torch.set_num_threads(1)
    twin_main(twin)
    model = build()
    inject_observer(
        model,
        output_dir=run,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=2000, flush_seconds=0.5),
    )
    seen = {"step": 0, "left": 0}

    def steps() -> None:
        while time.monotonic() < end or seen["step"] < 4:
            seen["step"] += 1
            set_step(model, seen["step"])
            try:
                model(inputs(seen["step"])).sum().backward()
            finally:
                seen["left"] += proxies_left(model) > 0  # after each step, interrupted or not

    end = 0.0
    steps()  # before the storm: every lazy import is done
    # The twin's objects are freed before the storm, as they were when the twin ran in a process
    # of its own: a Ctrl-C that lands in a weakref callback the collector runs (a WeakSet's
    # `_remove`) is printed by Python as "Exception ignored", whoever owns the set.
    gc.collect()
    print("ready", flush=True)
    end = time.monotonic() + seconds
    # A loop's back edge outside its `try` is where a Ctrl-C would end the child: each level's
    # back edge is inside the next level's `try`.
    while time.monotonic() < end:
        try:
            while time.monotonic() < end:
                try:  # noqa: SIM105 (a context manager's __exit__ is where a Ctrl-C lands)
                    steps()
                except KeyboardInterrupt:
                    pass
        except KeyboardInterrupt:
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late one must not cut the removal
    remove_observer(model)
    restored = all("forward" not in module.__dict__ for module in model.modules())
    print(json.dumps({**seen, "restored": restored}), flush=True)


def rows_by_step(history: pl.DataFrame) -> dict[int, dict[tuple, float | None]]:
    """Per step % 4: (signal, layer, call_index, tensor_path, metric) -> value."""
    out: dict[int, dict[tuple, float | None]] = {}
    for row in history.iter_rows(named=True):
        out.setdefault(row["step"] % 4, {})[tuple(row[k] for k in KEY)] = row["value"]
    return out


def run_child(run: Path, seconds: float, twin: Path) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    child = subprocess.Popen(
        [sys.executable, __file__, str(run), str(seconds), str(twin)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    sent = 0
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        end = time.monotonic() + seconds - 0.5
        while time.monotonic() < end and child.poll() is None:
            time.sleep(0.002)
            child.send_signal(signal.SIGINT)
            sent += 1
        out, err = child.communicate(timeout=30)  # no hang
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert sent > 500
    assert child.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # no thread died, nothing escaped
    return json.loads(out.strip().splitlines()[-1]), err


def test_sigint_storms_on_sampled_steps_leave_no_proxy_and_no_silent_partial_sample(
    tmp_path: Path,
) -> None:
    seen, err = run_child(tmp_path / "storm", SECONDS, tmp_path / "twin")
    assert seen["left"] == 0, seen  # no layer proxy after any step
    assert seen["restored"], seen  # removal restored every forward exactly
    assert "sampled calls" not in err, err[-3000:]  # no call counted twice
    assert "detached" not in err, err[-3000:]
    twin = rows_by_step(pl.read_parquet(tmp_path / "twin" / "history.parquet"))
    assert set(twin) == {0, 1, 2, 3}

    history = pl.read_parquet(tmp_path / "storm" / "history.parquet")
    assert history.filter(pl.col("call_index") > 0).height == 0  # each layer once per sample
    markers = history.filter(pl.col("metric") == "interrupted")
    samples = history.filter(pl.col("metric") != "interrupted").partition_by(
        "sample_id", as_dict=True
    )
    clean = 0
    for (sample_id,), rows in samples.items():
        step = rows["step"][0]
        mine = rows_by_step(rows)[step % 4]
        for signal_name in ("output", "output_gradient"):
            got = {k: v for k, v in mine.items() if k[0] == signal_name}
            want = {k: v for k, v in twin[step % 4].items() if k[0] == signal_name}
            marked = markers.filter(
                (pl.col("sample_id") == sample_id) & (pl.col("signal") == signal_name)
            ).height
            if signal_name == "output_gradient" and not got and not marked:
                continue  # the step was cut before its backward reached any sampled output
            assert marked <= 1, (sample_id, signal_name)
            if not marked:  # all its rows, each the twin's value
                assert got == want, (sample_id, signal_name, set(want) - set(got))
            else:  # partial, marked: what it has is the twin's
                assert all(want[k] == v for k, v in got.items()), (sample_id, signal_name)
        clean += not markers.filter(pl.col("sample_id") == sample_id).height
    assert clean > 20  # most samples ran to the end


class HangingSink:
    """A user's sink whose write hangs (a network call without a timeout)."""

    def start(self, run: object) -> None:
        pass

    def write_forward(self, record: object) -> None:
        print("hanging", flush=True)
        time.sleep(120)

    def write_backward(self, record: object) -> None:
        pass

    def close(self, counts: object) -> None:
        pass


def hanging_main(run: Path) -> None:
    """One sampled step whose sink hangs; say how the Ctrl-Cs ended it."""
    model = build()
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), sinks=[HangingSink()])
    try:
        model(inputs(0))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    model(inputs(1))  # the next root forward heals the cut end (the sink is detached or hangs)


def test_a_second_ctrl_c_ends_a_step_whose_sink_hangs(tmp_path: Path) -> None:
    """A held Ctrl-C waits for the section's end; when a user's sink hangs there, Ctrl-C pressed
    again (`interrupts.STUCK_S` after the first) raises KeyboardInterrupt. Pressed every half
    second, as a user does: the second press did it 5 times in 6 here, the third the sixth."""
    child = subprocess.Popen(
        [sys.executable, __file__, "hang", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "hanging"
        child.send_signal(signal.SIGINT)  # held: the step's end is a held section
        time.sleep(STUCK_S + 0.5)
        assert child.poll() is None  # still hanging: the first Ctrl-C was held
        started = time.monotonic()
        while not select.select([child.stdout], [], [], 0.5)[0]:  # pressed again until it ends
            assert time.monotonic() - started < 10, "Ctrl-C pressed again did not end the step"
            child.send_signal(signal.SIGINT)
        assert child.stdout.readline().strip() == "interrupted"
    finally:
        child.kill()
        child.wait()


if __name__ == "__main__":
    if sys.argv[1] == "hang":
        hanging_main(Path(sys.argv[2]))
    else:
        child_main(Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3]))
