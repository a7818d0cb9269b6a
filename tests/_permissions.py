"""Children that meet file permissions as a user would: root ignores permission bits, so under
root a child drops that override (`WITHOUT_OVERRIDE`). The fixtures `prefix` and `run` are
imported by the test modules that use them (under other names, so that a test's arguments do
not shadow them)."""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

WITHOUT_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.fixture(name="prefix")
def prefix_fixture() -> list[str]:
    """What the child's command starts with: under root, `WITHOUT_OVERRIDE`."""
    return child_prefix()


def child_prefix() -> list[str]:
    """`prefix`, for a fixture of wider scope; skips where the platform cannot test this."""
    if not sys.platform.startswith("linux"):
        pytest.skip("permissions and flock as on Linux")
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("under root the child needs setpriv to give up ignoring permissions")
    return WITHOUT_OVERRIDE


@pytest.fixture(name="run")
def run_fixture(tmp_path: Path) -> Iterator[Path]:
    """The run directory; its permissions are given back afterwards, for the cleanup."""
    yield tmp_path / "run"
    give_back(tmp_path)


def give_back(top: Path) -> None:
    """Every folder under `top` (itself included) writable again, so it can be deleted."""
    for folder, _, _ in os.walk(top):
        os.chmod(folder, stat.S_IRWXU)
