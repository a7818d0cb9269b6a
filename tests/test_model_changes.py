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
import pytest
import torch
import torch.fx
import torch.nn.utils.prune
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, model_changes, remove_observer

from hook_reference import HookRecorder, assert_conforms
from reference_values import default_layer_names

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
    compiled: bool = False,
    twin: nn.Module | None = None,
) -> Changed:
    """Observe `model` for `steps` training steps, calling `change` on it before step `at`, and
    run a deep copy with plain hooks changed alike (`change_copy=False`: a change of a class
    both share, made once; `compiled`: the observed steps call `torch.compile(model)`, made
    after inject; `twin`: the unobserved copy, built apart where a deep copy would share
    something with `model`). Removal must leave every module's forward and class as the
    changed model has them without an observer."""
    reference_model = copy.deepcopy(model) if twin is None else twin
    recorder = HookRecorder(reference_model, default_layer_names(reference_model))
    observed, reference = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        directory = inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
        assert directory is not None
        stepped = torch.compile(model, backend="eager") if compiled else model
        for i in range(steps):
            if i == at:
                change(model)
                if change_copy:
                    change(reference_model)
            for side, outputs in ((stepped, observed), (reference_model, reference)):
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


def drop_relu_and_double(graph_module: nn.Module) -> None:
    """Edit a traced `Net`'s graph (no ReLU, the result doubled) and recompile it."""
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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-after-inject"])
def test_a_graph_module_recompiled_after_inject_runs_its_new_graph_and_rows_follow_it(
    run_dir: Path, compiled: bool
) -> None:
    traced = torch.fx.symbolic_trace(Net())
    run = run_changed(traced, drop_relu_and_double, run_dir, compiled=compiled)
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


class LoRA(nn.Module):
    """A Linear wrapped with a low-rank update, as LoRA fine-tuning wraps one."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, 2, bias=False)
        self.up = nn.Linear(2, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def the_note(run: Changed) -> str:
    """The run's one note on modules changed after inject, also warned at removal."""
    found = [note for note in run.notes if "modules changed after inject_observer" in note]
    assert len(found) == 1, run.notes
    # the warning names each module as warnings do (repr), index.md as its Layers section does
    assert any(found[0].replace("`", "'") in w for w in run.warnings), run.warnings
    assert found[0] in run.index
    return found[0]


def test_a_head_swapped_after_inject_is_named_as_unobserved_and_the_old_one_as_gone(
    run_dir: Path,
) -> None:
    def swap_head(model: nn.Module) -> None:
        torch.manual_seed(7)
        model.fc2 = nn.Linear(8, 3)

    run = run_changed(Net(), swap_head, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)  # hooks, too, stay with the old head
    note = the_note(run)
    assert "taken out of the model (no rows once they stopped running): `fc2` (Linear)" in note
    assert "not observed (no rows): `fc2` (Linear)" in note


def test_layers_wrapped_lora_style_after_inject_keep_their_names_and_the_adapters_are_named(
    run_dir: Path,
) -> None:
    def wrap(model: nn.Module) -> None:
        torch.manual_seed(7)
        model.fc1 = LoRA(model.fc1)  # type: ignore[arg-type]
        model.fc2 = LoRA(model.fc2)  # type: ignore[arg-type]

    run = run_changed(Net(), wrap, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    assert set(run.history.filter(pl.col("sample_id") == 3)["layer"]) == {"fc1", "act", "fc2"}
    note = the_note(run)
    assert "`fc1` (Linear) now at `fc1.base`, `fc2` (Linear) now at `fc2.base`" in note
    assert "`fc1.down` (Linear), `fc1.up` (Linear), `fc2.down` (Linear)" in note
    assert "taken out" not in note


def test_modules_appended_added_or_deleted_after_inject_are_named(run_dir: Path) -> None:
    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])
            self.drop = nn.Dropout(0.2)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            if hasattr(self, "drop"):
                x = self.drop(x)
            if hasattr(self, "extra"):
                x = self.get_submodule("extra")(x)
            return self.head(x)

    def grow(model: nn.Module) -> None:
        torch.manual_seed(7)
        model.blocks.append(nn.Linear(4, 4))  # type: ignore[union-attr, operator]
        model.add_module("extra", nn.Tanh())
        del model.drop

    run = run_changed(Blocks(), grow, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    note = the_note(run)
    assert "taken out of the model (no rows once they stopped running): `drop` (Dropout)" in note
    assert "not observed (no rows): `blocks.1` (Linear), `extra` (Tanh)" in note


class Blocked(nn.Module):
    """A container of selected layers (`block`) and a selected leaf (`head`)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def layers_at(history: pl.DataFrame, sample_id: int) -> set[str]:
    return set(history.filter(pl.col("sample_id") == sample_id)["layer"])


def test_a_container_of_layers_replaced_by_a_leaf_is_named_and_the_leaf_gets_no_rows(
    run_dir: Path,
) -> None:
    def collapse(model: nn.Module) -> None:
        torch.manual_seed(7)
        model.block = nn.Linear(4, 8)

    run = run_changed(Blocked(), collapse, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)  # hooks, too, stay on the old block's layers
    assert layers_at(run.history, 1) == {"block.0", "block.1", "head"}
    assert layers_at(run.history, 2) == {"head"}  # the new `block` is not observed
    note = the_note(run)
    assert "`block` (Sequential, which held selected layers) is now a Linear (a leaf)" in note
    assert (
        "taken out of the model (no rows once they stopped running): `block.0` (Linear), " in note
    )
    assert "not observed (no rows): `block` (Linear)" in note


def test_a_leaf_replaced_by_a_container_is_named_and_its_children_get_no_rows(
    run_dir: Path,
) -> None:
    def expand(model: nn.Module) -> None:
        torch.manual_seed(7)
        model.head = nn.Sequential(nn.Linear(8, 3), nn.Tanh())

    run = run_changed(Blocked(), expand, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    assert layers_at(run.history, 2) == {"block.0", "block.1"}
    note = the_note(run)
    assert "`head` (Linear, a selected layer) is now a Sequential (a container)" in note
    assert "taken out of the model (no rows once they stopped running): `head` (Linear)" in note
    assert "not observed (no rows): `head.0` (Linear), `head.1` (Tanh)" in note


def test_a_layer_also_assigned_at_another_name_is_named_there_not_as_moved(
    run_dir: Path,
) -> None:
    """`model.block = model.head`-like sharing: the layer is still at its own name, and its
    calls from the new one are more calls of the same layer (call_index 1)."""

    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            self.head = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(x))

    def share(model: nn.Module) -> None:
        model.block = model.head

    run = run_changed(Square(), share, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    head = run.history.filter(pl.col("layer") == "head", pl.col("sample_id") == 3)
    assert sorted(head["call_index"].unique()) == [0, 1]
    note = the_note(run)
    assert "now also held at another name" in note
    assert "`head` (Linear) also at `block`" in note
    assert "`block` (Sequential, which held selected layers) is now a Linear (a leaf)" in note
    assert "moved" not in note


def test_a_layer_shared_since_inject_and_left_so_has_no_changes_note(run_dir: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.Tanh()
            self.fc = nn.Linear(4, 4)
            self.blocks = nn.ModuleList([nn.Sequential(self.fc, self.act)] * 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    run = run_changed(Tied(), lambda model: None, run_dir)
    assert_conforms(run.history, run.recorder)
    assert not [note for note in run.notes if "modules changed" in note]
    assert not [w for w in run.warnings if "modules changed" in w]


def test_a_model_left_as_it_was_has_no_changes_note(run_dir: Path) -> None:
    run = run_changed(Net(), lambda model: None, run_dir)
    assert not [note for note in run.notes if "modules changed" in note]
    assert not [w for w in run.warnings if "modules changed" in w]


def test_weight_norm_and_pruning_after_inject_keep_every_layer_observed_and_restore_exactly(
    run_dir: Path,
) -> None:
    """`parametrize` gives the module a generated subclass and pruning adds a forward pre-hook
    and a computed `weight`: the module objects stay, so they stay observed, with no note."""

    def reparametrize(model: nn.Module) -> None:
        torch.nn.utils.parametrizations.weight_norm(model.fc1)  # type: ignore[arg-type]
        torch.nn.utils.prune.l1_unstructured(model.fc2, "weight", amount=0.5)  # type: ignore[arg-type]

    run = run_changed(Net(), reparametrize, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    assert not [note for note in run.notes if "modules changed" in note]
    assert set(run.history.filter(pl.col("sample_id") == 3)["layer"]) == {"fc1", "act", "fc2"}


def test_layers_parametrized_before_inject_stay_observed_when_a_parametrization_is_removed(
    run_dir: Path,
) -> None:
    def parametrized() -> Net:
        torch.manual_seed(3)
        model = Net()
        torch.nn.utils.parametrizations.weight_norm(model.fc1)  # type: ignore[arg-type]
        torch.nn.utils.parametrizations.spectral_norm(model.fc2)  # type: ignore[arg-type]
        return model

    def unparametrize(model: nn.Module) -> None:
        torch.nn.utils.parametrize.remove_parametrizations(model.fc1, "weight")  # type: ignore[arg-type]

    # A deep copy of a parametrized module shares its generated class, whose `weight` property
    # the removal deletes: the twin is built apart.
    model = parametrized()
    run = run_changed(model, unparametrize, run_dir, twin=parametrized())
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    assert type(model.fc1) is nn.Linear
    assert not [note for note in run.notes if "modules changed" in note], run.notes
    assert set(run.history.filter(pl.col("sample_id") == 3)["layer"]) == {"fc1", "act", "fc2"}


def test_a_root_parametrized_after_inject_then_unparametrized_gets_its_own_class_back(
    run_dir: Path,
) -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x @ self.weight)

    class Symmetric(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight.triu() + weight.triu(1).transpose(-1, -2)

    def parametrize_root(model: nn.Module) -> None:
        torch.nn.utils.parametrize.register_parametrization(model, "weight", Symmetric())

    model = Root()
    run = run_changed(model, parametrize_root, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    assert type(model).__name__ == "ParametrizedRoot"
    assert "forward" not in vars(model)
    torch.nn.utils.parametrize.remove_parametrizations(model, "weight")
    assert type(model) is Root
    assert "forward" not in vars(model)


def test_modules_fused_after_inject_are_named_as_moved_taken_out_and_added(run_dir: Path) -> None:
    class ConvNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 6, 1)
            self.bn = nn.BatchNorm2d(6)
            self.relu = nn.ReLU()
            self.fc = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.relu(self.bn(self.conv(x[:, :, None, None])))[:, :, 0, 0])

    def fuse(model: nn.Module) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization's
            torch.ao.quantization.fuse_modules(model, [["conv", "bn", "relu"]], inplace=True)

    run = run_changed(ConvNet().eval(), fuse, run_dir)
    assert_same_outputs(run)
    # fuse_modules moves the old modules' hooks onto the fused one, so plain hooks are the
    # reference up to the fusion only; after it the old ReLU (inside the fused module) and fc run.
    run.recorder.tensors = {k: v for k, v in run.recorder.tensors.items() if k[0] < 2}
    assert_conforms(run.history.filter(pl.col("sample_id") < 2), run.recorder)
    assert set(run.history.filter(pl.col("sample_id") == 3)["layer"]) == {"relu", "fc"}
    note = the_note(run)
    assert "taken out of the model (no rows once they stopped running): `conv` (Conv2d), " in note
    assert "`relu` (ReLU) now at `conv.1`" in note
    assert "not observed (no rows): `conv.0` (Conv2d), `bn` (Identity), `relu` (Identity)" in note


def gradient_samples(history: pl.DataFrame, layer: str) -> list[int]:
    """The samples with output_gradient rows of `layer`."""
    rows = history.filter((pl.col("layer") == layer) & (pl.col("signal") == "output_gradient"))
    return sorted(rows["sample_id"].unique())


def test_a_part_frozen_mid_run_says_why_its_gradient_rows_stop(run_dir: Path) -> None:
    def freeze_first_layer(model: nn.Module) -> None:
        model.fc1.requires_grad_(False)  # the input needs no grad: fc1 and act get none now

    run = run_changed(Net(), freeze_first_layer, run_dir)
    assert_same_outputs(run)
    assert_conforms(run.history, run.recorder)
    assert gradient_samples(run.history, "fc1") == gradient_samples(run.history, "act") == [0, 1]
    assert gradient_samples(run.history, "fc2") == [0, 1, 2, 3]
    found = [note for note in run.notes if "required no grad in some" in note]
    assert len(found) == 1, run.notes
    assert found[0] in run.index
    assert "`fc1` (2 samples, from 2 to 3), `act` (2 samples, from 2 to 3)" in found[0]
    assert "fc2" not in found[0]
    assert any("requires no grad where its series required grad" in w for w in run.warnings)


def test_a_part_unfrozen_mid_run_says_why_its_first_samples_have_no_gradient_rows(
    run_dir: Path,
) -> None:
    model = Net()
    model.fc1.requires_grad_(False)

    def unfreeze(model: nn.Module) -> None:
        model.fc1.requires_grad_(True)

    run = run_changed(model, unfreeze, run_dir, steps=5, at=3)
    assert_conforms(run.history, run.recorder)
    assert gradient_samples(run.history, "fc1") == [3, 4]
    found = [note for note in run.notes if "required no grad in some" in note]
    assert len(found) == 1, run.notes
    assert "`fc1` (3 samples, from 0 to 2), `act` (3 samples, from 0 to 2)" in found[0]
    assert not [note for note in run.notes if "never returned an output" in note]


def test_a_detached_output_beside_one_with_grad_is_no_change_of_the_model(run_dir: Path) -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x.detach() + 1

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.pair = Pair()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            doubled, shifted = self.pair(self.fc(x))
            return doubled + shifted

    run = run_changed(Model(), lambda model: None, run_dir)
    assert_conforms(run.history, run.recorder)
    assert not [note for note in run.notes if "no grad" in note], run.notes
    assert not [w for w in run.warnings if "no grad" in w], run.warnings


def test_freezing_one_branch_names_only_the_calls_of_a_shared_layer_that_lost_gradients(
    run_dir: Path,
) -> None:
    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left = nn.Linear(4, 3)
            self.right = nn.Linear(4, 3)
            self.act = nn.Tanh()  # called once per branch: calls 0 and 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.left(x)) + self.act(self.right(x))

    def freeze_left(model: nn.Module) -> None:
        model.left.requires_grad_(False)

    run = run_changed(Branches(), freeze_left, run_dir)
    assert_conforms(run.history, run.recorder)
    found = [note for note in run.notes if "required no grad in some" in note]
    assert len(found) == 1, run.notes
    assert found[0].endswith(
        "the samples without grad, first to last): `left` (2 samples, from 2 to 3), "
        "`act` (2 samples, from 2 to 3)."
    )
    assert "call 1" not in found[0]


def test_a_failure_comparing_the_model_at_removal_is_said_and_the_run_still_ends(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unwalkable(model: nn.Module, **options: object) -> None:
        raise RuntimeError("a module that cannot be walked")

    def break_the_walk(model: nn.Module) -> None:
        monkeypatch.setattr(model_changes, "named_modules_uncompiled", unwalkable)

    run = run_changed(Net(), break_the_walk, run_dir, change_copy=False)
    assert_conforms(run.history, run.recorder)
    found = [note for note in run.notes if "comparing the model with the modules" in note]
    assert len(found) == 1, run.notes
    assert "a module that cannot be walked" in found[0]
    assert "**State: complete.**" in run.index


class Doubling:
    """A callable object that is not a descriptor: a class `forward` that gets no `self`."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_root_whose_class_forward_is_a_callable_object_runs_it_then_its_replacement(
    run_dir: Path,
) -> None:
    class Model(nn.Module):
        forward = Doubling()

    model = Model()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    x = torch.randn(2, 3)
    assert torch.equal(model(x), x * 2)
    Model.forward = lambda self, x: x * 3  # type: ignore[assignment]
    assert torch.equal(model(x), x * 3)
    remove_observer(model)
    assert "forward" not in model.__dict__
    assert torch.equal(model(x), x * 3)
