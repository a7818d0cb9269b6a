"""Which path measures a tensor's default profile: the one decision, for every caller.

Cheapest first: the small-tensor lane (`lane`, a sample's small float32 CPU tensors measured
together), one CPU tensor in NumPy (`numerics.measure_on_cpu`), and the general path
(`numerics.raw_on_device`, on the tensor's device, no sync) that every fast path hands over to.
`host_paths` is a parameter of `reducers.Measurer`, not a module global.
"""

from __future__ import annotations

from typing import Literal

import torch

from torchinstruments.measurement import lane, tensors

__all__ = ["Path", "choose"]

Path = Literal["lane", "host", "general"]


def choose(tensor: torch.Tensor, *, host_paths: bool, lane_ok: bool) -> Path:
    """The path of `tensor`: `lane_ok` when the default profile is the only reducer (a focus
    layer's histogram is counted on the lane's sorted copy too)."""
    if lane_ok and host_paths and lane.takes(tensor):  # the hot case first: checked per tensor
        return "lane"
    if host_paths and tensors.is_plain(tensor) and tensors.host_sync_is_free(tensor.device):
        return "host"  # NumPy reads it: plain, where a host sync is free
    return "general"
