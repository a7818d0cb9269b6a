"""The library's own process groups for global statistics, their bounded wait, and the stop
after a failure.

Why groups of its own: a collective pairs with whatever collective the other ranks call next on
the same group. When one rank takes a sample the others do not (its data ran out, it met the
user's `dist.barrier()` or `all_reduce`, or DDP's join context, while another rank is still
sampling), the library's collective on the user's group would be paired with the user's: the
user's barrier waits for the group's timeout (30 minutes under gloo by default) and then fails,
or a user's all-reduce receives the library's header. On groups created for the library at
inject (`dist.new_group`, with the option's wait as their timeout: `global_statistics_timeout`,
60 s by default), the library's collectives pair only with the library's, and a rank waiting
for a sample no other rank takes gives up after that wait.

After a failed collective (that wait run out, a rank gone) the ranks are no longer known to
be in step on those groups: a rank that gave up has moved on, and its next collective would
pair with another rank's previous one. So global statistics stop for the rest of the run: each
later sample's globally measured tensors get null rows with the reason, with no collective, so
no rank waits again. The warning and index.md say so.

The cost: at inject every rank creates the groups together (one over every rank, plus, with a
group named, one all-gather of each rank's named group's ranks and one group over each group
so named that is not every rank: a 2-D job's data-parallel groups, each rank naming its own),
so inject waits for every rank's inject, at most that wait; a group that cannot be created
stops global statistics from the first sample.
DTensor outputs on a mesh that spans only part of the ranks (a 2-D mesh's submesh) still take
their collectives over the mesh's group (its groups do not exist at inject); the agreement over
the library's group before them ensures every rank of the job is in the same sample.

The library's groups use gloo whatever the job's backend: a gloo collective that outwaits its
timeout raises (null rows with the reason), where NCCL's watchdog would abort the process, the
user's job with it. Every collective of the library sends its packet on the device its group's
backend needs (`group_device`): the CPU for gloo, the current CUDA device for an NCCL-only
group (a DTensor mesh's), the CPU for a group with both ("cpu:gloo,cuda:nccl"), as torch picks
for its own object collectives. The statistics themselves are reduced on the tensors' device;
only their packed counts and moments travel.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchinstruments import reasons


@dataclass
class GlobalRun:
    """The run's global statistics: the checked option, the library's groups, and why they
    stopped (None while they work)."""

    option: Any  # global_statistics.GlobalOption
    agreement: Any  # the library's group over every rank: the header, and world-wide tensors
    private: dict[tuple[int, ...], Any] = field(default_factory=dict)  # ranks -> its group
    stopped: str | None = None
    # `global_statistics=True` on a model that held no DTensor at inject: no output is measured
    # over ranks, so no sample takes a collective (`open_run`)
    local: bool = False

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


def open_run(option: Any, no_dtensor: bool = False) -> GlobalRun | None:
    """The library's groups for `option` (None when global statistics are off). Every rank
    calls it at inject, in the same order: group creation pairs the ranks.

    `no_dtensor`: the model held no DTensor parameter or buffer at inject
    (`global_option.holds_no_dtensor`). With no group named there is then nothing to measure
    over ranks: the run is `local`, makes no group and takes no collective, not even a sample's
    header, so a forward one rank runs alone (an evaluation batch on rank 0 under DDP) waits for
    no one. Every rank holds the same model, so every rank decides this alike, alone."""
    if option is None:
        return None
    if no_dtensor and option.group is None:
        return GlobalRun(option, None, local=True)
    world = tuple(dist.get_process_group_ranks(dist.group.WORLD))
    run = GlobalRun(option, None)
    backend = "gloo" if dist.is_gloo_available() else None  # a timeout raises, never aborts
    try:
        run.agreement = dist.new_group(timeout=option.wait, backend=backend)
        run.private[world] = run.agreement
        if option.group is not None:
            _named_groups(run, backend)
    except Exception as error:  # never the user's inject: the rows say it, from the first sample
        run.stop(None, error)
    return run


def _named_groups(run: GlobalRun, backend: str | None) -> None:
    """The library's own group over the named group's ranks, where that is not every rank.

    Each rank may name another group (a 2-D job's data-parallel groups: {0, 1} on ranks 0 and
    1, {2, 3} on ranks 2 and 3), but `dist.new_group` must be called by every rank of the job
    with the same ranks, in the same order: a rank creating {0, 1} while another creates
    {2, 3} pairs two groups into one, whose collectives then time out or join ranks of
    different groups. So the ranks first all-gather each one's named group (one object
    collective at inject, over the library's world group), then every rank creates every
    distinct group in one sorted order, keeping its own."""
    mine = tuple(dist.get_process_group_ranks(run.option.group))
    named: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(named, mine, group=run.agreement)
    for ranks in sorted({tuple(r) for r in named}):
        if ranks in run.private:  # every rank: the world's group, made above
            continue
        group = dist.new_group(list(ranks), timeout=run.option.wait, backend=backend)
        if ranks == mine:
            run.private[ranks] = group


def collective_device(backend: str, index: int | None = None) -> torch.device:
    """The device a collective's tensors must be on for a group of `backend`, as
    `dist.get_backend` names it ("gloo", "nccl", "cpu:gloo,cuda:nccl"); `index`: the current
    device's index, for a device other than the CPU. Torch's rule for object collectives: the
    one device type the backend serves, else the CPU where it is among them (an unknown
    backend: the CPU), else the first."""
    types: list[str] = []
    for part in backend.lower().split(","):
        device, _, name = part.strip().rpartition(":")
        types += [device] if device else dist.Backend.backend_capability.get(name, ["cpu"])
    if "cpu" in types:
        return torch.device("cpu")
    return torch.device(types[0]) if index is None else torch.device(types[0], index)


def group_device(group: Any) -> torch.device:
    """`collective_device` of `group`'s backend, on this process's current device of its type
    (NCCL: `torch.cuda.current_device()`, the device the job's own collectives use)."""
    backend = str(dist.get_backend(group))
    kind = collective_device(backend).type
    return collective_device(
        backend, getattr(torch, kind).current_device() if kind != "cpu" else None
    )


def gathered(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on each), stacked in rank order, all-gathered on
    the device `group` needs (`group_device`) and left there: its reader takes it to the host
    once (a gloo group's is there already)."""
    sent = tensor.to(group_device(group))
    out = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, sent, group=group)
    return torch.stack(out)


def summed(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over `group`'s ranks of `tensor`, on `tensor`'s device, all-reduced on the device
    `group` needs; `tensor` itself may hold the sum afterwards."""
    sent = tensor.to(group_device(group))
    dist.all_reduce(sent, group=group)
    return sent.to(tensor.device)


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


__all__ = [
    "GlobalRun",
    "close_run",
    "collective_device",
    "gathered",
    "group_device",
    "open_run",
    "summed",
]
