"""The SIGTERM handler chain holds only live runs, whatever order and thread runs end in.

Real processes and a real SIGTERM: the child (forked from this file run as a script, which
imported torch once: both tests' children at once, `terminate_when_reported`) injects and removes
observers many times, in another order than injected (first in, first out) or from other threads
(`remove_observer` on a worker thread, a dropped model collected by the garbage collector on a
helper thread), then keeps one run live and waits. The process's one SIGTERM watcher
(`rundir.term_watch`) follows the chain: never one per run, ended with the wakeup fd unset once
no run is live. The parent sends SIGTERM: the child must end
with SIGTERM's default action (returncode -15), the live run's rows on disk.

A chain that grew by one handler per ended run would need about 1,000 runs to exhaust Python's
recursion limit when SIGTERM walks it. To keep the test short, the child lowers the limit to its
current stack depth plus `HEADROOM` frames before waiting, with more ended runs than that (two
a cycle): a chain of ended runs then ends in a RecursionError (exit status 1) as 1,000 runs
would at the default. (The exact chain counts below catch a kept handler after any cycle.)
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from _forked import ended, fork_into
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.rundir.signals import TermFlush
from torchinstruments.sinks.directory import DirectorySink

CYCLES = 24  # two ended runs a cycle: 48, more than HEADROOM
HEADROOM = 40  # frames a SIGTERM may use on top of the waiting child's stack (< 2 * CYCLES)
WAIT_S = 120.0
WATCHER = "torchinstruments SIGTERM watcher"  # the thread of `rundir.term_watch`


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def _step(model: nn.Module) -> None:
    model(torch.randn(2, 4)).sum().backward()


def _inject(model: nn.Module, directory: Path) -> None:
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(flush_seconds=600.0),  # only SIGTERM writes the last rows
    )


def _on_thread(target: object, *args: object) -> None:
    thread = threading.Thread(target=target, args=args)  # type: ignore[arg-type]
    thread.start()
    thread.join()


def _chain() -> tuple[int, object]:
    """How many of our handlers SIGTERM would pass through, and the handler they end at."""
    handler, length = signal.getsignal(signal.SIGTERM), 0
    while isinstance(handler, TermFlush):
        handler, length = handler._previous, length + 1
    return length, handler


def _chain_length() -> int:
    return _chain()[0]


def _watcher_threads() -> int:
    """Threads watching for SIGTERMs the main thread cannot handle (`rundir.term_watch`)."""
    return sum(t.name == WATCHER for t in threading.enumerate())


def _wakeup_fd() -> int:
    """The wakeup fd set now (-1: none), left in place."""
    current = signal.set_wakeup_fd(-1)
    if current != -1:
        signal.set_wakeup_fd(current)
    return current


def child_main(root: Path, mode: str) -> None:
    """Cycle runs (`mode` "fifo" or "threads"), keep one live, report, then wait for SIGTERM."""
    torch.set_num_threads(1)
    before = signal.getsignal(signal.SIGTERM)
    longest = most_watchers = 0
    for i in range(CYCLES):
        a, b = _model(), _model()
        _inject(a, root / f"a{i}")
        _inject(b, root / f"b{i}")
        _step(a)
        _step(b)
        if mode == "fifo":
            remove_observer(a)  # under b's handler: spliced out
            remove_observer(b)
        elif i % 2:
            _on_thread(remove_observer, a)
            _on_thread(remove_observer, b)
        else:
            del a, b  # their runs end when the collector finds them, on a helper thread
            _on_thread(gc.collect)
        longest = max(longest, _chain_length())
        most_watchers = max(most_watchers, _watcher_threads())
    gc.collect()
    if mode == "fifo":  # every run ended on the main thread: each watcher was stopped
        for thread in threading.enumerate():
            if thread.name == WATCHER:
                thread.join(timeout=WAIT_S)
    facts = {
        "most_watcher_threads": most_watchers,
        "watcher_threads_after_cycles": _watcher_threads(),
        "wakeup_fd_after_cycles": _wakeup_fd(),
        "longest_chain": longest,
        "chain_after_cycles": _chain_length(),
        "ends_at_the_handler_before": _chain()[1] == before,
        "sinks_alive": sum(type(o) is DirectorySink for o in gc.get_objects()),
    }
    first, live = _model(), _model()
    _inject(first, root / "first")
    _inject(live, root / "live")
    _step(live)
    if mode == "fifo":
        remove_observer(first)
    else:
        _on_thread(remove_observer, first)
    _step(live)
    facts["chain_with_one_live_run"] = _chain_length()
    (root / "facts.json").write_text(json.dumps(facts), encoding="utf-8")
    sys.setrecursionlimit(len(inspect.stack()) + HEADROOM)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


def terminate_when_reported(root: Path, modes: list[str]) -> str | None:
    """In the script: a child per mode forked at once, into `root/<mode>` (its stderr in
    `root/<mode>/stderr`), each sent SIGTERM once it reported; returns the mode in the child. In
    this process, once every child ended, writes their exit statuses to `root/codes.json` (a
    child that never reported is killed after `WAIT_S`) and ends (`_forked.ended`)."""
    running: dict[str, int] = {}
    for mode in modes:
        pid = fork_into(root / mode)
        if pid == 0:
            return mode
        running[mode] = pid
    deadline = time.monotonic() + WAIT_S
    codes: dict[str, int] = {}
    for mode, pid in running.items():
        gone, status = 0, 0
        while not (root / mode / "facts.json").exists() and time.monotonic() < deadline:
            gone, status = os.waitpid(pid, os.WNOHANG)
            if gone:
                break  # it ended before it reported: its status says so
            time.sleep(0.05)
        else:
            time.sleep(0.2)  # past writing the facts, into its wait
            os.kill(pid, signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL)
        if not gone:
            status = os.waitpid(pid, 0)[1]
        codes[mode] = os.waitstatus_to_exitcode(status)
    (root / "codes.json").write_text(json.dumps(codes), encoding="utf-8")
    ended()


@pytest.fixture(scope="module")
def terminated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both modes' children, each sent SIGTERM once it reported (`terminate_when_reported`)."""
    root = tmp_path_factory.mktemp("terminated")
    done = subprocess.run(
        [sys.executable, __file__, str(root), "fifo", "threads"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return root


def run_child(root: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The child of `mode` as SIGTERM ended it: its exit status and stderr, and its facts."""
    codes = json.loads((root / "codes.json").read_text("utf-8"))
    err = (root / mode / "stderr").read_text("utf-8", errors="replace")
    facts = root / mode / "facts.json"
    assert facts.exists(), f"the child never reported:\n{err}"
    result = subprocess.CompletedProcess([mode], codes[mode], "", err)
    return result, json.loads(facts.read_text("utf-8"))


def assert_live_run_flushed(directory: Path) -> None:
    """The live run's two samples reached its parts (SIGTERM flushed them)."""
    parts = sorted((directory / "history.parts").glob("part-*.parquet"))
    assert parts, "SIGTERM did not flush the live run"
    ids = set(pl.concat([pl.read_parquet(p) for p in parts])["sample_id"].to_list())
    assert ids == {0, 1}


def test_runs_removed_first_in_first_out_leave_the_chain_and_sigterm_ends_the_process(
    terminated: Path,
) -> None:
    result, facts = run_child(terminated, "fifo")
    assert "RecursionError" not in result.stderr, result.stderr
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert facts["longest_chain"] <= 2  # the two live runs at most
    assert facts["chain_after_cycles"] == 0  # SIGTERM's handler is the one before, again
    assert facts["wakeup_fd_after_cycles"] == -1  # the last removal let the wakeup fd go
    assert facts["watcher_threads_after_cycles"] == 0  # and ended its watcher
    assert facts["ends_at_the_handler_before"]
    assert facts["sinks_alive"] == 0  # no ended run kept alive by a handler
    assert facts["chain_with_one_live_run"] == 1
    assert_live_run_flushed(terminated / "fifo" / "live")


def test_runs_ended_on_other_threads_leave_the_chain_and_sigterm_ends_the_process(
    terminated: Path,
) -> None:
    result, facts = run_child(terminated, "threads")
    assert "RecursionError" not in result.stderr, result.stderr
    assert result.returncode == -signal.SIGTERM, result.stderr
    # two live runs, plus at most one inert handler left current by a run ended off the main
    # thread, taken off at the next install or uninstall on the main thread
    assert facts["longest_chain"] <= 3
    assert facts["chain_after_cycles"] <= 1
    # the inert handler left current keeps the one watcher, which the next run takes over
    assert facts["most_watcher_threads"] == facts["watcher_threads_after_cycles"] == 1
    assert facts["ends_at_the_handler_before"]
    assert facts["sinks_alive"] == 0
    assert facts["chain_with_one_live_run"] == 1
    assert_live_run_flushed(terminated / "threads" / "live")


if __name__ == "__main__":
    mode = terminate_when_reported(Path(sys.argv[1]), sys.argv[2:])
    if mode is not None:
        child_main(Path(sys.argv[1]) / mode, mode)
