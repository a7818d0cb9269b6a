"""Selected layers called on other threads during a sampled forward.

A model may run branches of its forward on a thread pool (a multi-tower or ensemble model): the
layers called there belong to the sampled root forward in flight, as plain hooks see them, so
their rows equal the reference's (outputs and gradients, call indices counted in the sample).
A call that cannot be attributed (several sampled forwards in flight) or that returns after its
sampled forward ended runs unmeasured, and the run says how many and why (a warning, index.md).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history, read_result
from hook_reference import run_both

# The models' pools, outside them: a deep copy (the reference's) cannot copy an executor. The
# models compared with plain hooks run their branches on ONE thread, so the observed run and the
# reference's copy compute on the same thread: a thread's count of intra-op threads is its own,
# taken from torch's setting at its first parallel op. Until then it computes with the default
# count, so a new thread's first matmul can round apart from its later ones after an earlier
# test's `torch.set_num_threads(1)`: the thread is made to take its count here, at import.
ONE = ThreadPoolExecutor(1)
ONE.submit(torch.get_num_threads).result()
POOL = ThreadPoolExecutor(2)  # two root forwards' branches at once


class Towers(nn.Module):
    """Two towers on a thread pool; tower `a` calls its shared activation twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.act = nn.Tanh()
        self.head = nn.Linear(8, 2)

    def tower_a(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.a(self.act(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = ONE.submit(self.tower_a, x).result()  # in order: call indices are fixed
        second = ONE.submit(self.b, x).result()
        return self.head(torch.cat([first, second], -1))


def squares_step(model: nn.Module, i: int) -> torch.Tensor:
    output = model(torch.randn(3, 4))
    output.square().sum().backward()
    return output


def test_layers_called_on_a_thread_pool_inside_a_sampled_forward_match_plain_hooks(
    run_dir: Path,
) -> None:
    result = run_both(Towers(), squares_step, run_dir, steps=2)
    result.assert_conforms()
    outputs = result.history.filter(signal="output", metric="mean")
    assert sorted(outputs.filter(layer="act", sample_id=1)["call_index"]) == [0, 1]
    gradients = result.history.filter(signal="output_gradient", metric="mean")
    assert set(gradients["layer"]) == {"a", "b", "act", "head"}
    assert {entry["layer"]: entry["sampled_forwards"] for entry in read_result(run_dir)} == {
        "a": 2,
        "b": 2,
        "act": 2,
        "head": 2,
    }


class EncoderOnAThread(nn.Module):
    """An encoder layer (a fused kernel in eval under no_grad) run on a thread pool."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # grad mode is per thread: set where the encoder runs
            return self.encoder(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ONE.submit(self.encode, x).result()


def test_a_fused_layer_on_a_thread_pool_runs_layer_by_layer_and_matches_plain_hooks(
    run_dir: Path,
) -> None:
    def step(model: nn.Module, i: int) -> torch.Tensor:
        return model(torch.randn(2, 5, 8))

    result = run_both(EncoderOnAThread().eval(), step, run_dir)
    result.assert_conforms()
    assert "encoder.linear1" in set(result.history["layer"])


class Meets(nn.Module):
    """Two root forwards held in flight together (a barrier), each calling `branch` on a pool."""

    def __init__(self) -> None:
        super().__init__()
        self.barrier = threading.Barrier(2, timeout=30)
        self.branch = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.barrier.wait()  # both sampled forwards are in flight from here
        branch = POOL.submit(self.branch, x).result()
        self.barrier.wait()  # and until both branches have run
        return self.head(branch)


def test_calls_on_a_thread_pool_during_several_sampled_forwards_are_counted_and_said(
    run_dir: Path,
) -> None:
    model = Meets()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    errors: list[BaseException] = []

    def forward() -> None:
        try:
            model(torch.randn(3, 4))
        except BaseException as error:
            errors.append(error)

    def two_forwards_at_once() -> None:
        threads = [threading.Thread(target=forward) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    with pytest.warns(RuntimeWarning, match="several sampled forwards were in flight"):
        two_forwards_at_once()
    with pytest.warns(RuntimeWarning, match=r"never ran.*'branch'"):
        remove_observer(model)
    assert not errors
    assert set(read_history(run_dir)["layer"]) == {"head"}  # each thread's own calls
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "these ran unmeasured and have no rows: 2 calls made while several sampled " in index


class Waits(nn.Module):
    """Says it has started, then waits for `release` before it returns its input doubled."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = release

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.started.set()
        self.release.wait(30)
        return x * 2


class LeavesABranchRunning(nn.Module):
    """Submits `branch` to a pool and returns without waiting for it to end."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.branch = Waits(release)
        self.head = nn.Linear(4, 4)
        self.pending: Future[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pending = POOL.submit(self.branch, x)
        self.branch.started.wait(30)
        return self.head(x)


def test_a_call_on_another_thread_that_returns_after_its_sampled_forward_is_counted_and_said(
    run_dir: Path,
) -> None:
    release = threading.Event()
    model = LeavesABranchRunning(release)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4))  # returns while `branch` is running on the pool
    release.set()
    assert model.pending is not None
    with pytest.warns(RuntimeWarning, match="returned after that forward had ended"):
        model.pending.result(30)
    with pytest.warns(RuntimeWarning, match=r"never ran.*'branch'"):
        remove_observer(model)
    assert set(read_history(run_dir)["layer"]) == {"head"}
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "1 call that began during a sampled forward and returned after it had ended" in index


class Gate(nn.Module):
    """Returns its input once `opened` is set, after setting `inside`."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.opened = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inside.set()
        assert self.opened.wait(timeout=60)
        return x


def test_a_layer_two_observed_models_share_keeps_each_models_calls_on_its_thread(
    tmp_path: Path,
) -> None:
    """Model b's forward on the main thread calls the shared layer while model a's sampled
    forward is in flight on another: that call is b's, and a's sample had it as a second call."""
    shared, gate = nn.Linear(4, 4), Gate()
    a, b = nn.Sequential(shared, gate), nn.Sequential(shared, nn.Tanh())
    for name, model in (("a", a), ("b", b)):
        inject_observer(model, output_dir=tmp_path / name, sampler=EveryNForwardsSampler(1))
    x_a, x_b = torch.randn(3, 4), torch.randn(3, 4) + 5
    thread = threading.Thread(target=a, args=(x_a,))
    thread.start()
    assert gate.inside.wait(timeout=60)
    b(x_b)
    gate.opened.set()
    thread.join(timeout=60)
    remove_observer(a)
    remove_observer(b)
    for name, x in (("a", x_a), ("b", x_b)):
        rows = read_history(tmp_path / name).filter(layer="0", signal="output", metric="max")
        assert rows.select("sample_id", "call_index").rows() == [(0, 0)]
        assert rows["value"].item() == pytest.approx(shared(x).max().item(), rel=1e-6)
