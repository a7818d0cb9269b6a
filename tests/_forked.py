"""Scenarios that each need a process of their own, forked from one interpreter: a test file run
as a script imports torch once, then forks a child per scenario, one after the other
(`fork_each`); the child runs the rest of the script as its own and ends as that script would
(killed at a known point, or through the interpreter's exit). The test runs that script once
per module fixture (`run_forked`) and reads each scenario's folder.

Why: a fresh interpreter importing torch takes seconds of CPU, most of such a child's time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

CODES = "codes.json"


def fork_each(root: Path, names: Sequence[str]) -> str | None:
    """In a script: one forked child per name, in turn, its stderr in `root/<name>/stderr`.
    Returns the name in the child; in this process, once every child ended, writes their exit
    statuses (`os.waitstatus_to_exitcode`) to `root/codes.json` and returns None."""
    codes: dict[str, int] = {}
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            err = os.open(root / name / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(err, 2)
            os.close(err)
            return name
        codes[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    (root / CODES).write_text(json.dumps(codes), encoding="utf-8")
    return None


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
