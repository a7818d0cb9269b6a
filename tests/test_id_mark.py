"""The run's id mark in `.lock`: read back as written, kept when the lock is taken again, and a
write that fails is said once and never raised into the user's step.

The kill itself (a sample SIGKILLed before anything of it reached the disk, then resume=True)
is `tests/test_killed_attempt_ends.py`'s; these pin the file's side without a process.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from torchinstruments.rundir.id_mark import MARK_OFFSET, IdMark, read_mark
from torchinstruments.rundir.lock import FINALIZE, RunLock


def test_the_mark_reads_back_and_survives_the_lock_taken_again_by_a_finalize(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    with RunLock(tmp_path):
        mark = IdMark(said.append)
        mark.open(tmp_path, 0, 0)
        assert read_mark(tmp_path) == (0, 0)
        mark.advance(8, 15)
        mark.close()
        mark.advance(9, 16)  # after removal closed it: no write, no error
    with RunLock(tmp_path, FINALIZE):  # a finalize writes its holder line, never over the mark
        assert read_mark(tmp_path) == (8, 15)
    raw = (tmp_path / ".lock").read_bytes()
    assert raw[:MARK_OFFSET].split() == [str(os.getpid()).encode(), *FINALIZE.encode().split()]
    assert raw[MARK_OFFSET:] == b"00000000000000000008 00000000000000000015\n"
    assert said == []


def test_a_lock_file_without_a_mark_has_none(tmp_path: Path) -> None:
    assert read_mark(tmp_path) is None  # no lock file
    (tmp_path / ".lock").write_bytes(b"1234\n")  # a version before the mark
    assert read_mark(tmp_path) is None


def test_a_failing_write_is_said_once_and_later_writes_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    with RunLock(tmp_path):
        mark = IdMark(said.append)
        mark.open(tmp_path, 0, 0)
        real = os.pwrite

        def full(fd: int, data: bytes, offset: int) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", full)
        mark.advance(1, 1)
        mark.advance(2, 2)
        monkeypatch.setattr(os, "pwrite", real)
        mark.advance(3, 5)
        mark.close()
    assert read_mark(tmp_path) == (3, 5)
    assert len(said) == 1
    assert said[0].startswith("the run's id mark in .lock could not be written (OSError: ")
    assert "No space left on device" in said[0]


def test_a_lock_file_that_cannot_be_opened_is_said_at_the_open(tmp_path: Path) -> None:
    said: list[str] = []
    mark = IdMark(said.append)
    mark.open(tmp_path, 0, 0)  # no lock file: the run never took its lock here
    mark.advance(1, 1)
    assert len(said) == 1
    assert "FileNotFoundError" in said[0]
    assert read_mark(tmp_path) is None
