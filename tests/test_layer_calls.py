"""Layers that never ran are visible: per-layer counts of sampled forwards, and warnings.

index.md and result.json give, for each selected layer, in how many sampled forwards it was
called (0 included); removal warns once about the layers that never ran; a layer `forward`
replaced during a sampled forward is warned about when it ends. The counts
survive a crash: `finalize` rebuilds them from the history.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_result


class Branchy(nn.Module):
    """`always` runs every forward, `sometimes` when asked, `never` not at all."""

    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Linear(4, 4)
        self.sometimes = nn.ReLU()
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        x = self.always(x)
        return self.sometimes(x) if branch else x


def sampled_forwards(directory: Path) -> dict[str, int]:
    return {entry["layer"]: entry["sampled_forwards"] for entry in read_result(directory)}


def test_counts_in_result_and_index_and_one_warning_at_removal(run_dir: Path) -> None:
    model = Branchy()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # nothing is warned while layers simply have not run yet
        for step in range(6):  # samples at forward_index 0, 2, 4
            model(torch.randn(2, 4), branch=step == 2)
    assert not said, [str(w.message) for w in said]
    with pytest.warns(RuntimeWarning) as caught:
        remove_observer(model)
    never = [str(w.message) for w in caught if "never ran" in str(w.message)]
    assert len(never) == 1
    assert "'never'" in never[0]
    assert "'sometimes'" not in never[0]
    assert sampled_forwards(run_dir) == {"always": 3, "sometimes": 1, "never": 0}
    index = (run_dir / "index.md").read_text("utf-8")
    assert "| `always` | Linear | 3 |" in index
    assert "| `sometimes` | ReLU | 1 |" in index
    assert "| `never` | Linear | 0 |" in index


def test_no_sample_no_never_ran_warning_per_layer(run_dir: Path) -> None:
    model = Branchy()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(10))
    model(torch.randn(2, 4))  # forward_index 0 is sampled: `never` and `sometimes` did not run
    with pytest.warns(RuntimeWarning, match=r"2 of 3 selected layers never ran"):
        remove_observer(model)


def test_forward_replaced_between_forwards_is_still_observed(run_dir: Path) -> None:
    """Layer proxies go on for each sampled forward, on top of whatever `forward` is there."""
    model = Branchy()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 4))
    # Computed from the layer's weight, so its output still requires grad: one that did not
    # would end the layer's gradient rows, which is warned (gradient_gaps.py).
    weight = model.always.weight
    model.always.forward = lambda x: nn.functional.linear(x, weight) * 2  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # nothing of ours was lost: no warning
        model(torch.randn(2, 4))
    assert not said, [str(w.message) for w in said]
    with pytest.warns(RuntimeWarning, match="never ran"):
        remove_observer(model)
    assert sampled_forwards(run_dir)["always"] == 2
    assert "forward" in model.always.__dict__  # the replacement stays


def test_forward_replaced_during_a_sampled_forward_is_warned(run_dir: Path) -> None:
    model = Branchy()

    def replace(x: torch.Tensor) -> torch.Tensor:
        model.always.forward = lambda y: y  # type: ignore[method-assign]
        return x

    model.sometimes.forward = replace  # type: ignore[method-assign]
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match=r"forward of 'always' was replaced during"):
        model(torch.randn(2, 4), branch=True)
    with pytest.warns(RuntimeWarning, match="1 module forward"):
        remove_observer(model)


CHILD = """
import os, sys, time, torch
from pathlib import Path
from torch import nn
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer
import polars as pl
from torchinstruments.rundir.layout import list_parts
model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
inject_observer(model, output_dir=sys.argv[1], sampler=EveryNForwardsSampler(1),
                history_config=HistoryConfig(buffer_rows=1))
for step in range(3):
    model[0](torch.randn(2, 3)) if step == 1 else model(torch.randn(2, 3))
def rows():
    parts = list_parts(Path(sys.argv[1]))
    return pl.scan_parquet(parts, glob=False).select(pl.len()).collect().item() if parts else 0
deadline = time.monotonic() + 60  # the flush thread writes the second forward's rows
while rows() < 2 * 3 * 9 and time.monotonic() < deadline:
    time.sleep(0.005)
os._exit(0)  # no removal, no finalizer: like a crash after the last part was written
"""


def test_counts_are_rebuilt_by_finalize_after_a_crash(run_dir: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    script = textwrap.dedent(CHILD)
    subprocess.run([sys.executable, "-c", script, str(run_dir)], check=True, env=env)
    subprocess.run(
        [sys.executable, "-m", "torchinstruments", "finalize", str(run_dir)], check=True, env=env
    )
    assert sampled_forwards(run_dir) == {"0": 2, "1": 2, "2": 2}
    index = (run_dir / "index.md").read_text("utf-8")
    assert "| `0` | Linear | at least 2 |" in index  # rebuilt: what reached the disk


def test_transformer_run_index_lists_every_layer_with_its_count(run_dir: Path) -> None:
    """A transformer trained then evaluated under no_grad: every inner layer, attention
    included, is listed in index.md with the sampled forwards it ran in (fast path or not)."""
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    x = torch.randn(3, 5, 8)
    for _ in range(2):
        model(x).sum().backward()
    model.eval()
    with torch.no_grad():
        model(x)
    remove_observer(model)
    index = (run_dir / "index.md").read_text("utf-8")
    expected = {name: type(module).__name__ for name, module in model.named_modules()}
    for name in ("layers.0.self_attn", "layers.0.linear1", "layers.1.norm2", "layers.1.dropout"):
        assert f"| `{name}` | {expected[name]} | 3 |" in index, name
    assert "layers.0.self_attn.out_proj" not in index  # a parameter holder, not a layer
    counts = sampled_forwards(run_dir)
    assert counts["layers.0.self_attn"] == counts["layers.1.linear2"] == 3


class Doubler(nn.Module):
    """A layer whose class's `forward` a test replaces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_class_forward_replaced_between_forwards_is_the_one_called_and_observed(
    run_dir: Path,
) -> None:
    """A layer's proxy is kept for the next sampled forward only while it wraps the class's
    current `forward`."""
    model = nn.Sequential(Doubler())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    original = Doubler.forward
    try:
        first = model(torch.ones(2, 4))
        Doubler.forward = lambda self, x: x * 3  # type: ignore[method-assign]
        second = model(torch.ones(2, 4))
    finally:
        Doubler.forward = original  # type: ignore[method-assign]
    remove_observer(model)
    assert first.max() == 2
    assert second.max() == 3
    rows = pl.read_parquet(run_dir / "history.parquet").filter(
        (pl.col("layer") == "0") & (pl.col("metric") == "max")
    )
    assert rows.sort("sample_id")["value"].to_list() == [2.0, 3.0]
