"""The spare core: plain CPU tensors measured on a worker thread when torch leaves a core idle.

Whether a core is spare is the process's real affinity against torch's thread count, so the
tests pin the process to one core or give it all of them (`os.sched_setaffinity`) under one
torch thread. Pinned down: the rows are those the training thread gives, bit for bit; a later
in-place op does not change what was measured (the conformance reference); copies beyond the cap
are measured at once; a forked child measures what waits itself; closing finishes everything.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer, spare_core
from torchinstruments.measurement import numerics, transfer
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.records import LayerInfo, MeasurementBlock, TensorKey
from torchinstruments.spare_core import (
    LARGEST_COPY,
    SMALLEST_COPY,
    Deferred,
    SpareCore,
    results,
    spare_core_count,
)

from hook_reference import run_both

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = [
    pytest.mark.skipif(len(CORES) < 2, reason="needs two cores for one to be spare"),
    pytest.mark.usefixtures("one_thread"),
]
WORKER = "torchinstruments-spare-core"


@contextmanager
def cores(count: int) -> Iterator[None]:
    """This process may run on its first `count` cores only, for the duration."""
    os.sched_setaffinity(0, CORES[:count])
    try:
        yield
    finally:
        os.sched_setaffinity(0, CORES)


def workers() -> list[threading.Thread]:
    """The spare-core threads alive now."""
    return [thread for thread in threading.enumerate() if thread.name == WORKER]


def convnet() -> nn.Module:
    """Outputs of 131,072 entries (at a batch of 8, the spare core's sizes) and 10; the batch
    norm's output is changed in place by the ReLU after it."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(16 * 32 * 32, 10),
    )


def train_step(model: nn.Module, _: int) -> torch.Tensor:
    """One forward and backward on a fixed batch."""
    output = model(torch.randn(8, 3, 32, 32))
    output.square().mean().backward()
    return output


def history_of(model: nn.Module, run_dir: Path, steps: int) -> tuple[pl.DataFrame, int]:
    """The rows of `steps` observed steps (timestamps dropped), and the spare-core threads
    alive after the first step."""
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    try:
        alive = 0
        for i in range(steps):
            torch.manual_seed(1000 + i)
            train_step(model, i)
            alive = alive or len(workers())
    finally:
        remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet").drop("timestamp")
    return history.sort("sample_id", "signal", "layer", "call_index", "metric"), alive


def test_the_spare_core_records_the_rows_the_training_thread_records(tmp_path: Path) -> None:
    model = convnet()
    twin = copy.deepcopy(model)
    before = len(workers())
    with cores(len(CORES)):
        spared, alive_spared = history_of(model, tmp_path / "spared", steps=2)
    with cores(1):
        here, alive_here = history_of(twin, tmp_path / "here", steps=2)
    assert alive_spared == before + 1, "the worker measured the run with a spare core"
    assert alive_here == before, "one core: nothing moved off the training thread"
    assert len(workers()) == before, "removal stops the worker"
    assert spared.height == here.height > 0
    assert spared.equals(here, null_equal=True)


def test_what_a_later_in_place_op_changes_was_measured_as_the_layer_returned(
    run_dir: Path,
) -> None:
    with cores(len(CORES)):
        conformance = run_both(convnet(), train_step, run_dir, steps=2)
    conformance.assert_conforms()
    batch_norm = conformance.history.filter(
        (pl.col("layer") == "1") & (pl.col("signal") == "output") & (pl.col("metric") == "min")
    )
    assert (batch_norm["value"] < 0).all(), "measured before the in-place ReLU"


def wait_on_the_worker(gate: threading.Event) -> None:
    """Hold the worker (and only the worker) until `gate` is set."""
    if threading.current_thread().name == WORKER:
        assert gate.wait(30)


def total(gate: threading.Event, tensor: torch.Tensor) -> float:
    """A job: the entries' sum, after the gate on the worker."""
    wait_on_the_worker(gate)
    return float(tensor.double().sum())


def test_copies_beyond_the_cap_are_measured_at_once_and_copies_do_not_change() -> None:
    gate = threading.Event()
    spare = SpareCore(max_bytes=3 * 4 * SMALLEST_COPY)  # three copies
    tensors = [torch.full((SMALLEST_COPY,), float(i + 1)) for i in range(5)]
    with cores(len(CORES)):
        launched = [spare.run(lambda t: total(gate, t), tensor) for tensor in tensors]
        for tensor in tensors:
            tensor.zero_()  # after `run`: the copies keep the values it was given
        assert [type(item) is Deferred for item in launched] == [True, True, True, False, False]
        assert launched[3:] == [4.0 * SMALLEST_COPY, 5.0 * SMALLEST_COPY], "at once, in `run`"
        gate.set()
        results = [item.result() for item in launched[:3] if isinstance(item, Deferred)]
        spare.close()
    assert results == [1.0 * SMALLEST_COPY, 2.0 * SMALLEST_COPY, 3.0 * SMALLEST_COPY]


def test_a_finished_copys_memory_takes_the_next_copy_of_its_size_and_a_failed_ones_does_not() -> (
    None
):
    """A layer's sizes repeat every sample: its next copy is written where the last one was
    (no fresh pages), with its own values; a job that raised keeps its copy to itself (its
    traceback may hold it)."""
    seen: list[tuple[int, float]] = []

    def job(copy: torch.Tensor) -> float:
        seen.append((copy.data_ptr(), float(copy.double().sum())))
        if seen[-1][1] < 0:
            raise ValueError("refused")
        return seen[-1][1]

    spare = SpareCore()
    with cores(len(CORES)):
        done = [results([spare.run(job, torch.full((SMALLEST_COPY,), v))])[0] for v in (1.0, 2.0)]
        failed = spare.run(job, torch.full((SMALLEST_COPY,), -1.0))
        with pytest.raises(ValueError, match="refused"):
            results([failed])
        after = results([spare.run(job, torch.full((SMALLEST_COPY,), 3.0))])
        half = results([spare.run(job, torch.full((2 * SMALLEST_COPY,), 4.0, dtype=torch.float16))])
        spare.close()
    assert done + after + half == [
        SMALLEST_COPY * 1.0,
        SMALLEST_COPY * 2.0,
        SMALLEST_COPY * 3.0,
        SMALLEST_COPY * 8.0,
    ]
    places = [place for place, _ in seen]
    assert places[0] == places[1] == places[2], "each copy where the finished one was"
    assert places[3] != places[2], "not where the failed job's copy is"
    assert places[4] == places[3], "the same bytes, another dtype"


def test_the_memory_kept_for_copies_is_bounded_and_keeps_the_sizes_used_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shapes that change every sample leave at most `MAX_BYTES_REUSED` behind: the sizes used
    longest ago are let go first, the newest stays for the next copy of its size."""
    monkeypatch.setattr(spare_core, "MAX_BYTES_REUSED", 3 * 4 * SMALLEST_COPY)
    spare, sizes = SpareCore(), [SMALLEST_COPY + extra for extra in range(6)]
    with cores(len(CORES)):
        for size in sizes:
            results([spare.run(lambda t: t.data_ptr(), torch.zeros(size))])
        kept = {nbytes // 4: len(buffers) for nbytes, buffers in spare._reused.items()}
        assert kept == {size: 1 for size in sizes[-2:]}, "two fit under the bound: the newest"
        place = spare._reused[4 * sizes[-1]][0].ctypes.data
        assert results([spare.run(lambda t: t.data_ptr(), torch.zeros(sizes[-1]))]) == [place]
        spare.close()
    assert not spare._reused, "let go at close"


def test_with_torch_on_every_core_nothing_is_copied() -> None:
    spare = SpareCore()
    tensor = torch.ones(SMALLEST_COPY)
    with cores(1):
        assert spare.run(lambda t: t.data_ptr(), tensor) == tensor.data_ptr()
    torch.set_num_threads(len(CORES))
    try:
        assert spare.run(lambda t: t.data_ptr(), tensor) == tensor.data_ptr()
    finally:
        torch.set_num_threads(1)
    copied = spare.run(lambda t: t.data_ptr(), tensor)
    assert isinstance(copied, Deferred)
    assert copied.result() != tensor.data_ptr()
    spare.close()


def test_a_child_forked_while_copies_wait_measures_them_itself() -> None:
    gate = threading.Event()
    spare = SpareCore()
    with cores(len(CORES)):
        waiting = spare.run(lambda t: total(gate, t), torch.full((SMALLEST_COPY,), 2.0))
        assert isinstance(waiting, Deferred)
        pid = os.fork()
        if pid == 0:  # the child: no worker thread; the copy is measured here
            os._exit(0 if waiting.result() == 2.0 * SMALLEST_COPY else 1)
        _, status = os.waitpid(pid, 0)
        gate.set()
        assert waiting.result() == 2.0 * SMALLEST_COPY
        spare.close()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_child_forked_while_the_lock_is_held_computes_what_waits_without_it() -> None:
    """The fork copies the core's one lock as it is: held, here, by the parent's thread. The
    child's `results` computes the waiting jobs without it (SIGALRM ends a child that hangs)."""
    gate = threading.Event()
    spare = SpareCore()
    with cores(len(CORES)):
        ones = torch.ones(SMALLEST_COPY)
        waiting = [spare.run(lambda t: total(gate, t), ones) for _ in range(3)]
        assert all(isinstance(item, Deferred) for item in waiting)
        with spare.lock:  # the worker can take none of them now
            pid = os.fork()
            if pid == 0:
                signal.alarm(20)
                gate.set()
                os._exit(0 if results(waiting) == [float(SMALLEST_COPY)] * 3 else 1)
        _, status = os.waitpid(pid, 0)
        gate.set()
        assert results(waiting) == [float(SMALLEST_COPY)] * 3
        spare.close()
    assert os.waitstatus_to_exitcode(status) == 0


def test_close_finishes_every_waiting_copy_then_stops_the_worker() -> None:
    gate = threading.Event()
    spare = SpareCore()
    before = len(workers())
    with cores(len(CORES)):
        ones = torch.ones(SMALLEST_COPY)
        waiting = [spare.run(lambda t: total(gate, t), ones) for _ in range(3)]
        assert len(workers()) == before + 1
        threading.Timer(0.2, gate.set).start()
        spare.close()
        assert all(isinstance(item, Deferred) for item in waiting)
        assert all(item.done for item in waiting if isinstance(item, Deferred))
        assert spare.run(lambda t: total(gate, t), ones) == SMALLEST_COPY, "closed: at once"
    assert len(workers()) == before


def test_the_lanes_kept_copies_are_bounded_and_released_at_the_end_of_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copies kept until the end of their pass count against `MAX_BYTES_HELD`: beyond it a
    tensor is measured at once (the host path: the same values); the pass's end frees them."""
    measurer = Measurer(None)
    spare = SpareCore()
    nbytes = 4 * 64 * 256
    monkeypatch.setattr(spare_core, "MAX_BYTES_HELD", 2 * nbytes)
    tensors = [torch.randn(64, 256) for _ in range(3)]
    with cores(1):  # no worker: only the bound is at work
        launched = [
            entry
            for index, tensor in enumerate(tensors)
            for entry in transfer.launch(measurer, key_of(index), tensor, False, spare)
        ]
        kinds = [type(item) for item in launched]
        copy = [TensorKey, int, np.ndarray, bool]  # a lane copy: key, time, values, focus
        assert kinds == [*copy, *copy, transfer.Measured]
        (record,) = transfer.build_records("output", launched, measurer.metrics, None, spare)
        assert spare.hold(2 * nbytes), "the pass's copies were released"
    block, metrics = record.measurements, measurer.metrics
    assert isinstance(block, MeasurementBlock)
    for index, tensor in enumerate(tensors):
        raw = numerics.measure_on_cpu(tensor, None).raw
        want = numerics.derived(raw, tensor.numel(), metrics)
        got = block.values[index * len(metrics) : (index + 1) * len(metrics)]
        assert list(got) == [want[metric].value for metric in metrics], (
            "the same bits on either path"
        )


def key_of(index: int) -> TensorKey:
    """The key of output `index` of sample 0."""
    return TensorKey(0, 0, LayerInfo(f"l{index}", "Linear"), 0, "output", "", "train", True)


def test_buffers_are_lent_to_one_pass_at_a_time_and_kept_for_the_next() -> None:
    spare = SpareCore()
    with spare.buffers() as buffers:
        first = buffers.array("ordered", 1000, np.float32)
        with spare.buffers() as other:  # a second pass at once: arrays of its own
            assert not np.shares_memory(other.array("ordered", 1000, np.float32), first)
    with spare.buffers() as buffers:
        again = buffers.array("ordered", 500, np.float32)
        assert np.shares_memory(again, first), "the next pass reuses the array"
        assert buffers.array("ordered", 2000, np.float32).size == 2000  # larger: a new one
        huge = buffers.array("huge", spare_core.KEPT_BYTES // 4 + 1, np.float32)
    with spare.buffers() as buffers:
        assert not np.shares_memory(buffers.array("huge", huge.size, np.float32), huge)
    spare.close()


def test_the_ranks_of_a_node_share_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert spare_core_count(1) == len(CORES) - 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(CORES)))
    assert spare_core_count(1) == 0, "one thread for each rank on the node: no core is spare"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert spare_core_count(1) == len(CORES) - 1


def test_the_caller_measures_what_the_worker_has_not_begun() -> None:
    gate, started = threading.Event(), threading.Event()
    spare = SpareCore()

    def where(tensor: torch.Tensor) -> str:
        if threading.current_thread().name == WORKER:
            started.set()
        wait_on_the_worker(gate)
        return threading.current_thread().name

    with cores(len(CORES)):
        launched = [spare.run(where, torch.ones(SMALLEST_COPY)) for _ in range(4)]
        assert started.wait(30)  # the worker has begun the first, and is held there
        threading.Timer(0.5, gate.set).start()
        names = results(launched)
        spare.close()
    assert names[0] == WORKER
    assert names[1:] == [threading.current_thread().name] * 3


def test_tensors_outside_the_copied_sizes_are_measured_where_they_are() -> None:
    spare = SpareCore()
    with cores(len(CORES)):
        for entries in (SMALLEST_COPY - 1, LARGEST_COPY + 1):
            tensor = torch.empty(entries)
            assert spare.run(lambda t: t.data_ptr(), tensor) == tensor.data_ptr()
        for entries in (SMALLEST_COPY, LARGEST_COPY):
            tensor = torch.empty(entries)
            copied = spare.run(lambda t: t.data_ptr(), tensor)
            assert isinstance(copied, Deferred)
            assert copied.result() != tensor.data_ptr()
        spare.close()


def test_a_torchvision_resnet_measured_on_the_spare_core_conforms(run_dir: Path) -> None:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    before, alive = len(workers()), []

    def step(observed: nn.Module, _: int) -> torch.Tensor:
        output = observed(torch.randn(4, 3, 64, 64))  # outputs of 65,536 to 262,144 entries
        output.square().mean().backward()
        alive.append(len(workers()))
        return output

    with cores(len(CORES)):
        conformance = run_both(model, step, run_dir, steps=2)
    conformance.assert_conforms()
    assert alive == [before + 1] * 2 + [before] * 2, "the observed steps used the worker"
