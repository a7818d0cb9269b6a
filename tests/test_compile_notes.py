"""torch.compile: what a compiled run says, in index.md and in warnings.

A compiled model's sampled forwards run eagerly, which index.md's note says, naming the compiled
modules by their eager names and warning about random draws under inductor; an eager run says
nothing of it. A run without a sample, and a torch that cannot keep the root wrapper out of
compiled code, say so at removal and in index.md. So does a torch container compiled before
inject_observer was given the module itself, whose compiled forwards each pay one graph break.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
import torch._dynamo
from torch import nn

import torchinstruments.compilation
from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from _compile_models import (
    WIDTH,
    Net,
    Setup,
    compile_module,
    graphs_and_breaks,
    inputs,
    step,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


class NeverSample:
    """A sampler that declines every root forward."""

    def should_sample(self, forward_index: int) -> bool:
        return False


@pytest.mark.parametrize("calls", [0, 3])
def test_run_without_a_sample_says_so_at_removal_and_in_index(calls: int, tmp_path: Path) -> None:
    model = Net(2)
    run_dir = tmp_path / "stats"
    inject_observer(model, output_dir=run_dir, sampler=NeverSample())
    compiled = torch.compile(model, backend="eager")
    for _ in range(calls):
        step(compiled, torch.randn(4, WIDTH))
    with pytest.warns(RuntimeWarning, match=f"no sample was recorded \\({calls} root forwards"):
        remove_observer(model)
    index = (run_dir / "index.md").read_text("utf-8")
    assert "**No sample was recorded:**" in index
    seen = "the model was never called" if calls == 0 else f"{calls} root forwards were seen"
    assert seen in index
    assert pl.read_parquet(run_dir / "history.parquet").height == 0


def eager_note(run_dir: Path) -> list[str]:
    index = (run_dir / "index.md").read_text("utf-8")
    return [line for line in index.splitlines() if "sampled forwards ran eagerly" in line]


def test_index_says_sampled_forwards_of_a_compiled_model_ran_eagerly(tmp_path: Path) -> None:
    model = Net(2)
    inject_observer(model, output_dir=tmp_path / "compiled", sampler=EveryNForwardsSampler(2))
    compiled = torch.compile(model, backend="eager")
    for x in inputs(Setup("compile_model_after_inject", "eager")):
        step(compiled, x)
    remove_observer(model)
    (note,) = eager_note(tmp_path / "compiled")
    assert "(3 of the 3 samples were called through compiled code)" in note
    assert "eager numerics, which can differ from the compiled ones in the last bits" in note
    assert "unsampled forwards ran the compiled code" in note


def test_index_names_compiled_blocks_that_ran_eagerly_in_sampled_forwards(tmp_path: Path) -> None:
    model = Net(2)
    inject_observer(model, output_dir=tmp_path / "blocks", sampler=EveryNForwardsSampler(2))
    for block in model.blocks:
        block.compile(backend="eager")
    for x in inputs(Setup("block_compile_after_inject", "eager")):
        step(model, x)
    remove_observer(model)
    (note,) = eager_note(tmp_path / "blocks")
    assert "(compiled modules: 'blocks.0', 'blocks.1')" in note


def test_index_names_compiled_modules_by_their_eager_names(tmp_path: Path) -> None:
    """Inside an observed OptimizedModule, compiled blocks are named as the layers are, without
    `_orig_mod.`, and a block compiled twice over (a wrapper around a module.compile()'d one)
    once."""
    model = Net(2)
    for block in model.blocks:
        block.compile(backend="eager")
    model.blocks[1] = compile_module(model.blocks[1], backend="eager")
    compiled = compile_module(model, backend="eager")
    inject_observer(compiled, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    for x in inputs(Setup("inject_on_optimized_module", "eager")):
        step(compiled, x)
    remove_observer(compiled)
    (note,) = eager_note(tmp_path / "stats")
    assert "(compiled modules: the root, 'blocks.0', 'blocks.1')" in note


@pytest.mark.parametrize(("where", "named"), [("", "the root"), ("blocks.0", "'blocks.0'")])
def test_index_names_a_module_whose_forward_was_compiled_in_place(
    where: str, named: str, tmp_path: Path
) -> None:
    """`module.forward = torch.compile(module.forward)` before inject_observer (Hugging Face's
    docs do it for generation): the sampled forwards run it eagerly, which index.md must say."""
    model = Net(2)
    module = model.get_submodule(where)
    module.forward = torch.compile(module.forward, backend="eager")
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    for x in inputs(Setup("forward_compile_before_inject", "eager")):
        step(model, x)
    remove_observer(model)
    (note,) = eager_note(tmp_path / "stats")
    assert f"(compiled modules: {named})" in note
    assert graphs_and_breaks() == (1, 0)  # the unsampled forwards ran the compiled forward


def test_index_says_random_draws_of_an_inductor_model_differ_after_an_eager_sample(
    tmp_path: Path,
) -> None:
    """Dropout under inductor: a sampled step runs eagerly and draws its random numbers as
    eager dropout does, not as inductor's kernels do, so the unsampled steps after it continue
    another random number stream and are not the plain compiled model's. index.md must say so,
    not only that eager numerics differ "in the last bits"."""
    base = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Dropout(0.5), nn.Linear(2 * WIDTH, 2))
    batches = inputs(Setup("compile_model_after_inject", "inductor"))

    def run(observe: Path | None) -> list[torch.Tensor]:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if observe is not None:
            inject_observer(model, output_dir=observe, sampler=EveryNForwardsSampler(2))
        compiled = compile_module(model, backend="inductor")
        torch.manual_seed(5)
        outputs = [step(compiled, x) for x in batches[:2]]
        if observe is not None:
            remove_observer(model)
        return outputs

    plain, observed = run(None), run(tmp_path / "stats")
    assert not torch.equal(observed[1], plain[1])  # an unsampled step, after a sampled one
    (note,) = eager_note(tmp_path / "stats")
    assert "random number stream" in note
    assert "dropout masks" in note


def test_an_eager_run_says_nothing_about_eager_samples(tmp_path: Path) -> None:
    model = Net(2)
    inject_observer(model, output_dir=tmp_path / "eager", sampler=EveryNForwardsSampler(2))
    for x in inputs(Setup("eager", "eager")):
        step(model, x)
    remove_observer(model)
    assert eager_note(tmp_path / "eager") == []


def test_a_torch_that_cannot_exclude_the_root_wrapper_says_compiled_forwards_are_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch lacks the per-frame exclusion (compile_support() False), dynamo would trace
    the root wrapper as a traced call, which passes through uncounted: inject_observer warns
    and index.md says that forwards run under torch.compile are not recorded."""
    monkeypatch.setattr(torchinstruments.compilation, "compile_support", lambda: False)
    model = Net(1)
    with pytest.warns(RuntimeWarning, match="not recorded: forwards run under torch.compile"):
        inject_observer(model, output_dir=tmp_path / "stats")
    step(model, torch.randn(4, WIDTH))
    remove_observer(model)
    index = (tmp_path / "stats" / "index.md").read_text("utf-8")
    assert "**Note:** not recorded: forwards run under torch.compile" in index
    assert "neither counted nor sampled" in index


def test_a_torch_container_compiled_before_inject_says_its_extra_graph_break_once(
    tmp_path: Path,
) -> None:
    """`compiled = torch.compile(seq); inject_observer(seq)`: nn.Sequential.forward lives in
    torch, so the compiled wrapper traces `seq(...)` from the top and meets the root proxy, one
    graph break per compiled forward. Nothing on `seq` shows it at inject; the first compiled
    call does, and the run says it once (a warning naming the fix, and index.md)."""
    setup = Setup("inject_on_orig_mod", "eager", sequential=True)
    model = setup.model()
    compiled = compile_module(model, backend="eager")
    inject_observer(model, output_dir=tmp_path / "stats", sampler=EveryNForwardsSampler(2))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for x in inputs(setup)[:4]:
            step(compiled, x)
    ours = [str(w.message) for w in said if str(w.message).startswith("torchinstruments")]
    assert len(ours) == 1, ours
    assert "torch.compile ran on this Sequential before inject_observer" in ours[0]
    assert "one extra graph break" in ours[0]
    assert "call inject_observer before torch.compile" in ours[0]
    assert graphs_and_breaks() == (1, 1)  # the break the warning names, once per compiled code
    remove_observer(model)
    index = (tmp_path / "stats" / "index.md").read_text("utf-8")
    assert "**Note:** torch.compile ran on this Sequential before inject_observer" in index
    assert pl.read_parquet(tmp_path / "stats" / "history.parquet")[
        "forward_index"
    ].unique().sort().to_list() == [0, 2]
