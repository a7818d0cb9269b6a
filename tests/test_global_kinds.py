"""global_statistics over outputs of unusual kinds: each tensor's failure stays in its own rows.

Two gloo ranks, each its own batch, the world group named. Beside ordinary layers the model
has a layer returning a sparse COO tensor, one returning a (strided) nested tensor, one
returning a tensor on the meta device (a shape probe) and one returning packed float4 (two 4-bit
floats in each byte, which torch cannot convert). The sparse output gets global rows of
the dense tensor it stands for, the nested one of its components' entries (shape null, as its
local rows have), both equal to NumPy's statistics of every rank's values gathered by the test
through plain forward hooks; the meta output, which has no values, keeps its local rows (null,
"unsupported device meta"), and so does the packed one (null, "packed dtype ..."); and no other
layer's global rows are lost to those tensors. Under
`torch.func.vmap` the outputs are batched wrappers: their global rows are those of what the plain
model computes on every rank's whole batch, as their local rows would be (unwrapped).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import torch.distributed as dist
from test_global_statistics import check, global_rows
from torch import nn

from torchinstruments.measurement.tensors import TORCH_FUNC_NOTE
from torchinstruments.registry import OBSERVERS

from _ranks import joined, run_ranks

LAYERS = ("hidden", "sparse", "nested", "act")

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")


class Sparse(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu().to_sparse()


class Ragged(nn.Module):
    """Each row's first `i + 1` entries: a nested tensor of rows of different lengths."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nested.as_nested_tensor([row[: i + 1] for i, row in enumerate(x)])


class Probe(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, device="meta")


class Packed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs() * 40).to(torch.uint8).view(torch.float4_e2m1fn_x2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 6)
        self.sparse = Sparse()
        self.nested = Ragged()
        self.probe = Probe()
        self.packed = Packed()
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        self.sparse(h)
        self.nested(h)
        self.probe(h)
        self.packed(h)
        return self.act(h)


def entries(output: torch.Tensor) -> np.ndarray:
    """What a row describes: a sparse tensor's dense values, a nested one's components'."""
    if output.is_nested:
        return np.concatenate([c.detach().numpy().ravel() for c in output.unbind()])
    return output.detach().to_dense().numpy().ravel()


def worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with joined(rank, world_size, port):
        torch.manual_seed(0)
        model = Net()
        seen: dict[str, np.ndarray] = {}
        for name in LAYERS:
            getattr(model, name).register_forward_hook(
                lambda m, a, out, name=name: seen.__setitem__(name, entries(out))
            )
        inject_observer(
            model,
            output_dir=output_dir,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
        )
        torch.manual_seed(10 + rank)
        model(torch.randn(3 + rank, 4)).sum().backward()  # uneven batches
        remove_observer(model)
        # under torch.func.vmap: the layers' outputs are batched wrappers
        torch.manual_seed(1)
        chain = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        inject_observer(
            chain,
            output_dir=str(Path(output_dir) / "vmap"),
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
            global_statistics=dist.group.WORLD,
        )
        torch.manual_seed(20 + rank)
        batch = torch.randn(2 + rank, 4)
        params = {name: p.detach() for name, p in chain.named_parameters()}
        call = lambda p, x: torch.func.functional_call(chain, p, (x,))  # noqa: E731
        torch.func.vmap(call, in_dims=(None, 0))(params, batch)
        observer = weakref.ref(OBSERVERS[chain])
        remove_observer(chain)
        freed = observer() is None  # by the removal itself, not by a later collection
        plain = chain(batch).detach()  # what the plain model computes
        seen["vmap"] = plain.numpy().ravel()
        gathered: list[object] = [None] * world_size
        names = (*LAYERS, "vmap")
        said = {name: seen[name].tolist() for name in names}
        dist.all_gather_object(gathered, {**said, "freed": freed})
        if rank == 0:
            Path(output_dir, "seen.json").write_text(json.dumps(gathered))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pair of spawned ranks runs `worker` into the returned directory, each rank exiting 0
    (`run_ranks` checks every exit status). Both tests read it."""
    root = tmp_path_factory.mktemp("ranks")
    run_ranks(worker, str(root))
    return root


def test_ranks_that_measured_globally_under_vmap_exit_cleanly(ranks: Path) -> None:
    """Before removal freed the observer's objects, about a third of such pairs of ranks had a
    rank abort (SIGABRT, "terminate called without an active exception") at the interpreter's
    end, after destroy_process_group, when the collector freed them there. The cause is checked
    on every rank, not its symptom's odds: the observer is gone as soon as remove_observer
    returns, while the process group lives; and the pair exited 0 (the fixture)."""
    seen = json.loads((ranks / "seen.json").read_text())
    assert [part["freed"] for part in seen] == [True, True]


def test_sparse_nested_meta_packed_and_vmapped_outputs_keep_their_failures_in_their_own_rows(
    ranks: Path,
) -> None:
    tmp_path = ranks
    seen = json.loads((tmp_path / "seen.json").read_text())
    for rank in range(2):
        directory = tmp_path / f"rank-{rank:03d}"
        history = pl.read_parquet(directory / "history.parquet")
        outputs = history.filter(pl.col("signal") == "output")
        assert outputs.filter(pl.col("unavailable_reason").str.contains("global")).height == 0
        for layer in LAYERS:
            whole = np.concatenate([np.array(part[layer], dtype=np.float32) for part in seen])
            check(global_rows(directory, layer), whole)
        assert outputs.filter(pl.col("layer") == "nested")["shape"].to_list() == [None] * 9
        probe = outputs.filter(pl.col("layer") == "probe")
        assert probe.height == 9
        assert set(probe["unavailable_reason"].to_list()) == {"unsupported device meta"}
        assert probe["population"].null_count() == 9
        packed = outputs.filter(pl.col("layer") == "packed")
        assert packed.height == 9
        assert packed["value"].null_count() == 9
        (reason,) = set(packed["unavailable_reason"].to_list())
        assert reason.startswith("packed dtype float4_e2m1fn_x2: each byte holds two 4-bit floats")
        assert packed["population"].null_count() == 9
        whole = np.concatenate([np.array(part["vmap"], dtype=np.float32) for part in seen])
        vmapped = directory.parent / "vmap" / directory.name
        check(global_rows(vmapped, "1"), whole, 1e-6)
        assert TORCH_FUNC_NOTE in (vmapped / "index.md").read_text(encoding="utf-8")
