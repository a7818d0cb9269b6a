"""SIGTERM to a process whose main thread runs no Python (blocked in native code).

Python runs a signal handler only when the main thread next runs Python, so the library's
SIGTERM handler alone would leave a rank waiting in a collective (or any main thread blocked in
C) alive until SIGKILL, where SIGTERM's default action ends it at once without the library. The
watcher (`rundir.term_watch`) writes the buffered rows from another thread and then ends the
process with SIGTERM's default action, or, where the program installed a Python handler of its
own, leaves the process to it as without the library.

Real processes, real signals: the children are forked from this file run once as a script
(`_fork_server`), each when its test asks. Each records a few
samples with `flush_seconds=600`, so only the first sample is on disk before the SIGTERM (it is
written at once) and every later row reaches the disk only because of the SIGTERM. The main
thread then blocks in a C call that ignores signals: a gloo all_reduce that another rank (alive,
having raised) never joins, or a `torch.futures.Future` nobody completes. The test sends SIGTERM
once `/proc` shows that thread asleep, then waits up to `WAIT_S` (a bound on hanging, not a
timing check).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import polars as pl
import pytest
import torch
import torch.distributed as dist
from _fork_server import Forked, ForkServer, serve, write_whole
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)

from conftest import cli_in_process

SAMPLES = 3
ROWS_PER_SAMPLE = 3 * len(DEFAULT_METRICS) * 2  # Linear, Tanh, Linear x 2 signals
WAIT_S = 60.0
BLOCKED = "main thread ran no Python"  # in the watcher's warning
pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="reads the main thread's state from /proc"
)


def _observed_steps(directory: Path) -> nn.Module:
    """Inject and take SAMPLES samples; only the first reaches the disk on its own."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(flush_seconds=600.0),
    )
    for _ in range(SAMPLES):
        model(torch.randn(2, 4)).sum().backward()
    return model


def _ready(root: Path, name: str) -> None:
    """`root/name` holding this process's pid, whole when it appears (the parent polls for it)."""
    write_whole(root / name, str(os.getpid()))


def _block_on_a_future(root: Path) -> None:
    """Block the main thread in C until `root/release` appears (a helper thread completes it)."""
    future: torch.futures.Future[None] = torch.futures.Future()

    def release() -> None:
        while not (root / "release").exists():
            time.sleep(0.05)
        future.set_result(None)

    threading.Thread(target=release, daemon=True).start()
    _ready(root, "blocked")
    future.wait()


def fork_main(root: Path) -> None:
    """Observe, fork a child that blocks in C, wait for it in `os.waitpid` (no Python runs on
    the main thread either), write how it ended, then remove the observer."""
    model = _observed_steps(root / "stats")
    pid = os.fork()
    if pid == 0:
        try:
            _ready(root, "forked")
            torch.futures.Future().wait()
        finally:
            os._exit(1)
    _ready(root, "blocked")
    _, status = os.waitpid(pid, 0)
    (root / "forked-status").write_text(str(os.waitstatus_to_exitcode(status)), encoding="utf-8")
    remove_observer(model)


def child_main(root: Path, mode: str) -> None:
    """One child: observe, then block in C ("future", "handler"), or loop in Python ("python")."""
    if mode == "handler":  # the program's own handler, as a framework installs one

        def on_term(signum: int, frame: object) -> None:
            (root / "handler-ran").write_text(str(signum), encoding="utf-8")
            sys.exit(143)

        signal.signal(signal.SIGTERM, on_term)
    _observed_steps(root / "stats")
    if mode == "python":
        _ready(root, "blocked")
        total = 0
        while True:  # pure Python, never asleep: the handler path takes the SIGTERM
            total = (total + 1) % 1000
    _block_on_a_future(root)
    time.sleep(WAIT_S)  # the handler (mode "handler") ends the process here


def rank_main(root: Path, rank: int, port: int) -> None:
    """One rank of two on gloo: rank 1 raises and never joins the all_reduce; rank 0 observes
    (rank_policy "rank0") and waits in the all_reduce for it."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        try:
            raise RuntimeError("rank 1 fails before the all_reduce")
        except RuntimeError:
            _ready(root, "rank-1-raised")
            time.sleep(WAIT_S * 4)  # alive (its launcher has not stopped it yet), not joining
        return
    _observed_steps(root / "stats")
    _ready(root, "blocked")
    dist.all_reduce(torch.ones(4))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This file run once as a script that imported torch: it forks each test's children when
    the test asks (`_fork_server`), each a fresh process with no run in it."""
    server = ForkServer(__file__, tmp_path_factory.mktemp("server") / "server.err")
    yield server
    server.close()


def _wait_for(path: Path, process: Forked) -> None:
    deadline = time.monotonic() + WAIT_S * 2
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{path.name} never came:\n{process.stderr()}")
        time.sleep(0.05)


def _main_thread_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def _wait_until_blocked(*pids: int) -> None:
    """Until the main thread of each has slept through the same 20 looks in a row (each sits in
    its C call)."""
    asleep, deadline = 0, time.monotonic() + WAIT_S
    while asleep < 20:
        asleep = asleep + 1 if all(_main_thread_state(pid) == "S" for pid in pids) else 0
        assert time.monotonic() < deadline, "the child's main thread never blocked"
        time.sleep(0.05)


def _wait_exit(process: Forked) -> int:
    """The exit status; fails (and kills the child) if it does not end within WAIT_S."""
    try:
        return process.wait(timeout=WAIT_S)
    except TimeoutError:
        process.kill()
        pytest.fail(f"the process still ran {WAIT_S} s after SIGTERM")


def _finalized_samples(directory: Path) -> pl.DataFrame:
    """`torchinstruments finalize` on the directory, then its history's rows per sample."""
    done = cli_in_process("finalize", directory)
    assert done.returncode == 0, done.stderr
    history = pl.read_parquet(directory / "history.parquet")
    return history.group_by("sample_id").len().sort("sample_id")


def _assert_every_sample(directory: Path) -> None:
    rows = _finalized_samples(directory)
    assert rows["sample_id"].to_list() == list(range(SAMPLES))
    assert rows["len"].to_list() == [ROWS_PER_SAMPLE] * SAMPLES


def _parts_samples(directory: Path) -> set[int]:
    parts = sorted((directory / "history.parts").glob("part-*.parquet"))
    return set(pl.concat([pl.read_parquet(p) for p in parts])["sample_id"].to_list())


def test_sigterm_ends_a_rank_waiting_in_an_all_reduce_and_finalize_reads_its_rows(
    tmp_path: Path, server: ForkServer
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = [server.start(tmp_path, f"rank-{r}", "rank", r, port) for r in range(2)]
    try:
        _wait_for(tmp_path / "rank-1-raised", ranks[1])
        _wait_for(tmp_path / "blocked", ranks[0])
        _wait_until_blocked(ranks[0].pid)
        assert ranks[0].poll() is None  # still waiting for rank 1
        os.kill(ranks[0].pid, signal.SIGTERM)
        status = _wait_exit(ranks[0])
    finally:
        for rank in ranks:
            rank.kill()
    err = ranks[0].stderr()
    assert status == -signal.SIGTERM, err
    assert BLOCKED in err  # the watcher took it: the main thread was in the collective
    _assert_every_sample(tmp_path / "stats")


def test_sigterm_ends_a_process_blocked_in_a_c_call_with_its_default_action(
    tmp_path: Path, server: ForkServer
) -> None:
    child = server.start(tmp_path, "child", "future")
    try:
        _wait_for(tmp_path / "blocked", child)
        _wait_until_blocked(child.pid)
        os.kill(child.pid, signal.SIGTERM)
        status = _wait_exit(child)
    finally:
        child.kill()
    err = child.stderr()
    assert status == -signal.SIGTERM, err
    assert BLOCKED in err
    assert "default action" in err
    _assert_every_sample(tmp_path / "stats")


def test_a_program_handler_that_cannot_run_runs_when_the_main_thread_is_back(
    tmp_path: Path, server: ForkServer
) -> None:
    """As without the library, the program's own handler waits for the main thread (the process
    lives on meanwhile); the rows are on disk already, and the handler runs once the C call
    returns."""
    child = server.start(tmp_path, "child", "handler")
    err_path = child.err_path
    try:
        _wait_for(tmp_path / "blocked", child)
        _wait_until_blocked(child.pid)
        os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        while BLOCKED not in err_path.read_text(errors="replace"):
            assert child.poll() is None, err_path.read_text(errors="replace")
            assert time.monotonic() < deadline, "the watcher never took the SIGTERM"
            time.sleep(0.05)
        assert child.poll() is None  # the process goes on, as without the library
        assert not (tmp_path / "handler-ran").exists()
        assert _parts_samples(tmp_path / "stats") == set(range(SAMPLES))  # written already
        (tmp_path / "release").write_text("", encoding="utf-8")  # the C call returns
        status = _wait_exit(child)
    finally:
        child.kill()
    assert status == 143, err_path.read_text(errors="replace")
    assert (tmp_path / "handler-ran").read_text("utf-8") == str(int(signal.SIGTERM))
    assert run_ended_complete(tmp_path / "stats")


def run_ended_complete(directory: Path) -> bool:
    """The program's handler exited with SystemExit: the interpreter's exit finished the run."""
    history = pl.read_parquet(directory / "history.parquet")
    return sorted(history["sample_id"].unique().to_list()) == list(range(SAMPLES))


def test_a_main_thread_running_python_takes_sigterm_through_the_handler_as_before(
    tmp_path: Path, server: ForkServer
) -> None:
    child = server.start(tmp_path, "child", "python")
    try:
        _wait_for(tmp_path / "blocked", child)
        os.kill(child.pid, signal.SIGTERM)
        status = _wait_exit(child)
    finally:
        child.kill()
    err = child.stderr()
    assert status == -signal.SIGTERM, err
    assert BLOCKED not in err  # the handler path took it, not the watcher
    _assert_every_sample(tmp_path / "stats")


def test_sigterm_to_a_forked_child_blocked_in_c_ends_it_and_leaves_the_parent_alone(
    tmp_path: Path, server: ForkServer
) -> None:
    """The child gets the handler the process had before the library's (SIG_DFL here) and no
    share in the parent's watcher: its SIGTERM ends it at once, and the parent, itself blocked
    in a system call meanwhile, neither sees the signal nor ends."""
    parent = server.start(tmp_path, "parent", "fork")
    try:
        _wait_for(tmp_path / "blocked", parent)
        _wait_for(tmp_path / "forked", parent)
        child = int((tmp_path / "forked").read_text("utf-8"))
        _wait_until_blocked(child, parent.pid)
        os.kill(child, signal.SIGTERM)
        status = _wait_exit(parent)
    finally:
        parent.kill()
    err = parent.stderr()
    assert status == 0, err
    assert (tmp_path / "forked-status").read_text("utf-8") == str(-signal.SIGTERM)
    assert BLOCKED not in err
    assert sorted(
        pl.read_parquet(tmp_path / "stats" / "history.parquet")["sample_id"].unique()
    ) == [0, 1, 2]


def _wakeup_fd() -> int:
    """The wakeup fd set now (-1: none), left in place."""
    current = signal.set_wakeup_fd(-1)
    if current != -1:
        signal.set_wakeup_fd(current)
    return current


def _small_run(directory: Path) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 4)).sum().backward()
    return model


def wakeup_fd_of_runs(root: Path) -> None:
    """In a fresh process (no run of an earlier test lives there): the watcher takes the
    wakeup fd at the first run, keeps one for all runs, and unsets it at the last removal."""
    assert _wakeup_fd() == -1
    first = _small_run(root / "first")
    ours = _wakeup_fd()
    assert ours != -1
    second = _small_run(root / "second")
    assert _wakeup_fd() == ours  # one watcher for the process
    remove_observer(first)  # first in, first out: the second run still lives
    assert _wakeup_fd() == ours
    remove_observer(second)
    assert _wakeup_fd() == -1
    for thread in threading.enumerate():
        if thread.name == "torchinstruments SIGTERM watcher":
            thread.join(timeout=WAIT_S)
            assert not thread.is_alive()


def wakeup_fd_set_before(root: Path) -> None:
    """In a fresh process: a wakeup fd set before the first run (an event loop's) stays."""
    mine, _other = socket.socketpair()
    mine.setblocking(False)
    signal.set_wakeup_fd(mine.fileno())
    model = _small_run(root / "run")
    assert _wakeup_fd() == mine.fileno()
    remove_observer(model)
    assert _wakeup_fd() == mine.fileno()


def _run_script(tmp_path: Path, server: ForkServer, mode: str) -> None:
    child = server.start(tmp_path, "child", mode)
    try:
        assert child.wait(timeout=WAIT_S * 2) == 0, child.stderr()
    finally:
        child.kill()


def test_the_watcher_holds_the_wakeup_fd_while_runs_live_and_unsets_it_at_the_last_removal(
    tmp_path: Path, server: ForkServer
) -> None:
    _run_script(tmp_path, server, "wakeup-ours")


def test_a_wakeup_fd_set_before_inject_is_left_in_place(tmp_path: Path, server: ForkServer) -> None:
    """An event loop's wakeup fd is not taken (its SIGTERM then waits for the main thread)."""
    _run_script(tmp_path, server, "wakeup-theirs")


def scenario(root: Path, args: Sequence[str]) -> None:
    """One child's scenario, by its mode (`args[0]`)."""
    mode = args[0]
    if mode == "fork":
        fork_main(root)
    elif mode == "wakeup-ours":
        wakeup_fd_of_runs(root)
    elif mode == "wakeup-theirs":
        wakeup_fd_set_before(root)
    elif mode == "rank":
        rank_main(root, int(args[1]), int(args[2]))
    else:
        child_main(root, mode)


if __name__ == "__main__":
    serve(scenario)
