"""Counting the reads of run state files, for tests that pin how often a command decodes one."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchinstruments.rundir import recovery
from torchinstruments.rundir.state import RunState


def count_state_decodes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The directories whose `.state.json` is decoded from now on, one entry per decode."""
    decoded: list[Path] = []
    real = recovery.read_state

    def counting(directory: Path) -> RunState:
        decoded.append(Path(directory))
        return real(directory)

    monkeypatch.setattr(recovery, "read_state", counting)
    return decoded
