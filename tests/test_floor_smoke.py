"""The smoke subset: inject, sampled train steps, compile, remove, finalize, against plain hooks.

Part of the suite, and also what `.ci/run` runs on the oldest torch pyproject allows, in an
environment of its own (`.ci/floor`): it needs only torch, polars, numpy and the library.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import mlp, read_history, run_cli
from hook_reference import HookRecorder, assert_profiles_match, observed_profiles

LAYERS = tuple(str(index) for index in range(6))  # mlp(): three Linear + ReLU blocks


def train_steps(model: nn.Module, parameters: nn.Module, steps: int) -> list[torch.Tensor]:
    """`steps` SGD steps on fixed batches; returns each step's output."""
    optimizer = torch.optim.SGD(parameters.parameters(), lr=0.1)
    outputs = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        out = model(x)
        out.square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(out.detach())
    return outputs


def check_against_hooks(model: nn.Module, observed: nn.Module, run_dir: Path) -> None:
    """Steps 0 and 2 of four are sampled; their rows equal hooks on a deep copy at those steps."""
    reference = copy.deepcopy(model)
    recorder = HookRecorder(reference, LAYERS)
    inject_observer(observed, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    outputs = train_steps(observed, model, 4)
    remove_observer(observed)

    history = read_history(run_dir)
    assert sorted(history["forward_index"].unique().to_list()) == [0, 2]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        recorder.reset()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        out = reference(x)
        out.square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.allclose(out.detach(), outputs[step])
        if step % 2 == 0:
            assert_profiles_match(observed_profiles(history, step // 2), recorder.profiles)


def test_sampled_train_steps_match_plain_hooks(run_dir: Path) -> None:
    model = mlp()
    check_against_hooks(model, model, run_dir)
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_a_compiled_model_records_what_hooks_see(run_dir: Path) -> None:
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    check_against_hooks(model, compiled, run_dir)
    index = (run_dir / "index.md").read_text("utf-8")
    assert "not recorded: forwards run under torch.compile" not in index


def test_a_run_whose_process_died_is_finalized(tmp_path: Path) -> None:
    run_dir = tmp_path / "died"
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from conftest import mlp
        from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer

        model = mlp()
        inject_observer(model, output_dir={str(run_dir)!r}, sampler=EveryNForwardsSampler(1),
                        history_config=HistoryConfig(buffer_rows=1))
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        os._exit(0)  # no remove_observer, no exit handler: as if killed
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert not (run_dir / "history.parquet").exists()
    done = run_cli("finalize", run_dir)
    assert done.returncode == 0, done.stderr
    history = pl.read_parquet(run_dir / "history.parquet")
    assert set(history["layer"]) == set(LAYERS)
    assert set(history["sample_id"]) == {0, 1, 2}
