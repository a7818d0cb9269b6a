"""Which ranks attach, and where each rank writes.

No collective is ever called: ranks sample on their own clocks and forward counts, so any
all-reduce or barrier inside the library could hang a run whose ranks disagree. Each rank's
history is complete on its own and comparable afterwards with
`pl.scan_parquet("stats/rank-*/history.parquet")`.

Design decision: the rank comes from the process group when it is initialized, and otherwise from
the launcher's environment (`RANK` and `WORLD_SIZE`, set by torchrun, `torch.distributed.launch`
and most launchers built on them). Scripts commonly build the model, and so inject, before
`init_process_group`; without the environment every rank would think it is alone, write the same
directory and race for it, with a null rank column. The environment is read once, at inject; a
malformed value (not an integer, rank outside `[0, WORLD_SIZE)`) is ignored with a warning, since
such a process would fail in `init_process_group` anyway and the run must not fail first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from torchinstruments.notices import warn

__all__ = [
    "RANK_POLICIES",
    "RankPlacement",
    "check_rank_policy",
    "current_rank",
    "environment_rank",
    "joined_after_inject",
    "place_rank",
]

RANK_POLICIES = ("rank0", "all")


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """This process's rank (None outside torch.distributed) and whether it attaches."""

    rank: int | None
    world_size: int | None
    attach: bool
    directory: Path


def check_rank_policy(rank_policy: object) -> str:
    """Return `rank_policy` if allowed, else raise ValueError listing the allowed values."""
    if rank_policy not in RANK_POLICIES:
        raise ValueError(
            f"rank_policy must be one of {', '.join(repr(p) for p in RANK_POLICIES)}, "
            f"got {rank_policy!r}"
        )
    return str(rank_policy)


def environment_rank(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """`(rank, world_size)` from a launcher's `RANK` and `WORLD_SIZE`, or None if not set."""
    rank_text, world_text = environ.get("RANK"), environ.get("WORLD_SIZE")
    if rank_text is None or world_text is None:
        return None
    try:
        rank, world_size = int(rank_text), int(world_text)
    except ValueError:
        rank, world_size = -1, 0
    if not 0 <= rank < world_size:
        warn(
            f"torchinstruments: ignoring RANK={rank_text!r}, WORLD_SIZE={world_text!r} from the "
            "environment (expected integers with 0 <= RANK < WORLD_SIZE); this process is "
            "treated as not distributed"
        )
        return None
    return rank, world_size


def current_rank() -> tuple[int, int] | None:
    """`(rank, world_size)` from the process group, else from the environment, else None."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return environment_rank(os.environ)


def place_rank(output_dir: Path, rank_policy: str) -> RankPlacement:
    """Decide whether to attach and which directory to write.

    `"rank0"`: rank 0 (or a process outside torch.distributed) writes `output_dir`; other ranks
    attach nothing. `"all"`: every rank writes `output_dir/rank-NNN/`; outside torch.distributed
    there is one rank and it writes `output_dir` itself.
    """
    found = current_rank()
    if found is None:
        return RankPlacement(None, None, True, output_dir)
    rank, world_size = found
    if rank_policy == "rank0":
        return RankPlacement(rank, world_size, rank == 0, output_dir)
    return RankPlacement(rank, world_size, True, output_dir / f"rank-{rank:03d}")


def joined_after_inject(rank: int | None) -> str | None:
    """The note for a run placed as a single process (`rank` None) whose process has joined a
    process group of several ranks since, or None.

    Placement is decided once, at inject, so such a run cannot move; but its rows carry a null
    rank, it wrote `output_dir` itself whatever `rank_policy` said, and every other rank of the
    job attached the same way (the first to open the directory got it, the others were
    refused). index.md says so, and how to inject so that each rank is placed.
    """
    if rank is not None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        joined, world_size = dist.get_rank(), dist.get_world_size()
    except Exception:  # a group being torn down: nothing known to say (this runs at removal)
        return None
    if world_size < 2:
        return None
    return (
        f"this process became rank {joined} of {world_size} (torch.distributed) after "
        "inject_observer, which found neither a process group nor the launcher's RANK and "
        "WORLD_SIZE: the run was placed as a single process's (output_dir itself, rank column "
        "null, rank_policy not applied: every rank of the job attached, and the first to open "
        "output_dir was the only one to get it). Call inject_observer after "
        "init_process_group (or launch with torchrun), so that rank_policy='all' writes "
        "rank-NNN/ per rank and 'rank0' attaches on rank 0 only"
    )
