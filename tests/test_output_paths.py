"""Where each tensor of a structured output is named, against plain hooks on the same model.

The reference is written here without the library: `register_forward_hook` sees the whole
output object, `Tensor.register_hook` on each tensor in it sees its gradient, and NumPy reduces
them. torch's own named tuples (`torch.return_types`: `torch.max(x, dim)`, `topk`, `sort`,
`linalg.eigh`) are read by field, as users read them (`out.values`); the indices they hold are
integer tensors and measured as such. A tensor reached at two paths of one output is measured
once, at the first, and the run names the second path (warning and index.md). Two tensors under
mapping keys that read alike keep series of their own (`#1`), and a key's memory address is not
part of its path. A packed sequence is measured by its data, the real time steps only: the
padding of the padded batch is not in it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history
from reference_values import numpy_profile


class Reduce(nn.Module):
    """One of torch's functions that return a named tuple, as a module of its own."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, y: torch.Tensor) -> Any:
        if self.kind == "max":
            return torch.max(y, dim=1)
        if self.kind == "topk":
            return torch.topk(y, 2, dim=1)
        if self.kind == "sort":
            return torch.sort(y, dim=1, descending=True)
        return torch.linalg.eigh(y.T @ y)  # symmetric


class Head(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.reduce = Reduce(kind)

    def forward(self, x: torch.Tensor) -> Any:
        return self.reduce(self.linear(x))


FIELDS = {
    "max": ("values", "indices"),
    "topk": ("values", "indices"),
    "sort": ("values", "indices"),
    "eigh": ("eigenvalues", "eigenvectors"),
}


def hooked(model: nn.Module, layer: str) -> dict[str, dict[str, float]]:
    """Plain hooks on `layer`: each field's profile under `.field`, its gradient under
    `grad.field`, filled as the forward and the backward run."""
    seen: dict[str, dict[str, float]] = {}

    def on_output(module: nn.Module, args: Any, output: Any) -> None:
        for name in type(output).__match_args__:
            tensor = getattr(output, name)
            seen[f".{name}"] = numpy_profile(tensor)
            if tensor.requires_grad:
                tensor.register_hook(lambda g, key=f"grad.{name}": keep(key, g))

    def keep(key: str, gradient: torch.Tensor | None) -> None:
        if gradient is not None:  # None: an output of the node that the loss never used
            seen[key] = numpy_profile(gradient)

    dict(model.named_modules())[layer].register_forward_hook(on_output)
    return seen


def rows_by_path(history: pl.DataFrame, layer: str, signal: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for row in history.filter(layer=layer, signal=signal).iter_rows(named=True):
        out.setdefault(row["tensor_path"], {})[row["metric"]] = row["value"]
    return out


def close(expected: dict[str, float]) -> dict[str, Any]:
    return {name: pytest.approx(value, rel=1e-6, abs=1e-6) for name, value in expected.items()}


@pytest.mark.parametrize("kind", list(FIELDS))
def test_torch_named_tuples_are_named_by_field_with_the_values_plain_hooks_see(
    run_dir: Path, kind: str
) -> None:
    torch.manual_seed(0)
    model = Head(kind)
    reference = hooked(model, "reduce")  # on the model itself, before injection: the same values
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    out = model(torch.randn(3, 4))
    first = getattr(out, FIELDS[kind][0])
    first.square().sum().backward()
    remove_observer(model)
    history = read_history(run_dir)
    outputs = rows_by_path(history, "reduce", "output")
    assert sorted(outputs) == sorted(f".{name}" for name in FIELDS[kind])
    for path, values in outputs.items():
        assert values == close(reference[path]), path
    gradients = rows_by_path(history, "reduce", "output_gradient")
    assert list(gradients) == [f".{FIELDS[kind][0]}"]
    assert gradients[f".{FIELDS[kind][0]}"] == close(reference[f"grad.{FIELDS[kind][0]}"])
    if kind != "eigh":  # the indices: an integer tensor, measured as its integers
        dtypes = dict(history.select("tensor_path", "dtype").unique().iter_rows())
        assert dtypes[".indices"] == "int64"


def test_a_continued_run_names_the_fields_as_its_first_attempt_did(run_dir: Path) -> None:
    model = Head("max")
    for attempt in range(2):
        inject_observer(
            model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), resume=attempt > 0
        )
        model(torch.randn(3, 4)).values.sum().backward()
        remove_observer(model)
    history = read_history(run_dir).filter(layer="reduce")
    paths = history.group_by("attempt").agg(pl.col("tensor_path").unique().sort())
    assert sorted(paths.rows()) == [(0, [".indices", ".values"]), (1, [".indices", ".values"])]


class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y


def observe_warned(model: nn.Module, run_dir: Path, step: Any, **kwargs: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), **kwargs)
        for _ in range(2):
            step()
        remove_observer(model)
    return [str(w.message) for w in caught if str(w.message).startswith("torchinstruments")]


def test_a_tensor_returned_twice_has_one_row_and_the_second_path_is_named(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Twice())
    seen: dict[str, Any] = {}

    def on_output(module: nn.Module, args: Any, output: Any) -> None:
        assert output[0] is output[1]  # what a plain hook sees: one tensor at two paths
        seen["output"] = numpy_profile(output[0])
        output[0].register_hook(lambda g: seen.update(gradient=numpy_profile(g)))

    model[1].register_forward_hook(on_output)

    def step() -> None:
        out = model(torch.randn(3, 4))
        (out[0].sum() + 3 * out[1].square().sum()).backward()

    said = observe_warned(model, run_dir, step)
    history = read_history(run_dir).filter(pl.col("sample_id") == 1)
    assert rows_by_path(history, "1", "output") == {"[0]": close(seen["output"])}
    assert rows_by_path(history, "1", "output_gradient") == {"[0]": close(seen["gradient"])}
    aliased = [message for message in said if "the same tensor" in message]
    assert aliased == [
        "torchinstruments: layer '1' returned the same tensor at tensor_path '[1]' as at '[0]' "
        "(the first such path seen): it is measured once, so the rows of '[1]' are those of '[0]'"
    ]
    page = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "layer `1` returned the same tensor at tensor_path `[1]` as at `[0]`" in page


def test_hugging_face_last_hidden_state_listed_again_in_hidden_states_is_named(
    run_dir: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 64, (2, 5))
    said = observe_warned(
        model,
        run_dir,
        lambda: model(ids, output_hidden_states=True),
        selector=lambda name, module: name == "",
    )
    with torch.no_grad():
        plain = model(ids, output_hidden_states=True)
    assert plain.hidden_states[-1] is plain.last_hidden_state
    outputs = rows_by_path(read_history(run_dir).filter(sample_id=1), "", "output")
    assert sorted(outputs) == ["['hidden_states'][0]", "['last_hidden_state']", "['pooler_output']"]
    assert outputs["['last_hidden_state']"] == close(numpy_profile(plain.last_hidden_state))
    message = (
        "layer '' returned the same tensor at tensor_path \"['hidden_states'][1]\" as at "
        "\"['last_hidden_state']\""
    )
    assert [m for m in said if message in m], said
    noted = (  # index.md names them as code
        "layer `<root>` returned the same tensor at tensor_path `['hidden_states'][1]` as at "
        "`['last_hidden_state']`"
    )
    assert noted in (run_dir / "index.md").read_text(encoding="utf-8")


def test_a_container_returned_twice_is_named_once_and_constants_are_not(run_dir: Path) -> None:
    class Pairs(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            pair = (x + 1, x - 1)
            return pair, pair, (1, 2), (1, 2), (), ()  # the constants are shared objects too

    model = nn.Sequential(nn.Identity(), Pairs())
    said = observe_warned(model, run_dir, lambda: model(torch.randn(3)))
    paths = set(read_history(run_dir).filter(layer="1")["tensor_path"].to_list())
    assert paths == {"[0][0]", "[0][1]"}
    aliased = [message for message in said if "the same" in message]
    assert aliased == [
        "torchinstruments: layer '1' returned the same object, with its tensors, at tensor_path "
        "'[1]' as at '[0]' (the first such path seen): it is measured once, so the rows of '[1]' "
        "are those of '[0]'"
    ]


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_a_packed_sequence_is_measured_over_its_real_steps_without_padding(
    run_dir: Path, kind: str
) -> None:
    torch.manual_seed(0)
    rnn = getattr(nn, kind)(3, 4, batch_first=True)

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = rnn

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> Any:
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return self.rnn(packed)

    model = Tagger()
    seen: dict[str, Any] = {}

    def on_output(module: nn.Module, args: Any, output: Any) -> None:
        data = output[0].data
        seen["data"] = numpy_profile(data)
        data.register_hook(lambda g: seen.update(gradient=numpy_profile(g)))

    rnn.register_forward_hook(on_output)
    x = torch.randn(3, 5, 3)
    lengths = torch.tensor([2, 5, 3])
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    out = model(x, lengths)
    out[0].data.square().sum().backward()
    remove_observer(model)
    history = read_history(run_dir).filter(layer="rnn")
    data = history.filter(tensor_path="[0].data")
    assert data["shape"].unique().to_list() == [[10, 4]]  # 2 + 5 + 3 steps, not 3 x 5
    assert rows_by_path(history, "rnn", "output")["[0].data"] == close(seen["data"])
    assert rows_by_path(history, "rnn", "output_gradient") == {"[0].data": close(seen["gradient"])}
    batch_sizes = rows_by_path(history, "rnn", "output")["[0].batch_sizes"]
    assert batch_sizes == close(numpy_profile(out[0].batch_sizes))


class Key:
    """A mapping key whose repr is its class's name: two of them read alike."""

    def __repr__(self) -> str:
        return "Key"


def test_two_tensors_under_keys_that_read_alike_keep_series_and_gradients_apart(
    run_dir: Path,
) -> None:
    first, second = Key(), Key()

    class Heads(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[Key, torch.Tensor]:
            return {first: x * 2, second: x * 3}

    model = nn.Sequential(nn.Linear(3, 3), Heads())
    seen: dict[str, Any] = {}

    def on_output(module: nn.Module, args: Any, output: Any) -> None:
        for name, key in (("first", first), ("second", second)):
            seen[name] = numpy_profile(output[key])
            output[key].register_hook(lambda g, name=name: seen.update({f"grad {name}": g}))

    model[1].register_forward_hook(on_output)

    def step() -> None:
        out = model(torch.randn(4, 3))
        (out[first].sum() + 10 * out[second].square().sum()).backward()

    said = observe_warned(model, run_dir, step)
    history = read_history(run_dir).filter(pl.col("sample_id") == 1)
    outputs = rows_by_path(history, "1", "output")
    assert outputs == {"[Key]": close(seen["first"]), "[Key]#1": close(seen["second"])}
    gradients = rows_by_path(history, "1", "output_gradient")
    assert gradients == {
        "[Key]": close(numpy_profile(seen["grad first"])),
        "[Key]#1": close(numpy_profile(seen["grad second"])),
    }
    message = (
        "layer '1' returned two different tensors at tensor_path '[Key]' (mapping keys that "
        "read alike, the first such path seen): the later one's rows are at '[Key]#1'"
    )
    assert [m for m in said if message in m], said
    noted = message.replace("'1'", "`1`").replace("'[Key]", "`[Key]").replace("]'", "]`")
    assert noted.replace("#1'", "#1`") in (run_dir / "index.md").read_text(encoding="utf-8")


class Plain:
    """A key with object's own repr, which holds its memory address."""


def test_keys_without_a_repr_of_their_own_name_the_same_tensors_the_same_way_every_sample(
    run_dir: Path,
) -> None:
    kept: list[Plain] = []  # every forward's keys stay alive: each has an address of its own

    class Heads(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[Any, torch.Tensor]:
            first, second = Plain(), Plain()
            kept.extend((first, second))
            return {first: x * 2, second: x * 3, torch.tanh: x.tanh(), "at 0x1 at 0x2": x - 1}

    model = nn.Sequential(nn.Linear(3, 3), Heads())
    observe_warned(model, run_dir, lambda: model(torch.randn(4, 3)))
    history = read_history(run_dir).filter(layer="1")
    paths = history.group_by("sample_id").agg(pl.col("tensor_path").unique().sort())
    name = f"[<{__name__}.Plain object>]"
    tanh = "[<built-in method tanh of type object>]"
    expected = sorted([name, f"{name}#1", tanh, "['at 0x1 at 0x2']"])  # a string's text as is
    assert sorted(paths.rows()) == [(0, expected), (1, expected)]
