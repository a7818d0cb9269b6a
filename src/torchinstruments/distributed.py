"""Which ranks attach, and where each rank writes.

No collective is ever called: ranks sample on their own clocks and forward counts, so any
all-reduce or barrier inside the library could hang a run whose ranks disagree. Each rank's
history is complete on its own and comparable afterwards with
`pl.scan_parquet("stats/rank-*/history.parquet")`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

RANK_POLICIES = ("rank0", "all")


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """This process's rank (None outside an initialized process group) and whether it attaches."""

    rank: int | None
    world_size: int | None
    attach: bool
    directory: Path


def validate_rank_policy(rank_policy: object) -> str:
    """Return `rank_policy` if allowed, else raise ValueError listing the allowed values."""
    if rank_policy not in RANK_POLICIES:
        raise ValueError(
            f"rank_policy must be one of {', '.join(repr(p) for p in RANK_POLICIES)}, "
            f"got {rank_policy!r}"
        )
    return str(rank_policy)


def place_rank(output_dir: Path, rank_policy: str) -> RankPlacement:
    """Decide, from the process group alone, whether to attach and which directory to write.

    `"rank0"`: rank 0 (or a process outside torch.distributed) writes `output_dir`; other ranks
    attach nothing. `"all"`: every rank writes `output_dir/rank-NNN/`; outside an initialized
    process group there is one rank and it writes `output_dir` itself.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return RankPlacement(None, None, True, output_dir)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank_policy == "rank0":
        return RankPlacement(rank, world_size, rank == 0, output_dir)
    return RankPlacement(rank, world_size, True, output_dir / f"rank-{rank:03d}")
