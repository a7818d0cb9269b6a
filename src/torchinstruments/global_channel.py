"""The library's own process groups for global statistics, their bounded wait, and the stop
after a failure.

Why groups of its own: a collective pairs with whatever collective the other ranks call next on
the same group. When one rank takes a sample the others do not (its data ran out, it met the
user's `dist.barrier()` or `all_reduce`, or DDP's join context, while another rank is still
sampling), the library's collective on the user's group would be paired with the user's: the
user's barrier waits for the group's timeout (30 minutes under gloo by default) and then fails,
or a user's all-reduce receives the library's header. On groups created for the library at
inject (`dist.new_group`, with `WAIT` as their timeout), the library's collectives pair only
with the library's, and a rank waiting for a sample no other rank takes gives up after `WAIT`.

After a failed collective (that wait run out, a rank gone) the ranks are no longer known to
be in step on those groups: a rank that gave up has moved on, and its next collective would
pair with another rank's previous one. So global statistics stop for the rest of the run: each
later sample's globally measured tensors get null rows with the reason, with no collective, so
no rank waits again. The warning and index.md say so.

The cost: at inject every rank creates the groups together (one over every rank, plus one over
the named group's ranks when that is not every rank), so inject waits for every rank's inject,
at most `WAIT`; a group that cannot be created stops global statistics from the first sample.
DTensor outputs on a mesh that spans only part of the ranks (a 2-D mesh's submesh) still take
their collectives over the mesh's group (its groups do not exist at inject); the agreement over
the library's group before them ensures every rank of the job is in the same sample.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from torchinstruments import reasons

# How long a rank waits in a collective of the library for the other ranks: long enough for the
# ranks' ordinary skew at a sample's end, far under the user's own groups' default timeout, so
# the user's collective that another rank waits in outlives it.
WAIT = datetime.timedelta(seconds=60)


@dataclass
class GlobalRun:
    """The run's global statistics: the checked option, the library's groups, and why they
    stopped (None while they work)."""

    option: Any  # global_statistics.GlobalOption
    agreement: Any  # the library's group over every rank: the header, and world-wide tensors
    private: dict[tuple[int, ...], Any] = field(default_factory=dict)  # ranks -> its group
    stopped: str | None = None

    @property
    def group(self) -> Any:
        """The named process group (None: DTensor outputs only)."""
        return self.option.group

    def group_for(self, ranks: tuple[int, ...], group: Any) -> Any:
        """The library's own group over `ranks` where there is one, else `group`."""
        return self.private.get(ranks, group)

    def stop(self, sample_id: int | None, error: BaseException) -> str:
        """Stop global statistics for the rest of the run; the reason later rows carry."""
        if self.stopped is None:
            self.stopped = reasons.global_stopped(sample_id, error)
        return self.stopped


def open_run(option: Any) -> GlobalRun | None:
    """The library's groups for `option` (None when global statistics are off). Every rank
    calls it at inject, in the same order: group creation pairs the ranks."""
    if option is None:
        return None
    world = tuple(dist.get_process_group_ranks(dist.group.WORLD))
    run = GlobalRun(option, None)
    try:
        run.agreement = dist.new_group(timeout=WAIT)
        run.private[world] = run.agreement
        if option.group is not None:
            ranks = tuple(dist.get_process_group_ranks(option.group))
            if ranks not in run.private:
                run.private[ranks] = dist.new_group(list(ranks), timeout=WAIT)
    except Exception as error:  # never the user's inject: the rows say it, from the first sample
        run.stop(None, error)
    return run


def close_run(run: GlobalRun | None) -> None:
    """Destroy the library's groups (at removal); ones already gone are left alone."""
    if run is None:
        return
    mine = {id(g): g for g in run.private.values() if isinstance(g, dist.ProcessGroup)}
    for group in mine.values():  # a rank outside a group holds no group object for it
        # the user may have destroyed every group first: nothing is left to do then
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)
    run.private.clear()


__all__ = ["WAIT", "GlobalRun", "close_run", "open_run"]
