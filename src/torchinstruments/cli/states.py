"""Each run's state file decoded once per command, however many readers of the command ask.

Design decision: a command reads a run's state in several places (the lines it says on stderr
before it reads, `reader.read_facts`, the refusal of a run without rows, a parent's ranks), and
a 3,000-layer run's `.state.json` (its layer catalog) takes about 70 ms of CPU to decode and
check field by field. Inside `decoded_once` (the reading commands' one scope:
`cli.run_command`) `run_state` decodes a directory's state the first time it is asked for and
hands the same frozen `RunState` (or raises the same error) every later time; outside it, each
call decodes, as `rundir.recovery.load_state` does. The scope ends with the command, so a
state written after it (a live run's next write, `finalize`) is read afresh by the next one;
within a command every reader sees one and the same state of the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from torchinstruments.rundir.recovery import load_state
from torchinstruments.rundir.state import RunState

__all__ = ["decoded_once", "run_state"]

_Decoded = RunState | None | OSError | ValueError

_DECODED: ContextVar[dict[Path, _Decoded] | None] = ContextVar("decoded_states", default=None)


@contextmanager
def decoded_once() -> Iterator[None]:
    """Within this scope, `run_state` decodes each directory's state at most once."""
    token = _DECODED.set({})
    try:
        yield
    finally:
        _DECODED.reset(token)


def run_state(directory: Path) -> RunState | None:
    """`rundir.recovery.load_state(directory)`, decoded once per `decoded_once` scope.

    Raises:
        OSError, ValueError: as `load_state` (the same error again on a later call).
    """
    decoded = _DECODED.get()
    if decoded is None:
        return load_state(directory)
    key = Path(directory).expanduser().absolute()
    if key not in decoded:
        try:
            decoded[key] = load_state(directory)
        except (OSError, ValueError) as error:
            decoded[key] = error
    found = decoded[key]
    if isinstance(found, (OSError, ValueError)):
        raise found
    return found
