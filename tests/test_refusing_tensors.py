"""Tensors that refuse to be read: whatever a layer returns, or whatever gradient flows back into
it, the user's step runs as it would unobserved, and the tensor that refused is null + reason.

A `torch.Tensor` subclass may raise from `__torch_function__` on any attribute read or op (a
tracing or checking subclass, a lazy tensor that cannot answer yet). Every read the library makes
of such a tensor is inside the measurement's guard: its rows are null with a reason that names
the error, the other tensors of the sample keep theirs, and the step's loss and gradients are
bit for bit those of the same step without the observer. The same holds for an error whose own
message raises, and a FakeTensor (a shape and a dtype, no values) is null with a reason that
says so. An object in an output that raises when the walk reads it costs only its own tensors,
and the run says so once.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    inject_observer,
    remove_observer,
)

from conftest import read_history

# Reads of a tensor that the library makes while measuring it; each is refused in turn.
REFUSED = ("dtype", "is_nested", "shape", "device", "numel", "layout", "detach", "is_meta")


class UnprintableError(Exception):
    """An error whose message cannot be read: `str` and `repr` raise."""

    def __str__(self) -> str:
        raise RuntimeError("no message")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def refusing(name: str, error: type[Exception] = RuntimeError) -> type[torch.Tensor]:
    """A subclass whose `__torch_function__` raises `error` on the attribute or method `name`
    and behaves as a plain tensor otherwise (its results are of the subclass too)."""

    class Refusing(torch.Tensor):
        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            called = getattr(func, "__name__", "")
            if called == "__get__":  # an attribute read: the descriptor's name
                called = getattr(getattr(func, "__self__", None), "__name__", called)
            if called == name:
                raise error(f"refused {name}")
            return super().__torch_function__(func, types, args, kwargs)

    return Refusing


class RefusingGradient(torch.autograd.Function):
    """Identity forward; its backward hands the gradient on as a refusing tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: type[torch.Tensor]) -> torch.Tensor:
        ctx.kind = kind
        return x.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return grads[0].as_subclass(ctx.kind), None


class Net(nn.Module):
    """`probe` returns a refusing tensor (`where="output"`), or receives a refusing gradient
    (`where="gradient"`); `hidden` and `head` are plain layers around it."""

    def __init__(self, kind: type[torch.Tensor], where: str) -> None:
        super().__init__()
        self.hidden = nn.Linear(5, 8)
        self.probe = nn.Tanh()
        self.head = nn.Linear(8, 1)
        self.kind, self.where = kind, where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        if self.where == "output":
            probed = self.probe(h.as_subclass(self.kind))
            return self.head(h).sum() + torch.Tensor.sum(probed).as_subclass(torch.Tensor)
        return self.head(RefusingGradient.apply(self.probe(h), self.kind)).sum()


def step(model: Net, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward: the loss and every parameter's gradient."""
    loss = model(x).as_subclass(torch.Tensor)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("where", ["output", "gradient"])
@pytest.mark.parametrize("name", REFUSED)
def test_a_tensor_refusing_a_read_is_null_with_a_reason_and_the_step_is_unchanged(
    tmp_path: Path, name: str, where: str
) -> None:
    model = Net(refusing(name), where)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 5)
    want_loss, want_grads = step(plain, x)
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got_loss, got_grads = step(model, x)
        remove_observer(model)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads, strict=True))
    lost = [str(w.message) for w in said if "failed" in str(w.message)]
    assert not lost, lost  # no row was lost: the tensor is null + reason
    history = read_history(tmp_path / "s")
    signal = "output" if where == "output" else "output_gradient"
    probe = history.filter(layer="probe", signal=signal)
    assert sorted(probe["metric"].to_list()) == sorted(DEFAULT_METRICS)
    if probe["value"].null_count():  # refused where the measurement needed it
        assert probe["value"].null_count() == probe.height
        reasons = set(probe["unavailable_reason"].to_list())
        assert len(reasons) == 1
        (reason,) = reasons
        assert reason.endswith(f"error: RuntimeError: refused {name}"), reason
    if name == "dtype":  # the row says it does not know
        assert set(probe["dtype"].to_list()) == {"unknown"}
    if name in ("shape", "is_nested"):
        assert probe["shape"].null_count() == probe.height
    for layer in ("hidden", "head"):
        for other in ("output", "output_gradient"):
            rows = history.filter(layer=layer, signal=other)
            assert rows.height == len(DEFAULT_METRICS)
            assert rows["value"].null_count() == 0, rows
    assert history.filter(pl.col("layer") == "probe")["signal"].n_unique() == 2


FAKE_REASON = "fake tensor: a shape and a dtype, no values (torch's FakeTensorMode)"


def test_a_fake_tensor_output_is_null_with_a_reason_that_says_it_is_fake(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode().from_tensor(torch.randn(3, 4))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(5, 8)
            self.probe = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.probe(fake)
            return self.hidden(x)

    model = Net()
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 5)).sum().backward()
    remove_observer(model)
    history = read_history(tmp_path / "s")
    probe = history.filter(layer="probe")
    assert probe.height == len(DEFAULT_METRICS)
    assert probe["value"].null_count() == probe.height
    assert set(probe["unavailable_reason"].to_list()) == {FAKE_REASON}
    assert probe["shape"].to_list()[0] == [3, 4]
    assert set(probe["dtype"].to_list()) == {"float32"}
    assert history.filter(layer="hidden")["value"].null_count() == 0
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    assert f"`{FAKE_REASON}`" in index


@pytest.mark.parametrize("where", ["output", "gradient"])
@pytest.mark.parametrize("name", ["detach", "dtype", "register_hook", "requires_grad"])
def test_an_error_whose_message_cannot_be_read_still_leaves_the_step_alone(
    tmp_path: Path, name: str, where: str
) -> None:
    model = Net(refusing(name, UnprintableError), where)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 5)
    want_loss, want_grads = step(plain, x)
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got_loss, got_grads = step(model, x)
        remove_observer(model)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads, strict=True))
    history = read_history(tmp_path / "s")
    probe = history.filter(layer="probe")
    signal = "output" if where == "output" else "output_gradient"
    assert probe.filter(signal=signal).height == len(DEFAULT_METRICS)
    nulls = probe.filter(pl.col("value").is_null())
    assert set(nulls["unavailable_reason"].to_list()) <= {
        "measurement error: UnprintableError: (its message could not be read)"
    }
    for layer in ("hidden", "head"):
        assert history.filter(layer=layer)["value"].null_count() == 0


class RefusingMapping(dict):
    """A mapping whose entries cannot be listed."""

    def items(self) -> Any:
        raise RuntimeError("refused items")


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


class RefusingPair(Pair):
    """A dataclass output one of whose fields raises when read."""

    @property  # type: ignore[override]
    def second(self) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("refused second")

    @second.setter
    def second(self, value: torch.Tensor) -> None:
        pass


class ClassRefusing:
    """An object that raises when asked its class (as `isinstance` does)."""

    @property
    def __class__(self) -> type:  # type: ignore[override]
        raise RuntimeError("refused __class__")


class Heads(nn.Module):
    """Returns tensors around a container that refuses to be read."""

    def __init__(self, refusing: str) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 6)
        self.refusing = refusing

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        y = self.proj(x)
        if self.refusing == "mapping":
            odd: Any = RefusingMapping(hidden=y * 3)
        elif self.refusing == "dataclass":
            odd = RefusingPair(y * 3, y * 4)
        else:
            odd = ClassRefusing()
        return y * 2, odd, Pair(y - 1, y + 1)


@pytest.mark.parametrize("refusing", ["mapping", "dataclass", "object"])
def test_an_object_in_an_output_that_raises_when_read_costs_only_its_own_tensors(
    tmp_path: Path, refusing: str
) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = Heads(refusing)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first, _, pair = self.heads(x)
            return (first + pair.first * pair.second).sum()

    model = Net()
    x = torch.randn(4, 5)
    want = copy.deepcopy(model)(x)
    inject_observer(
        model,
        output_dir=tmp_path / "s",
        sampler=EveryNForwardsSampler(1),
        selector=lambda name, module: name == "heads",
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = model(x)
        got.backward()
        remove_observer(model)
    assert torch.equal(got, want)
    history = read_history(tmp_path / "s")
    found = {
        (row[0], row[1]): row[2]
        for row in history.group_by("signal", "tensor_path").len().iter_rows()
    }
    kept = {
        (s, p) for s in ("output", "output_gradient") for p in ("[0]", "[2].first", "[2].second")
    }
    if refusing == "dataclass":  # read before the field that raised; no gradient reaches it
        kept.add(("output", "[1].first"))
    assert found == dict.fromkeys(kept, len(DEFAULT_METRICS))
    assert history["value"].null_count() == 0
    messages = [str(w.message) for w in said if "refused" in str(w.message)]
    assert len(messages) == 1, messages
    kind, refused = {
        "mapping": ("RefusingMapping", "items"),
        "dataclass": ("RefusingPair", "second"),
        "object": ("ClassRefusing", "__class__"),
    }[refusing]
    said_once = (
        f"layer 'heads' returned a {__name__}.{kind} at tensor_path '[1]' (the first place "
        f"seen) that raised when the output walk read it: RuntimeError('refused {refused}')"
    )
    assert said_once in messages[0]
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    noted = said_once.replace("'heads'", "`heads`").replace("'[1]'", "`[1]`")  # code there
    assert noted in index
