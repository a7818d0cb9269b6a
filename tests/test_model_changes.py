"""The model changes under the observer after inject_observer, as training code changes it.

Each case changes an observed model between steps (a torch.fx graph recompiled, a class's
`forward` replaced, a head swapped, Linear layers wrapped LoRA-style, a part frozen) and the same
change is made at the same step to a deep copy with plain hooks registered when the run started
(`hook_reference.HookRecorder`): the model computes what the copy computes, every row equals the
reference both ways, what the run did not record is warned about and stated in index.md, and
`remove_observer` restores every module's `forward` and class exactly.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch
import torch.fx
import torch.nn.utils.prune
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from hook_reference import HookRecorder, assert_conforms, default_layer_names

Change = Callable[[nn.Module], None]


class Net(nn.Module):
    """Two Linear layers and a ReLU: the smallest model with a head to swap."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@dataclass
class Changed:
    """What one run of a model changed at a step saw, beside its plain-hooks twin."""

    history: pl.DataFrame
    recorder: HookRecorder
    notes: list[str]
    index: str
    warnings: list[str]
    observed: list[torch.Tensor]
    reference: list[torch.Tensor]


def forwards_and_classes(model: nn.Module) -> dict[str, tuple[object, type]]:
    """Each module's instance `forward` (None: it has none) and class, by name."""
    return {name: (vars(m).get("forward"), type(m)) for name, m in model.named_modules()}


def run_changed(
    model: nn.Module,
    change: Change,
    run_dir: Path,
    *,
    steps: int = 4,
    at: int = 2,
    change_copy: bool = True,
) -> Changed:
    """Observe `model` for `steps` training steps, calling `change` on it before step `at`, and
    run a deep copy with plain hooks changed alike (`change_copy=False`: a change of a class
    both share, made once). Removal must leave every module's forward and class as the changed
    model has them without an observer."""
    reference_model = copy.deepcopy(model)
    recorder = HookRecorder(reference_model, default_layer_names(reference_model))
    observed, reference = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        directory = inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
        assert directory is not None
        for i in range(steps):
            if i == at:
                change(model)
                if change_copy:
                    change(reference_model)
            for side, outputs in ((model, observed), (reference_model, reference)):
                torch.manual_seed(1000 + i)
                out = side(torch.randn(5, 4))
                out.square().sum().backward()
                outputs.append(out.detach())
        unobserved = {name: (None, cls) for name, (_, cls) in forwards_and_classes(model).items()}
        remove_observer(model)
    assert forwards_and_classes(model) == unobserved
    state = json.loads((directory / ".state.json").read_text("utf-8"))
    return Changed(
        pl.read_parquet(directory / "history.parquet"),
        recorder,
        state["counts"]["notes"],
        (directory / "index.md").read_text("utf-8"),
        [str(w.message) for w in caught if "torchinstruments" in str(w.message)],
        observed,
        reference,
    )


def assert_same_outputs(run: Changed) -> None:
    """The observed model computed exactly what its unobserved copy computed, step by step."""
    for step, (got, want) in enumerate(zip(run.observed, run.reference, strict=True)):
        assert torch.equal(got, want), f"step {step}"


def test_a_graph_module_recompiled_after_inject_runs_its_new_graph_and_rows_follow_it(
    run_dir: Path,
) -> None:
    def drop_relu_and_double(graph_module: nn.Module) -> None:
        assert isinstance(graph_module, torch.fx.GraphModule)
        graph = graph_module.graph
        for node in list(graph.nodes):
            if node.op == "call_module" and node.target == "act":
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        output = next(node for node in graph.nodes if node.op == "output")
        with graph.inserting_before(output):
            doubled = graph.call_function(torch.mul, (output.args[0], 2.0))
        output.args = (doubled,)
        graph_module.recompile()

    run = run_changed(torch.fx.symbolic_trace(Net()), drop_relu_and_double, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    acts = run.history.filter(pl.col("layer") == "act")["sample_id"].unique().sort().to_list()
    assert acts == [0, 1]  # the recompiled graph calls `act` no more


def test_a_class_forward_replaced_after_inject_is_what_the_root_runs(run_dir: Path) -> None:
    class Model(Net):
        pass

    def skip_relu(model: nn.Module) -> None:
        def forward(self: Model, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.fc1(x)) * 3

        type(model).forward = forward  # type: ignore[method-assign]

    run = run_changed(Model(), skip_relu, run_dir, change_copy=False)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    assert sorted(run.history.filter(pl.col("layer") == "act")["sample_id"].unique()) == [0, 1]
