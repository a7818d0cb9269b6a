"""The default selection's rule for modules that hand their children's weights to a kernel.

A module whose methods read what a child holds (`self.proj.weight`, a dropout's `self.drop.p`)
and never call the child computes with it itself: it is the layer, and the child (which never
runs) is not. A child that is called anywhere, or used in any other way, keeps the leaf rule,
except a tensor-free child (a dropout) whose settings `forward` reads without calling it: a
helper on another path may call it (GPT-2's attention), but `forward` hands its rate to the
kernel. Real cases (`nn.MultiheadAttention`, torchvision's Swin, Hugging Face's Mamba and BERT
attention) are in the conformance zoo.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.nn import functional

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.selection import default_layers

from conftest import read_history
from hook_reference import run_both


class PassesWeights(nn.Module):
    """`proj`'s weights go to `functional.linear`; `act` is called."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.Tanh()
        nn.init.zeros_(self.proj.bias)  # a read in __init__ is not a use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(functional.linear(x, self.proj.weight, self.proj.bias))


class PassesADropoutRate(nn.Module):
    """`drop`'s rate goes to `functional.dropout`, as SDPA takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.dropout(x, p=self.drop.p if self.training else 0.0)


class PassesBiasFreeWeights(nn.Module):
    """`proj`'s weight and its bias slot (registered as None) go to `functional.linear`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, self.proj.weight, self.proj.bias)


class CallsTheChildToo(nn.Module):
    """Reads `proj.weight` for its dtype, and calls `proj`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class CallsTheDropoutOnAnotherPath(nn.Module):
    """`forward` passes `drop`'s rate to a kernel; a helper off by default calls `drop` (as
    GPT-2's attention does in its upcast-and-reorder path)."""

    def __init__(self, reorder: bool = False) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.reorder = reorder

    def _reordered(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reorder:
            return self._reordered(x)
        return functional.dropout(x, p=self.drop.p if self.training else 0.0)


class ReadsASizeAndCallsTheChildInAHelper(nn.Module):
    """`forward` reads `proj.in_features` and calls `proj` through a helper: `proj` holds
    weights and runs, so it stays a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x.reshape(-1, self.proj.in_features))


def traced(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


class CallsInADecoratedForward(nn.Module):
    """Calls `proj` in a decorated forward, reads its weight in another method."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    @traced
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale()

    def scale(self) -> torch.Tensor:
        return self.proj.weight.norm()


class HandsTheChildOut(nn.Module):
    """Passes `proj.weight` to a kernel, and hands `proj` itself out through a property."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    @property
    def output_layer(self) -> nn.Module:
        return self.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, self.proj.weight)


class CallsTheChildsForward(nn.Module):
    """Reads `proj.weight`, and runs `proj` through its `forward` (not `__call__`)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj.forward(x) * self.proj.weight.sum()


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (PassesWeights, {"block", "block.act"}),
        (PassesADropoutRate, {"block"}),
        (PassesBiasFreeWeights, {"block"}),
        (CallsTheChildToo, {"block.proj"}),
        (CallsInADecoratedForward, {"block.proj"}),
        (HandsTheChildOut, {"block.proj"}),
        (CallsTheChildsForward, {"block.proj"}),
        (CallsTheDropoutOnAnotherPath, {"block"}),
        (ReadsASizeAndCallsTheChildInAHelper, {"block.proj"}),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else "",
)
def test_a_child_used_only_through_its_parameters_is_not_a_layer_its_user_is(
    block: type[nn.Module], expected: set[str]
) -> None:
    model = nn.Sequential()
    model.add_module("block", block())
    model.add_module("head", nn.Linear(4, 2))
    assert default_layers(model) == expected | {"head"}


class Features(nn.Module):
    """A backbone whose parent runs it through a method of its own, as `forward_features`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class CallsAMethodOfTheChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = Features(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.forward_features(x))


def test_quantized_modules_are_layers_and_the_holders_of_their_packed_weights_are_not() -> None:
    """torch's quantized Linear and Embedding read their `_packed_params` child's packed object
    through its methods, never calling it; a child's methods count so only where it holds
    packed weights (a parent calling a backbone's `forward_features` keeps the leaf rule)."""
    quantized = torch.ao.nn.quantized
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notes
        model = nn.Sequential(
            quantized.Linear(4, 4),
            quantized.dynamic.Linear(4, 4),
            quantized.Embedding(8, 4),
            quantized.EmbeddingBag(8, 4),
        )
    assert default_layers(model) == {"0", "1", "2", "3"}
    assert default_layers(CallsAMethodOfTheChild()) == {"backbone.proj", "head"}


def test_a_class_without_source_keeps_the_leaf_rule() -> None:
    namespace: dict[str, Any] = {"nn": nn, "functional": functional}
    exec(  # a class whose source inspect cannot find
        "class Generated(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return functional.linear(x, self.proj.weight)\n",
        namespace,
    )
    assert default_layers(namespace["Generated"]()) == {"proj"}


class Loops:
    """A callable whose `__wrapped__` is itself: `inspect.unwrap` refuses it."""

    def __call__(self, *args: Any) -> None:
        return None


def test_a_class_that_cannot_be_read_keeps_the_leaf_rule() -> None:
    looping = Loops()
    looping.__wrapped__ = looping  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {"nn": nn, "functional": functional, "looping": looping}
    exec(  # a class whose member cannot be unwrapped, around a child it only reads
        "class Unreadable(nn.Module):\n"
        "    member = looping\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = nn.Linear(2, 2)\n"
        "    def forward(self, x):\n"
        "        return functional.linear(x, self.proj.weight)\n",
        namespace,
    )
    assert default_layers(namespace["Unreadable"]()) == {"proj"}


def test_the_module_that_passes_weights_is_measured_and_its_child_has_no_rows(
    run_dir: Path,
) -> None:
    model = nn.Sequential(PassesWeights(), nn.Linear(4, 2))
    outputs: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda module, args, output: outputs.append(output.detach()))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    history = read_history(run_dir)
    assert set(history["layer"]) == {"0", "0.act", "1"}
    mean = history.filter(layer="0", signal="output", metric="mean")["value"].item()
    assert mean == pytest.approx(outputs[0].double().mean().item(), rel=1e-12)


class TiedHead(nn.Module):
    """An output projection tied to an embedding: it holds the embedding module for its weight
    and never calls it."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, self.embedding.weight)


class HeadFirst(nn.Module):
    """The tied head registered before the embedding it holds, which the model calls under its
    other name: `named_modules()` names the embedding after the head (`head.embedding`)."""

    def __init__(self) -> None:
        super().__init__()
        embedding = nn.Embedding(20, 4)
        self.head = TiedHead(embedding)
        self.embed = embedding
        self.mix = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


class ReadsItsDtype(nn.Module):
    """An encoder that reads its embedding's weight (for a dtype) and never calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 4)
        self.mix = nn.Linear(4, 4)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x.to(self.dtype))


class CallsTheEmbeddingOfItsEncoder(nn.Module):
    """The model embeds the ids itself, through its encoder's embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = ReadsItsDtype()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.encoder.embed(ids))


@pytest.mark.parametrize(
    ("model", "layers"),
    [
        (HeadFirst, ["head", "head.embedding", "mix"]),  # the head computes with its weight
        (CallsTheEmbeddingOfItsEncoder, ["encoder", "encoder.embed", "encoder.mix"]),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else "",
)
def test_a_held_child_that_another_module_calls_is_a_layer(
    run_dir: Path, one_thread: None, model: type[nn.Module], layers: list[str]
) -> None:
    def step(observed: nn.Module, i: int) -> torch.Tensor:
        out = observed(torch.randint(0, 20, (2, 5)))
        out.square().sum().backward()
        return out.detach()

    assert default_layers(model()) == set(layers)
    run_both(model(), step, run_dir, steps=2, names=layers).assert_conforms()


class Doubles(nn.Sequential):
    """A Sequential subclass with a forward of its own: it computes, children or not."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # Sequential's parameter name
        return 2 * input


def test_modules_that_compute_nothing_are_not_layers() -> None:
    holder = nn.Module()
    holder.register_parameter("scale", nn.Parameter(torch.ones(1)))
    given = nn.Module()
    given.forward = lambda x: x + 1  # a forward of its own, set on the instance
    model = nn.Sequential()
    for name, module in {
        "shortcut": nn.Sequential(),  # returns its input
        "blocks": nn.ModuleList(),
        "heads": nn.ModuleDict(),
        "holder": holder,  # no forward at all
        "doubles": Doubles(),
        "given": given,
        "fc": nn.Linear(2, 2),
    }.items():
        model.add_module(name, module)
    assert default_layers(model) == {"doubles", "given", "fc"}


def test_torchscript_submodules_are_observed_around_and_named_in_index_md(run_dir: Path) -> None:
    inner = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    traced = cast(nn.Module, torch.jit.trace(nn.Linear(4, 2), torch.randn(1, 4)))
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.ReLU(), traced)
    assert default_layers(model) == {"0", "2"}  # no TorchScript module, nor one inside one
    with pytest.warns(RuntimeWarning, match=r"2 submodules are TorchScript .* '1', '3'"):
        inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    assert set(read_history(run_dir)["layer"]) == {"0", "2"}
    index = (run_dir / "index.md").read_text("utf-8")
    assert "TorchScript: 2 submodules are TorchScript" in index
    assert "'1', '3'" in index


@pytest.mark.parametrize("biases", [(False, True), (True, False), (False, False)])
@pytest.mark.parametrize("version", [1, 2])
def test_bias_free_swin_attention_is_selected_as_with_biases(
    version: int, biases: tuple[bool, bool]
) -> None:
    from torchvision.models import swin_transformer

    attention = (
        swin_transformer.ShiftedWindowAttention
        if version == 1
        else swin_transformer.ShiftedWindowAttentionV2
    )
    qkv_bias, proj_bias = biases
    bias_free = attention(16, [2, 2], [1, 1], 2, qkv_bias=qkv_bias, proj_bias=proj_bias)
    assert default_layers(bias_free) == default_layers(attention(16, [2, 2], [1, 1], 2))
    assert "" in default_layers(bias_free)


class IndexesAParameterList(nn.Module):
    """Computes with the weights a ParameterList holds (indexed, so no child is read)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(4, 4))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weights[0]


class KeysAParameterDict(nn.Module):
    """Computes with a weight a ParameterDict holds (by key)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterDict({"w": nn.Parameter(torch.randn(4, 4))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weights["w"]


class IteratesHolders(nn.Module):
    """Computes with the parameters of holders (no forward) kept in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        holders = [nn.Module() for _ in range(2)]
        for holder in holders:
            holder.register_parameter("weight", nn.Parameter(torch.randn(4, 4)))
        self.holders = nn.ModuleList(holders)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for holder in self.holders:
            x = x @ cast(torch.Tensor, holder.weight)
        return x


def test_a_module_whose_children_compute_nothing_is_a_layer(run_dir: Path) -> None:
    """Such a module computes with what its children hold; nothing else of it ever runs, so
    a custom layer keeping its weights in a ParameterList or ParameterDict had no rows and
    nothing said so. (A dynamically quantized LSTM keeps its packed weights this way too.)"""
    model = nn.Sequential()
    for name, module in {
        "listed": IndexesAParameterList(),
        "iterated": IteratesHolders(),
        "keyed": KeysAParameterDict(),
        "head": nn.Linear(4, 2),
    }.items():
        model.add_module(name, module)
    assert default_layers(model) == {"listed", "iterated", "keyed", "head"}
    outputs: dict[str, torch.Tensor] = {}
    for name in ("listed", "iterated"):
        hook = functools.partial(
            lambda name, m, args, out: outputs.update({name: out.detach()}), name
        )
        model.get_submodule(name).register_forward_hook(hook)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    history = read_history(run_dir)
    assert set(history.select("layer", "signal").unique().rows()) == {
        (layer, signal)
        for layer in ("listed", "iterated", "keyed", "head")
        for signal in ("output", "output_gradient")
    }
    for name, output in outputs.items():
        mean = history.filter(layer=name, signal="output", metric="mean")["value"].item()
        assert mean == pytest.approx(output.double().mean().item(), rel=1e-9)
