"""Children forked on request from one interpreter that imported torch once: a test file run as
a script serves (`serve`), and each test asks that server (`ForkServer.start`) for a child when
the test is ready for it, then deals with the child as with a process of its own: its pid, its
stderr in a file, a signal, its exit status once it ended. The child runs the script's scenario
and ends as that script would (the interpreter's exit, or a signal).

Why: a fresh interpreter importing torch takes seconds of CPU, most of such a child's time. The
children of `_forked` all run as the script starts; these start when a test asks, so a test can
signal its child at a known point while the tests before it ran.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from _forked import before_forking, ended

SERVE = "serve"  # the script's argument that makes it serve


def write_whole(path: Path, text: str) -> None:
    """`path` holding `text`, whole when it appears (the test polls for it): how a child says
    it is ready (`Forked.wait_for`)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text, encoding="utf-8")
    partial.rename(path)


def _wait_and_report(child: int, directory: Path, name: str) -> None:
    """In the process between server and child: the child's pid, then its exit status."""
    write_whole(directory / f"{name}.pid", str(child))
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    write_whole(directory / f"{name}.status", str(status))
    os._exit(0)


def _connect(directory: Path, name: str, pipes: bool) -> None:
    """In the child: stdin the FIFO `<name>.in` (where `pipes`, else empty), stdout the FIFO
    `<name>.out` (where `pipes`), stderr the file `<name>.err`; `sys.stdin` reads fd 0 afresh
    (the server's reader may hold lines read ahead)."""
    if pipes:
        read = os.open(directory / f"{name}.in", os.O_RDONLY)  # the test opens `in` first too
        write = os.open(directory / f"{name}.out", os.O_WRONLY)
        os.dup2(write, 1)
        os.close(write)
    else:
        read = os.open(os.devnull, os.O_RDONLY)
    os.dup2(read, 0)
    os.close(read)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's own)
    err = os.open(directory / f"{name}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(err)


def serve(main: Callable[[Path, Sequence[str]], object]) -> None:
    """In a script: per line on stdin (JSON: directory, name, args, pipes), a child that runs
    `main(directory, args)` and then ends through the interpreter's exit (`SystemExit`), with
    stdin and stdout the FIFOs `directory/<name>.in` and `.out` where `pipes` (stdin empty
    otherwise) and stderr in `directory/<name>.err`; a process between the two writes the
    child's pid to `directory/<name>.pid` and, once it ended, its exit status
    (`os.waitstatus_to_exitcode`) to `directory/<name>.status`. At stdin's end, once every child
    ended, this process ends at once: its teardown would collect every object torch made at
    import (seconds) and nobody looks at it."""
    waiters: list[int] = []
    while line := sys.stdin.readline():
        request = json.loads(line)
        directory, name = Path(request["directory"]), request["name"]
        directory.mkdir(parents=True, exist_ok=True)
        before_forking()  # the child's collections skip what torch made at import
        waiter = os.fork()
        if waiter != 0:
            waiters.append(waiter)
            continue
        child = os.fork()
        if child != 0:
            _wait_and_report(child, directory, name)
        _connect(directory, name, request["pipes"])
        main(directory, request["args"])
        sys.exit(0)
    for waiter in waiters:
        os.waitpid(waiter, 0)
    ended()


class Forked:
    """A child of the server, as a test sees it."""

    def __init__(self, directory: Path, name: str, pid: int, pipes: bool) -> None:
        self.directory, self.name, self.pid = directory, name, pid
        self.err_path = directory / f"{name}.err"
        self.stdin: IO[str] | None = None
        self.stdout: IO[str] | None = None
        if pipes:  # in the child's order: `in`, then `out`; gone once both ends are open
            self.stdin = (directory / f"{name}.in").open("w", encoding="utf-8")
            self.stdout = (directory / f"{name}.out").open(encoding="utf-8")
            (directory / f"{name}.in").unlink()
            (directory / f"{name}.out").unlink()

    def close_stdin(self) -> None:
        """The end of its stdin (where it has a FIFO)."""
        if self.stdin is not None and not self.stdin.closed:
            self.stdin.close()

    def poll(self) -> int | None:
        """Its exit status, None while it runs."""
        status = self.directory / f"{self.name}.status"
        return int(status.read_text(encoding="utf-8")) if status.exists() else None

    def wait(self, timeout: float) -> int:
        """Its exit status once it ended; `TimeoutError` where it still runs after `timeout`."""
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} still runs after {timeout} s")
            time.sleep(0.01)
        return status

    def wait_for(self, path: Path, timeout: float) -> str:
        """What `path` holds once it appeared (`write_whole`); fails where the child ended
        first or it did not appear within `timeout`."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert self.poll() is None, f"{self.name} ended before {path.name}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
            time.sleep(0.01)
        return path.read_text(encoding="utf-8")

    def kill(self) -> None:
        """SIGKILL, where it still runs, and wait for its end; its FIFOs closed."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait(60)
        self.close_stdin()
        if self.stdout is not None:
            self.stdout.close()

    def close(self, timeout: float) -> int:
        """Its stdin closed, then its exit status once it ended (killed where it still runs
        after `timeout`, and the `TimeoutError` raised)."""
        self.close_stdin()
        try:
            return self.wait(timeout)
        finally:
            self.kill()

    def stderr(self) -> str:
        """What it wrote to its stderr so far."""
        return self.err_path.read_text(encoding="utf-8", errors="replace")


class ForkServer:
    """`script serve` (a file whose `__main__` calls `serve` then), started once; `start` asks
    it for a child."""

    def __init__(self, script: str, log: Path, prefix: Sequence[str] = ()) -> None:
        """`prefix`: what the server's command starts with (`setpriv ...`: its children are
        forked from a process that runs under it)."""
        self.log = log
        with log.open("wb") as err:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, script, SERVE],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
            )

    @property
    def _stdin(self) -> IO[str]:
        assert self.process.stdin is not None
        return self.process.stdin

    def start(self, directory: Path, name: str, *args: object, pipes: bool = False) -> Forked:
        """A child running the script's scenario for `args` in `directory`, once it started;
        `pipes`: its stdin and stdout are pipes from and to this process (`Forked.stdin`,
        `Forked.stdout`)."""
        directory.mkdir(parents=True, exist_ok=True)
        if pipes:
            os.mkfifo(directory / f"{name}.in")
            os.mkfifo(directory / f"{name}.out")
        request = {"directory": str(directory), "name": name, "pipes": pipes}
        self._stdin.write(json.dumps({**request, "args": [str(a) for a in args]}) + "\n")
        self._stdin.flush()
        pid_path = directory / f"{name}.pid"
        deadline = time.monotonic() + 120
        while not pid_path.exists():
            assert self.process.poll() is None, self.log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the server never forked the child"
            time.sleep(0.01)
        return Forked(directory, name, int(pid_path.read_text(encoding="utf-8")), pipes)

    def close(self) -> None:
        """Its end, once every child it forked ended; it must end with status 0."""
        self._stdin.close()
        try:
            code = self.process.wait(timeout=120)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        assert code == 0, self.log.read_text(errors="replace")


def kill_all_when_ready(
    script: str, root: Path, ready: str, names: Sequence[str], *, in_turn: bool = False
) -> dict[str, int]:
    """Each name's child (the script's scenario for `[name]`, in `root/<name>`), all forked at
    once by a server started for them (`in_turn`: each once the one before ended, where one
    goes on from what the one before left), SIGKILLed once it says the line `ready` on its
    stdout; their exit statuses by name (-SIGKILL, or how one ended first). Each child's stderr
    is `child_stderr(root, name)`."""
    server = ForkServer(script, root / "server.err")
    children: dict[str, Forked] = {}
    codes: dict[str, int] = {}
    try:
        for name in names:
            children[name] = server.start(root / name, "child", name, pipes=True)
            if in_turn:
                codes[name] = _killed_when_ready(children[name], ready)
        for name, child in children.items():
            if name not in codes:
                codes[name] = _killed_when_ready(child, ready)
        return codes
    finally:
        for child in children.values():
            child.kill()
        server.close()


def _killed_when_ready(child: Forked, ready: str) -> int:
    """SIGKILL once `child` says `ready` on its stdout; its exit status."""
    assert child.stdout is not None
    if child.stdout.readline().strip() == ready:
        os.kill(child.pid, signal.SIGKILL)
    return child.wait(120)


def run_all(script: str, root: Path, names: Sequence[str]) -> dict[str, int]:
    """Each name's child (the script's scenario for `[name]`, in `root/<name>`), all forked at
    once by a server started for them, each ending as the script would; their exit statuses by
    name. Each child's stderr is `child_stderr(root, name)`."""
    server = ForkServer(script, root / "server.err")
    try:
        children = {name: server.start(root / name, "child", name) for name in names}
        try:
            return {name: child.wait(120) for name, child in children.items()}
        finally:
            for child in children.values():
                child.kill()
    finally:
        server.close()


def child_stderr(root: Path, name: str) -> str:
    """What the child `name` of `kill_all_when_ready` or `run_all` wrote to its stderr."""
    return (root / name / "child.err").read_text(encoding="utf-8", errors="replace")
