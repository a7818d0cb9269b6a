"""Which path measures a tensor's default profile: the one decision, for every caller.

Paths, cheapest first: the small-tensor lane (`lane`: a NumPy copy, measured with the sample's
other small tensors as arrays), the deferred batch (`reducers.settle`: a small CPU tensor of a
focus layer, say, measured with the sample's others), the host path (`numerics.measure_on_cpu`:
one plain CPU tensor in NumPy) and the general path (`numerics.raw_on_device`: torch ops on the
tensor's own device, no host synchronisation), which every fast path hands over to when it
declines or fails. `host_paths=False` sends every tensor to the general path, as on a GPU: a
parameter of `reducers.Measurer` (and `histograms.reduce_histogram`), never a module global.
"""

from __future__ import annotations

from typing import Literal

import torch

from torchinstruments.measurement import lane, numerics, tensors

Path = Literal["lane", "batch", "host", "general"]


def choose(tensor: torch.Tensor, *, host_paths: bool, lane_ok: bool, defer: bool) -> Path:
    """The path of `tensor`.

    Args:
        tensor: The measured form of the tensor (detached or not).
        host_paths: Whether the NumPy paths may take plain CPU tensors.
        lane_ok: Whether the lane may take it (the default profile is the only reducer and the
            layer is not a focus layer).
        defer: Whether a small tensor may wait for the sample's batch.
    """
    if lane_ok and host_paths and lane.takes(tensor):  # the hot case first: checked per tensor
        return "lane"
    if not host_paths or not tensors.host_path_takes(tensor):
        return "general"
    if (
        defer
        and 0 < tensor.numel() <= numerics.BATCH_MAX
        and tensors.unsupported_reason(tensor) is None
        and tensors.working_dtype(tensor.dtype) == torch.float32
    ):
        return "batch"
    return "host"
