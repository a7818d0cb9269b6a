"""Scenarios that each need a process of their own, forked from one interpreter: a test file run
as a script imports torch once, then forks a child per scenario, one after the other or, where
each mostly waits, all at once (`fork_each`); the child runs the rest of the script as its own
and ends as that script would (killed at a known point, or through the interpreter's exit); or
this process kills each child once it says it is ready (`kill_each_when_ready`). The test runs
that script once per module fixture (`run_forked`) and reads each scenario's folder.

Why: a fresh interpreter importing torch takes seconds of CPU, most of such a child's time.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

CODES = "codes.json"


def before_forking() -> None:
    """What this process wrote so far goes out before a child can copy it, and every object it
    made so far (torch's, at import: some 200,000) is left out of collections from now on
    (`gc.freeze`), in the children too: each of a child's full collections, and its exit's,
    would otherwise walk them all and copy every page they lie on, seconds of a child's time
    that no test looks at (the objects the child makes are collected as ever)."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()


def ended() -> NoReturn:
    """The forking process's end, once its children's statuses are written: at once, without
    the interpreter's teardown (its collection of every object torch made at import takes
    seconds) that no test looks at; never in a child, which ends as its script would."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fork_each(root: Path, names: Sequence[str], *, together: bool = False) -> str | None:
    """In a script: one forked child per name, in turn, its stderr in `root/<name>/stderr`.
    Returns the name in the child; in this process, once every child ended, writes their exit
    statuses (`os.waitstatus_to_exitcode`) to `root/codes.json` and ends (`ended`). `together`:
    every child is forked before any is waited for, so that children whose time is mostly a
    wait (a stall's bound running out) wait at the same time instead of one after the other."""
    codes: dict[str, int] = {}
    running: dict[str, int] = {}
    for name in names:
        pid = fork_into(root / name)
        if pid == 0:
            return name
        running[name] = pid
        if not together:
            codes[name] = os.waitstatus_to_exitcode(os.waitpid(running.pop(name), 0)[1])
    for name, pid in running.items():
        codes[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    (root / CODES).write_text(json.dumps(codes), encoding="utf-8")
    ended()


def fork_into(folder: Path) -> int:
    """A child forked with its stderr in `folder/stderr` (`folder` made first): 0 in the child,
    its pid in this process."""
    folder.mkdir(parents=True, exist_ok=True)
    before_forking()
    pid = os.fork()
    if pid == 0:
        err = os.open(folder / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(err, 2)
        os.close(err)
    return pid


def run_forked(script: str, root: Path, names: Sequence[str]) -> dict[str, int]:
    """`script root NAMES...` (a file whose `__main__` calls `fork_each`): each name's exit
    status; the script itself must end with status 0."""
    done = subprocess.run(
        [sys.executable, script, str(root), *names],
        capture_output=True,
        text=True,
        timeout=120 * len(names),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads((root / CODES).read_text(encoding="utf-8"))


def stderr_of(root: Path, name: str) -> str:
    """What the child of `name` wrote to its stderr."""
    return (root / name / "stderr").read_text(encoding="utf-8", errors="replace")


def killed_when_ready(ready: str, main: Callable[[], object], quiet: bool = False) -> int:
    """`main()` in a child forked from here, its real stdout a pipe to this process: SIGKILLed
    once it says the line `ready` there (`print(ready, file=sys.__stdout__)`), as
    `conftest.kill_when_ready` kills a script; its exit status (-SIGKILL, or how it ended
    first). `quiet`: what `main` prints to `sys.stdout` (a trainer's logs) goes to stderr, so
    the pipe carries the ready line alone."""
    return killed_together_when_ready(ready, {"": main}, quiet)[""]


def killed_together_when_ready(
    ready: str, mains: Mapping[str, Callable[[], object]], quiet: bool = False
) -> dict[str, int]:
    """`killed_when_ready` of every main at once: each forked before any is waited for, each
    SIGKILLed once it says `ready`; their exit statuses by name."""
    said: dict[str, tuple[int, int]] = {}
    for name, main in mains.items():
        read, write = os.pipe()
        before_forking()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.dup2(write, 1)
            os.close(write)
            with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
                main()
            os._exit(0)  # it returned instead of waiting for the kill: the test says so
        os.close(write)
        said[name] = (pid, read)
    for pid, read in said.values():
        with os.fdopen(read) as lines:
            if lines.readline().strip() == ready:
                os.kill(pid, signal.SIGKILL)
    return {
        name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, (pid, _) in said.items()
    }


def kill_each_when_ready(
    root: Path, ready: str, children: Mapping[str, Callable[[Path], object]], names: Sequence[str]
) -> None:
    """In a script: `children[name](root / name)` for each name, in turn, by `killed_when_ready`,
    each with its stderr in `root/<name>/stderr`; their exit statuses to `root/codes.json`, then
    this process ends (`ended`)."""
    codes: dict[str, int] = {}
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        err = os.open(root / name / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        saved = os.dup(2)
        os.dup2(err, 2)
        os.close(err)
        try:
            codes[name] = killed_when_ready(ready, lambda name=name: children[name](root / name))
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
    (root / CODES).write_text(json.dumps(codes), encoding="utf-8")
    ended()
