"""Real gloo ranks on 127.0.0.1 for the tests that need a process group: one spawned process
per rank (`run_ranks`), each joined to the group for the test's work (`joined`); several
scenarios of a file may share one process per rank (`run_ranks_in_sequence`), and groups of
different sizes one spawn of processes (`run_groups`).

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
from collections.abc import Callable, Iterator, Sequence

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
    _spawn([(target, (rank, world_size, port, *args)) for rank in range(world_size)], timeout_s)


def _spawn(calls: list[tuple[Callable[..., None], tuple[object, ...]]], timeout_s: float) -> None:
    """`target(*args)` of each of `calls` in a spawned process of its own; every process must
    exit 0 within `timeout_s` (one still running is killed and the test fails)."""
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=target, args=args) for target, args in calls]
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
# a scenario and the spawned processes that run it, as its ranks 0, 1, ... in that order
Group = tuple[Callable[..., None], tuple[object, ...], Sequence[int]]
Step = tuple[Callable[..., None], int, int, int, tuple[object, ...]]


def _in_sequence(plan: list[Step]) -> None:
    """Each `target(rank, world_size, port, *args)` of `plan`, in order."""
    for target, rank, world_size, port, args in plan:
        target(rank, world_size, port, *args)


def _free_ports(count: int) -> list[int]:
    """`count` different ports free on 127.0.0.1 now (held open together while chosen)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def run_groups(groups: list[Group], *, processes: int, timeout_s: float = TIMEOUT_SECONDS) -> None:
    """Each `(target, args, members)` of `groups` as a group of its own over the spawned
    processes `members` (of `processes`), on a port of its own: each process runs the groups
    it is a member of one after the other, in the listed order (so none waits in a cycle), and
    groups of other processes at the same time. Why: a spawned rank is a fresh interpreter that
    imports torch, seconds per process, while a scenario that destroys its group and removes
    its observer leaves nothing the next one meets; so one spawn of 4 processes runs a 4-rank
    scenario and then 2-rank ones, two pairs side by side. Every process must exit 0 within
    `timeout_s` in all."""
    plans: list[list[Step]] = [[] for _ in range(processes)]
    for (target, args, members), port in zip(groups, _free_ports(len(groups)), strict=True):
        for rank, process in enumerate(members):
            plans[process].append((target, rank, len(members), port, args))
    _spawn([(_in_sequence, (plan,)) for plan in plans], timeout_s)


def run_ranks_in_sequence(
    scenarios: list[Scenario], *, world_size: int = 2, timeout_s: float = TIMEOUT_SECONDS
) -> None:
    """`run_ranks` for each `(target, args)` of `scenarios`, all in one spawned process per
    rank, one after the other, each joined on a port of its own (`run_groups`)."""
    groups: list[Group] = [(target, args, range(world_size)) for target, args in scenarios]
    run_groups(groups, processes=world_size, timeout_s=timeout_s * len(scenarios))
