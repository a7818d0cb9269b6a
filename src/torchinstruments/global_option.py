"""The `global_statistics=` and `global_statistics_timeout=` options of `inject_observer`:
their checks at inject, and what index.md says of them.

Why the wait is an option: a rank waits in the library's collectives for the other ranks at
most `global_statistics_timeout` (`global_channel`), and a sample whose wait runs out stops
global statistics for the rest of the run. The default (60 s) covers the ranks' ordinary skew at
a sample's end, far under the program's own groups' timeouts; a job whose ranks can be minutes
apart at a sampled forward (a first step compiled on one rank only, an autotuning rank, a
checkpoint loaded by rank 0 alone) needs more. It is always finite: a rank never waits forever.
"""

from __future__ import annotations

import datetime
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from torchinstruments.measurement.tensors import dtensor_class

DEFAULT_WAIT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class GlobalOption:
    """The checked `global_statistics=` option: the named group (None: DTensors only) and how
    long a rank waits in the library's collectives for the others."""

    group: Any
    wait: datetime.timedelta = DEFAULT_WAIT


def check_wait(value: object) -> datetime.timedelta:
    """Validate `global_statistics_timeout=`: None (60 s), seconds, or a `timedelta`.

    Raises:
        TypeError: not None, a number or a `datetime.timedelta`.
        ValueError: not finite, or not above 0.
    """
    if value is None:
        return DEFAULT_WAIT
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"global_statistics_timeout must be None (60 seconds), a number of seconds or a "
            f"datetime.timedelta, got {value!r}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"global_statistics_timeout must be finite and above 0 seconds, got {value!r}: it "
            "is how long a rank waits in the library's collectives for the other ranks, and a "
            "rank must never wait forever (pass e.g. 600 for ten minutes)"
        )
    return datetime.timedelta(seconds=seconds)


def check_global_statistics(
    value: object, sampler: object, rank_policy: str, timeout: object = None
) -> GlobalOption | None:
    """Validate `global_statistics=` (and its `timeout`, checked even when it is off) at
    inject; None when it is off.

    Raises:
        TypeError: not a bool or a `torch.distributed.ProcessGroup`; a bad `timeout`.
        ValueError: torch's value for a group this rank is not in (`NON_GROUP_MEMBER`); on
            without an initialized process group, with `rank_policy="rank0"`, or with a
            sampler whose decision could differ across ranks; a bad `timeout`.
    """
    wait = check_wait(timeout)
    if value is False or value is None:
        return None
    group_class = getattr(dist, "ProcessGroup", None)
    outside = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", object())
    if value is not True and type(value) is type(outside) and value == outside:
        raise ValueError(
            f"global_statistics={value!r}: this rank is not a member of the process group "
            "passed (torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER, "
            f"{outside!r}, on the ranks outside the group). Every rank names a group it belongs "
            "to: its own data-parallel group, say (every rank creates each group with "
            "dist.new_group, and passes the one it is in), or True"
        )
    if value is not True and not (group_class is not None and isinstance(value, group_class)):
        raise TypeError(
            f"global_statistics must be False (default), True (DTensor Shard/Partial outputs "
            f"measured over their mesh) or a torch.distributed.ProcessGroup (also every other "
            f"output, over that group's ranks), got {value!r}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"global_statistics={value!r} needs an initialized process group at "
            "inject_observer: call torch.distributed.init_process_group first, or leave "
            "global_statistics=False"
        )
    if rank_policy != "all":
        raise ValueError(
            f"global_statistics needs rank_policy='all', got rank_policy={rank_policy!r}: every "
            "rank must observe and take part in each sample's collectives; pass "
            "rank_policy='all'"
        )
    check_same_on_every_rank(sampler, "sampler")
    return GlobalOption(None if value is True else value, wait)


def check_same_on_every_rank(sampler: object, argument: str) -> None:
    """Refuse a sampler whose decision could differ across ranks, under global_statistics: every
    sampler a run asks (the training one, a trainer callback's `record_eval` one) must take the
    same samples on every rank.

    Raises:
        ValueError: naming `argument`, the sampler and the samplers allowed.
    """
    from torchinstruments.sampling import EveryNForwardsSampler

    if not isinstance(sampler, EveryNForwardsSampler) and not getattr(
        sampler, "same_on_every_rank", False
    ):
        raise ValueError(
            f"global_statistics refuses {argument}={sampler!r}: its decision could differ "
            "across ranks (a rank's clock, say), and a sample one rank takes and another does "
            "not would leave the first waiting in a collective. Use EveryNForwardsSampler(n), "
            "or a sampler with the attribute `same_on_every_rank = True` whose decision depends "
            "on the forward index only"
        )


def holds_no_dtensor(option: GlobalOption | None, model: nn.Module) -> bool:
    """Whether `global_statistics=True` (no group named) meets a model that holds no DTensor
    parameter or buffer at inject: then nothing is measured over ranks and no sample takes a
    collective (`global_channel.open_run`). Read from the model alone, so every rank (each
    holds the same model) answers alike without a collective. False when the option is off or
    names a group (every floating output is measured over it then)."""
    if option is None or option.group is not None:
        return False
    dtensor = dtensor_class()
    tensors = itertools.chain(model.parameters(), model.buffers())
    return dtensor is None or not any(isinstance(t, dtensor) for t in tensors)


LOCAL_DTENSOR = (
    "global_statistics=True: a layer returned a DTensor although the model held no DTensor "
    "parameter or buffer at inject, so this run takes no collective: such DTensors are "
    "measured as this rank's local tensor (population null, as without global_statistics), "
    "not over their mesh. To measure them over it, inject after the model is parallelized "
    "(a DTensor parameter)"
)


def global_notes(option: GlobalOption | None, no_dtensor: bool = False) -> tuple[str, ...]:
    """What `global_statistics=` changes in the rows, said in index.md (empty when off);
    `no_dtensor`: `holds_no_dtensor` of the model."""
    if option is None:
        return ()
    if no_dtensor:
        return (
            "global_statistics=True: the model held no DTensor parameter or buffer at inject, "
            "so no output is measured over ranks and no sample takes a collective (every rank "
            "decides this alike from its model, alone: a forward one rank runs alone, an "
            "evaluation batch on rank 0 under DDP, waits for no one); a DTensor a layer returns "
            "anyway (DTensor.from_local in a forward) gets this rank's local rows, warned when "
            "first met. Name a process group (global_statistics=group) to measure every "
            "floating output over its ranks",
        )
    over = (
        "DTensor Shard/Partial outputs (1-D meshes) and, over the named process group, every "
        "other floating output"
        if option.group is not None
        else "DTensor Shard/Partial outputs on 1-D meshes"
    )
    return (
        f"global_statistics: {over} are measured as the whole tensor over their ranks (rows with "
        "population 'global:ranks=...', exact); those outputs get no local rows and no "
        "TensorBoard histogram, their output_gradient rows stay this rank's tensor (population "
        "null); each sampled forward runs a fixed number of packed collectives, on process groups "
        "of the library's own made at inject (never paired with the program's collectives): a "
        f"rank that waits in them longer than {_seconds(option.wait)} "
        "(global_statistics_timeout) for a sample no other rank takes (uneven data, or an "
        "evaluation batch one rank runs alone) stops global "
        "statistics for the rest of the run, null rows with the reason; so do ranks whose "
        "samples are different root forwards (forward_index, step) or kinds of forward (train "
        "or eval mode, grad enabled or not), on every rank together, without a wait",
    )


def _seconds(wait: datetime.timedelta) -> str:
    """`wait` as index.md says it: "60 s"."""
    return f"{wait.total_seconds():g} s"


__all__ = [
    "DEFAULT_WAIT",
    "LOCAL_DTENSOR",
    "GlobalOption",
    "check_global_statistics",
    "check_same_on_every_rank",
    "check_wait",
    "global_notes",
    "holds_no_dtensor",
]
