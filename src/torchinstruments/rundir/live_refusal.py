"""The refusal of a run directory that a live process writes: which process, and what to do.

A new run in a directory that holds a run is refused (`rundir.layout.check_output_dir`), and
that refusal suggests resume=True. When a live process still writes the run there (its lock is
held), resume=True would be refused too, so this refusal says so instead, and names the most
likely cause: a write this very process gave up that still holds the lock (a removal's finish
on a file system that stopped answering, `rundir.stuck_writes`), a model observed in this
process and not removed, or ranks of a torch.distributed job that injected before
init_process_group and took one directory each.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchinstruments.records import RunInfo
from torchinstruments.rundir.lock import live_writer
from torchinstruments.rundir.stuck_writes import stuck_in

__all__ = ["refuse_a_live_run"]


def refuse_a_live_run(directory: Path, run: RunInfo, refused: FileExistsError) -> None:
    """Raise a FileExistsError that says a live process writes the run in `directory` (else
    return): resume=True, which `refused` suggests, would be refused too. A process placed
    without a rank is most likely one rank of a job that injected before init_process_group,
    so every rank took `directory` for its own: the message says how to place each rank."""
    holder = live_writer(directory)
    if holder is None:
        return
    stuck = stuck_in(directory)
    if stuck is not None:  # the model was removed: a write its removal gave up holds the lock
        raise FileExistsError(
            f"output_dir={str(directory)!r} holds a run whose lock this process still holds: "
            + stuck.describe(directory)
        ) from refused
    here = holder == f" (pid {os.getpid()})"  # a model observed here, not removed (a notebook)
    ended = " (once that run has ended, resume=True continues it there)"
    advice = (
        " If this process is one rank of a torch.distributed job: inject_observer found "
        "neither a process group nor the launcher's RANK and WORLD_SIZE, so every rank took "
        "output_dir for its own. Call inject_observer after init_process_group (or launch with "
        "torchrun), so that rank_policy='all' writes output_dir/rank-NNN/ per rank and 'rank0' "
        f"attaches on rank 0 only; otherwise pass a new output_dir{ended}."
        if run.rank is None
        else f" Pass each process a new output_dir of its own{ended}."
    )
    raise FileExistsError(
        f"output_dir={str(directory)!r} holds a run that a live process{holder} is writing now"
        + (" (this process: a model observed here was not removed)" if here else "")
        + f": two processes cannot write one run, and resume=True would be refused too.{advice}"
    ) from refused
