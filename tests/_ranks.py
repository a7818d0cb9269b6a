"""Real gloo ranks on 127.0.0.1 for the tests that need a process group: one spawned process
per rank (`run_ranks`), each joined to the group for the test's work (`joined`); several
scenarios of a file may share one process per rank (`run_ranks_in_sequence`).

A spawned process imports the test's module afresh, so a rank's function is a module-level
function; it reports by writing files (JSON, run directories) the test reads back after every
rank exited 0 in time.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import socket
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

TIMEOUT_SECONDS = 120


def free_port() -> int:
    """A port free on 127.0.0.1 now, for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join(rank: int, world_size: int, port: int, timeout: datetime.timedelta | None = None) -> None:
    """This process as rank `rank` of a gloo group of `world_size` on 127.0.0.1:`port`, with
    the program's own `timeout` when given; the caller destroys the group (`joined` does)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)


@contextlib.contextmanager
def joined(
    rank: int, world_size: int, port: int, timeout: datetime.timedelta | None = None
) -> Iterator[None]:
    """`join`, and the group destroyed at the end, also when the body raises."""
    join(rank, world_size, port, timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(
    target: Callable[..., None],
    *args: object,
    world_size: int = 2,
    timeout_s: float = TIMEOUT_SECONDS,
) -> None:
    """`target(rank, world_size, port, *args)` in one spawned process per rank; every rank must
    exit 0 within `timeout_s` (a rank still running is killed and the test fails)."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=target, args=(rank, world_size, port, *args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout_s)
    for process in processes:
        if process.is_alive():
            process.kill()
            pytest.fail(f"rank process {process.pid} did not finish in {timeout_s} s")
        assert process.exitcode == 0, f"rank process {process.pid} exited {process.exitcode}"


Scenario = tuple[Callable[..., None], tuple[object, ...]]


def _in_sequence(rank: int, world_size: int, port: int, plan: list[tuple[Scenario, int]]) -> None:
    """Each scenario's `target(rank, world_size, its_port, *args)`, in order (`port`, the one
    `run_ranks` chose, is not used)."""
    for (target, args), own_port in plan:
        target(rank, world_size, own_port, *args)


def run_ranks_in_sequence(
    scenarios: list[Scenario], *, world_size: int = 2, timeout_s: float = TIMEOUT_SECONDS
) -> None:
    """`run_ranks` for each `(target, args)` of `scenarios`, all in one spawned process per
    rank, one after the other, each joined on a port of its own. Why: a spawned rank is a fresh
    interpreter that imports torch, seconds per process, while a scenario that destroys its
    group and removes its observer leaves nothing the next one meets."""
    with contextlib.ExitStack() as held:  # held open together: the ports differ
        sockets = [held.enter_context(socket.socket()) for _ in scenarios]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        ports = [sock.getsockname()[1] for sock in sockets]
    plan = list(zip(scenarios, ports, strict=True))
    run_ranks(_in_sequence, plan, world_size=world_size, timeout_s=timeout_s * len(scenarios))
