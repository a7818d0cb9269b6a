"""A process forked from an observing one runs the model unobserved and leaves the run alone.

Real processes, each bounded by a timeout: `os.fork` in a script (each script a process forked,
all at once, from one interpreter that imported torch and never observed, `_forked`; the child
ends through the normal interpreter exit, atexit handlers included), a 'fork' Hogwild pair
training one shared model with torch.multiprocessing, and DataLoader workers started with
'fork'. Every forward is
sampled and `buffer_rows` is tiny, so a child that still recorded would write (or hang writing)
a part at its first sampled step. The parent's run must be complete afterwards, with exactly the
parent's samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from _forked import fork_each, run_forked, stderr_of
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import (
    EveryNForwardsSampler,
    HistoryConfig,
    has_observer,
    inject_observer,
    remove_observer,
)
from torchinstruments.registry import OBSERVERS

from conftest import sgd_step, wait_for_rows

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")

CHILD_TIMEOUT_S = 60.0
HELD_LOCK_TIMEOUT_S = 10.0  # a child that takes a lock held at the fork waits for ever
LAYERS = 3
ROWS_PER_SAMPLE = LAYERS * 9 * 2  # default metrics x (output, output_gradient)
# flush_seconds is long so that nothing but the parent's own appends writes a part
CONFIG = HistoryConfig(buffer_rows=16, flush_seconds=600.0)


def small_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def first_weight(model: nn.Sequential) -> torch.Tensor:
    layer = model[0]
    assert isinstance(layer, nn.Linear)
    return layer.weight


def snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under the run directory (the event file aside: the parent's own TensorBoard
    thread may still be writing it): size, mtime and content hash."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and "tensorboard" not in path.parts:
            data = path.read_bytes()
            stat = path.stat()
            found[str(path.relative_to(directory))] = (
                stat.st_size,
                stat.st_mtime_ns,
                hashlib.sha256(data).hexdigest(),
            )
    return found


def tensorboard_steps(directory: Path) -> set[int]:
    """Steps of every histogram in the run's event files, as TensorBoard reads them."""
    accumulator = EventAccumulator(str(directory / "tensorboard"), size_guidance={HISTOGRAMS: 0})
    accumulator.Reload()
    tags: dict[str, Any] = accumulator.Tags()
    return {event.step for tag in tags["histograms"] for event in accumulator.Histograms(tag)}


def fds_on(path: Path) -> list[str]:
    """This process's open descriptors that point at `path` (Linux /proc)."""
    fd_dir = Path("/proc/self/fd")
    found = []
    for fd in fd_dir.iterdir():
        try:
            if os.readlink(fd) == str(path):
                found.append(fd.name)
        except OSError:
            continue
    return found


def script_main(directory: Path, report: Path) -> None:
    """Inject, train, fork; the child trains too and exits normally; the parent then checks
    that its directory is byte-for-byte what it was at the fork, trains on and removes."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = small_model()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    for _ in range(3):
        sgd_step(model, x, y, 0.01)
    # sample 0's rows at once, then the full chunks of the next two (the flush thread's): what
    # is left (less than a chunk) waits for flush_seconds, so nothing writes while the child runs
    chunk = CONFIG.buffer_rows
    wait_for_rows(directory, ROWS_PER_SAMPLE + 2 * ROWS_PER_SAMPLE // chunk * chunk)
    before = snapshot(directory)
    child_report = report.with_name("child.json")
    pid = os.fork()
    if pid == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                sgd_step(model, x, y, 0.01)
        try:
            inject_observer(nn.Linear(2, 2), output_dir=report.with_name("child-run"))
            refused = ""
        except RuntimeError as error:
            refused = str(error)
        facts = {
            "warnings": [str(w.message) for w in caught],
            "lock_fds": fds_on(directory / ".lock") if Path("/proc/self/fd").is_dir() else None,
            "refused": refused,
            "removed": str(remove_observer(model)),
            "observed_after_remove": has_observer(model),
        }
        child_report.write_text(json.dumps(facts), encoding="utf-8")
        sys.exit(0)  # the normal exit: atexit and weakref.finalize handlers run
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    after_child = snapshot(directory)
    event_steps = sorted(tensorboard_steps(directory))
    for _ in range(2):
        sgd_step(model, x, y, 0.01)
    remove_observer(model)
    facts = {
        "child_status": status,
        "untouched": before == after_child,
        "event_steps": event_steps,
        "child": json.loads(child_report.read_text("utf-8")) if child_report.exists() else None,
    }
    report.write_text(json.dumps(facts), encoding="utf-8")


def assert_parent_run_complete(directory: Path, samples: int) -> None:
    """index.md says complete and history holds exactly the parent's samples, all rows."""
    index = (directory / "index.md").read_text("utf-8")
    assert "**State: complete.**" in index
    history = pl.read_parquet(directory / "history.parquet")
    assert sorted(history["sample_id"].unique()) == list(range(samples))
    assert sorted(history["forward_index"].unique()) == list(range(samples))
    assert history.height == samples * ROWS_PER_SAMPLE
    assert list((directory / "history.parts").glob("*")) == []


@pytest.mark.timeout(150)
def test_os_fork_child_runs_unobserved_and_never_touches_the_parents_run(
    scripts: tuple[Path, dict[str, int]],
) -> None:
    tmp_path = ran(scripts, "plain")
    directory, report = tmp_path / "run", tmp_path / "report.json"
    facts = json.loads(report.read_text("utf-8"))
    assert facts["child_status"] == 0, "the forked child hung or failed"
    assert facts["untouched"], "the child changed a file of the parent's run directory"
    assert set(facts["event_steps"]) <= {0, 1, 2}  # the parent's samples before the fork only
    child = facts["child"]
    forked = [m for m in child["warnings"] if "forked from the observing process" in m]
    assert len(forked) == 1, child["warnings"]
    assert str(directory) in forked[0]
    assert child["lock_fds"] in (None, [])  # the child holds no descriptor of the parent's lock
    assert "forked from a process with a live torchinstruments run" in child["refused"]
    assert child["removed"] == "None"
    assert not child["observed_after_remove"]
    assert not (tmp_path / "child-run").exists()
    assert_parent_run_complete(directory, samples=5)


def hogwild_worker(model: nn.Module, seed: int, steps: int, done: Any) -> None:
    """One Hogwild trainer: SGD steps on the shared parameters; reports its warnings."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            sgd_step(model, x, y, 0.05)
    done.put([str(w.message) for w in caught if "torchinstruments" in str(w.message)])


@pytest.mark.timeout(150)
def test_hogwild_fork_pair_trains_the_shared_model_unobserved(
    tmp_path: Path, cleanup: list[nn.Module]
) -> None:
    torch.set_num_threads(1)
    model = small_model()
    model.share_memory()
    cleanup.append(model)
    directory = tmp_path / "run"
    inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(2):
        sgd_step(model, x, y, 0.01)
    weights = first_weight(model).detach().clone()
    context = torch.multiprocessing.get_context("fork")
    done = context.SimpleQueue()
    workers = [
        context.Process(target=hogwild_worker, args=(model, seed, 10, done)) for seed in (1, 2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(CHILD_TIMEOUT_S)
    hung = [w.pid for w in workers if w.is_alive()]
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert not hung, f"Hogwild workers {hung} did not finish within {CHILD_TIMEOUT_S} s"
    assert [w.exitcode for w in workers] == [0, 0]
    reports = [done.get() for _ in workers]
    for messages in reports:
        assert len(messages) == 1, messages
        assert "runs unobserved" in messages[0]
    assert not torch.equal(first_weight(model), weights)  # the workers trained the shared model
    for _ in range(2):
        sgd_step(model, x, y, 0.01)
    remove_observer(model)
    assert_parent_run_complete(directory, samples=4)


@pytest.mark.timeout(150)
def test_dataloader_fork_workers_leave_the_run_complete(
    tmp_path: Path, cleanup: list[nn.Module]
) -> None:
    model = small_model()
    cleanup.append(model)
    directory = tmp_path / "run"
    inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    loader = DataLoader(
        data,
        batch_size=8,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=CHILD_TIMEOUT_S,  # a worker that hangs fails the test instead of blocking it
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in loader:
            sgd_step(model, x, y, 0.01)
    assert not [w for w in caught if "forked" in str(w.message)]
    remove_observer(model)
    assert_parent_run_complete(directory, samples=6)


def wait_child(pid: int, timeout: float) -> int | None:
    """The child's exit code, or None when it had not ended after `timeout` s (then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def child_run(directory: Path, report: Path) -> None:
    """In a forked child: try to observe a model of its own for two steps; report how it went."""
    model = small_model()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    try:
        inject_observer(
            model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
        )
    except RuntimeError as error:
        report.write_text(json.dumps({"refused": str(error)}), encoding="utf-8")
        os._exit(0)
    for _ in range(2):
        sgd_step(model, x, y, 0.01)
    remove_observer(model)
    report.write_text(json.dumps({"refused": ""}), encoding="utf-8")
    os._exit(0)


def after_removal_main(directory: Path, report: Path) -> None:
    """Fork before any inject (that child observes a run of its own), then inject, train,
    remove, and fork again: that child's inject_observer must be refused, never hang."""
    torch.set_num_threads(1)
    before_report, after_report = report.with_name("before.json"), report.with_name("after.json")
    pid = os.fork()
    if pid == 0:
        child_run(directory.with_name("child-before"), before_report)
    before_status = wait_child(pid, CHILD_TIMEOUT_S)
    model = small_model()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    for _ in range(3):
        sgd_step(model, x, y, 0.01)
    remove_observer(model)
    pid = os.fork()
    if pid == 0:
        child_run(directory.with_name("child-after"), after_report)
    after_status = wait_child(pid, 30.0)
    facts = {
        "before_status": before_status,
        "before": json.loads(before_report.read_text("utf-8")) if before_report.exists() else None,
        "after_status": after_status,
        "after": json.loads(after_report.read_text("utf-8")) if after_report.exists() else None,
    }
    report.write_text(json.dumps(facts), encoding="utf-8")


@pytest.mark.timeout(150)
def test_a_child_forked_after_a_run_ended_is_refused_at_inject_instead_of_hanging(
    scripts: tuple[Path, dict[str, int]],
) -> None:
    tmp_path = ran(scripts, "after-removal")
    report = tmp_path / "report.json"
    facts = json.loads(report.read_text("utf-8"))
    # forked before the parent's first inject: free to observe, and its run completes
    assert facts["before_status"] == 0
    assert facts["before"] == {"refused": ""}
    assert "**State: complete.**" in (tmp_path / "child-before" / "index.md").read_text("utf-8")
    # forked after a run ended: refused with the reason and what to do, and never hangs
    assert facts["after_status"] == 0, "the child forked after removal hung or failed"
    refused = facts["after"]["refused"]
    assert "forked from a process" in refused
    assert "Polars' thread pool" in refused
    assert "'spawn'" in refused
    assert "fork before the parent's first inject_observer" in refused
    assert not (tmp_path / "child-after").exists()


def after_refusal_main(directory: Path, report: Path) -> None:
    """An inject refused before any run opened here (the directory holds a run), then a fork:
    that child may observe a run of its own, as one forked before any inject may."""
    torch.set_num_threads(1)
    directory.mkdir(parents=True)
    (directory / "index.md").write_text("a run of another job\n", encoding="utf-8")
    refused = ""
    try:
        inject_observer(small_model(), output_dir=directory)
    except FileExistsError as error:
        refused = str(error)
    child_report = report.with_name("after-refusal.json")
    pid = os.fork()
    if pid == 0:
        child_run(directory.with_name("child-after-refusal"), child_report)
    status = wait_child(pid, CHILD_TIMEOUT_S)
    child = json.loads(child_report.read_text("utf-8")) if child_report.exists() else None
    facts = {"refused": refused, "status": status, "child": child}
    report.write_text(json.dumps(facts), encoding="utf-8")


@pytest.mark.timeout(150)
def test_a_child_forked_after_a_refused_inject_may_observe_a_run_of_its_own(
    scripts: tuple[Path, dict[str, int]],
) -> None:
    tmp_path = ran(scripts, "after-refusal")
    report = tmp_path / "report.json"
    facts = json.loads(report.read_text("utf-8"))
    assert "already holds a run" in facts["refused"]
    assert facts["status"] == 0
    assert facts["child"] == {"refused": ""}
    index = (tmp_path / "child-after-refusal" / "index.md").read_text("utf-8")
    assert "**State: complete.**" in index


def held_lock_main(directory: Path, report: Path) -> None:
    """Fork while another thread holds the lock under which the layers' proxies go on and off
    (as a concurrent sampled forward's start or end does); the child removes the observer."""
    torch.set_num_threads(1)
    model = small_model()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    inject_observer(
        model, output_dir=directory, sampler=EveryNForwardsSampler(1), history_config=CONFIG
    )
    sgd_step(model, x, y, 0.01)
    lock = OBSERVERS[model].proxies._lock
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait()
    child_report = report.with_name("child.json")
    pid = os.fork()
    if pid == 0:
        removed = remove_observer(model)
        facts = {"removed": str(removed), "restored": "forward" not in model.__dict__}
        child_report.write_text(json.dumps(facts), encoding="utf-8")
        os._exit(0)
    status = wait_child(pid, HELD_LOCK_TIMEOUT_S)
    release.set()
    holder.join()
    sgd_step(model, x, y, 0.01)
    remove_observer(model)
    child = json.loads(child_report.read_text("utf-8")) if child_report.exists() else None
    report.write_text(json.dumps({"status": status, "child": child}), encoding="utf-8")


@pytest.mark.timeout(150)
def test_a_child_forked_while_another_thread_held_the_proxies_lock_removes_without_hanging(
    scripts: tuple[Path, dict[str, int]],
) -> None:
    tmp_path = ran(scripts, "held-lock")
    directory, report = tmp_path / "run", tmp_path / "report.json"
    facts = json.loads(report.read_text("utf-8"))
    assert facts["status"] == 0, "the child's remove_observer hung on a lock held at the fork"
    assert facts["child"] == {"removed": "None", "restored": True}
    assert_parent_run_complete(directory, samples=2)


SCRIPTS = {
    "plain": script_main,
    "after-removal": after_removal_main,
    "after-refusal": after_refusal_main,
    "held-lock": held_lock_main,
}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Each script's process, forked at once from one interpreter that imported torch and never
    observed (`_forked`), into `root/<script>/run` and `root/<script>/report.json`; their exit
    statuses."""
    root = tmp_path_factory.mktemp("scripts")
    return root, run_forked(__file__, root, list(SCRIPTS))


def ran(scripts: tuple[Path, dict[str, int]], name: str) -> Path:
    """The folder of script `name`, which must have ended with status 0."""
    root, codes = scripts
    assert codes[name] == 0, stderr_of(root, name)
    return root / name


if __name__ == "__main__":
    script = fork_each(Path(sys.argv[1]), sys.argv[2:], together=True)
    if script is not None:  # one script's process: it ends through the interpreter's exit
        SCRIPTS[script](
            Path(sys.argv[1]) / script / "run", Path(sys.argv[1]) / script / "report.json"
        )
