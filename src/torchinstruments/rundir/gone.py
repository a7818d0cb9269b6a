"""A run directory removed while its run went on: what removal says instead of finishing it.

Design decision: a run directory removed mid-run (`rm -rf` by the user, a cleanup job) fails
every write after it, and removal's finish used to warn each failure with the advice a failed
write gets, `torchinstruments finalize <directory>`: advice on a directory that no longer
exists. Removal looks first: when the directory is gone, nothing is finished (each write would
fail, and the run has nothing left to finalize or continue) and one warning says that it is
gone and what went with it: every row the run recorded (those on disk went with the directory,
the later ones could not be written), its TensorBoard events, state file and index.md.
"""

from __future__ import annotations

from pathlib import Path

from torchinstruments.rundir.attempts import attempt_total
from torchinstruments.rundir.ranges import plural
from torchinstruments.rundir.shell import literal_if_unclear
from torchinstruments.rundir.state import RunState

__all__ = ["gone_warning", "is_gone"]


def is_gone(directory: Path) -> bool:
    """Whether the run directory no longer exists (a path that cannot be looked at, for lack of
    permission, is not gone: its writes say why they failed)."""
    try:
        directory.lstat()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return not directory.is_dir()


def gone_warning(directory: Path, state: RunState) -> str:
    """The one warning removal gives for a run whose `directory` is gone, with what was lost
    (`state`: the run's as removal would have finished it)."""
    counts = state.counts
    bound = "at least " if state.counts_recovered else ""
    if counts is None:
        what = "every sample it recorded"
    elif state.counts_recovered and not counts.samples:  # a bound of 0: nobody counted them
        what = "samples (how many is unknown: no attempt's count of them is known)"
    else:
        what = f"{bound}{plural(counts.samples, 'sample')}"
    if state.rows_recorded is not None and (state.rows_recorded or not state.counts_recovered):
        what += f" ({bound}{plural(state.rows_recorded, 'row')})"
    total = attempt_total(state.attempts)
    attempts = f" over {total} attempts" if total > 1 else ""
    return (
        f"torchinstruments: the run directory {literal_if_unclear(str(directory))} no longer "
        "exists: it was removed while "
        "the run went on (by hand or by a cleanup job?). Everything the run had written there "
        "went with it (history parts, TensorBoard events, its state file and index.md), and "
        f"what it recorded after could not be written: the run's {what}{attempts} are lost. "
        "Nothing is left to finalize or continue; an injection there starts a new run"
    )
