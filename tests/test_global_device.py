"""The device every collective of global statistics sends its packet on: the one its group's
backend needs (gloo: the CPU; NCCL: the current CUDA device; both: the CPU, as torch picks for
its own object collectives), and the library's own groups on gloo whatever the job's backend,
so their bounded wait raises instead of NCCL's watchdog aborting the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchinstruments.global_channel import (
    close_run,
    collective_device,
    gathered,
    group_device,
    open_run,
    summed,
)
from torchinstruments.global_option import GlobalOption


@pytest.mark.parametrize(
    ("backend", "index", "expected"),
    [
        ("gloo", None, torch.device("cpu")),
        ("nccl", 3, torch.device("cuda", 3)),
        ("NCCL", 0, torch.device("cuda", 0)),
        ("cuda:nccl", 1, torch.device("cuda", 1)),
        ("cpu:gloo,cuda:nccl", 2, torch.device("cpu")),
        ("cuda:nccl,cpu:gloo", 2, torch.device("cpu")),
        ("xccl", 1, torch.device("xpu", 1)),
        ("mpi", None, torch.device("cpu")),
        ("ucc", None, torch.device("cpu")),
        ("a_backend_torch_does_not_know", None, torch.device("cpu")),
    ],
)
def test_each_backend_gets_the_device_its_collectives_need(
    backend: str, index: int | None, expected: torch.device
) -> None:
    assert collective_device(backend, index) == expected


def test_the_librarys_groups_are_gloo_and_send_on_the_cpu(tmp_path: Path) -> None:
    """On a real gloo group (one rank): the groups made at inject, their device, and the two
    collectives every packet takes, returning on the sent tensor's device."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        run = open_run(GlobalOption(dist.group.WORLD))
        assert run is not None
        assert run.stopped is None
        assert [dist.get_backend(g) for g in run.private.values()] == ["gloo"]
        assert group_device(run.agreement) == torch.device("cpu")
        assert group_device(dist.group.WORLD) == torch.device("cpu")
        packet = torch.tensor([[1.5, -2.0], [3.0, 4.0]], dtype=torch.float64)
        every = gathered(packet, run.agreement)
        assert every.shape == (1, 2, 2)
        assert torch.equal(every[0], packet)
        assert torch.equal(summed(packet.clone(), run.agreement), packet)
        close_run(run)
    finally:
        dist.destroy_process_group()
