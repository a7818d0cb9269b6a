"""A tensor whose measurement failed is null with a reason in its rows, and the run says so: one
warning per layer and kind of failure (with the error), and index.md names the layers, metrics
and how many samples; a gradient whose hook could not be registered is named, tensor by tensor,
with why it has no output_gradient rows."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import polars as pl
import torch
from test_refusing_tensors import Net, refusing, step
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history


def boom_on_three(tensor: torch.Tensor) -> torch.Tensor:
    """A reducer that raises for tensors whose last dimension is 3 (layer `b`'s output and
    the gradient into it), and measures every other tensor."""
    if tensor.shape[-1] == 3:
        raise ValueError("boom")
    return tensor.abs().amax()


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(4, 3)
        self.c = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x))).sum()


def run(model: nn.Module, directory: Path, samples: int, **options: Any) -> list[str]:
    """`samples` sampled steps and the removal; the messages of the warnings raised."""
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1), **options)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(samples):
            step(model, torch.randn(4, 5))  # type: ignore[arg-type]
        remove_observer(model)
    return [str(w.message) for w in said]


def test_a_custom_reducer_failing_on_a_layer_without_histogram_is_warned_once_and_named(
    tmp_path: Path,
) -> None:
    said = run(
        Chain(),
        tmp_path / "s",
        3,
        reducers={"absmax": boom_on_three},
        max_histogram_modules=1,  # `a` only: `b` has no histogram
    )
    history = read_history(tmp_path / "s")
    failed = history.filter(unavailable_reason="reducer error: ValueError: boom")
    assert set(failed["layer"].to_list()) == {"b"}
    assert set(failed["signal"].to_list()) == {"output", "output_gradient"}
    assert failed["sample_id"].n_unique() == 3
    about = [m for m in said if "boom" in m]
    assert len(about) == 1, about  # once for the layer and kind, not per sample or signal
    assert "layer 'b'" in about[0]
    assert "reducer error: ValueError: boom" in about[0]
    assert not any("'a'" in m or "'c'" in m for m in about)
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    note = next(line for line in index.splitlines() if "reducer error: ValueError: boom" in line)
    for said_in_note in ("`b`", "output: absmax in 3 samples", "output_gradient: absmax in 3"):
        assert said_in_note in note
    for other in ("'a'", "'c'"):
        assert other not in note


def test_a_measurement_error_of_a_refusing_tensor_is_warned_once_and_named(
    tmp_path: Path,
) -> None:
    said = run(Net(refusing("dtype"), "output"), tmp_path / "s", 2, max_histogram_modules=1)
    history = read_history(tmp_path / "s")
    reason = "measurement error: RuntimeError: refused dtype"
    failed = history.filter(unavailable_reason=reason)
    assert set(failed["layer"].to_list()) == {"probe"}
    about = [m for m in said if reason in m]
    assert len(about) == 1, said
    assert "layer 'probe'" in about[0]
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    note = next(line for line in index.splitlines() if reason in line)
    assert "`probe` (output: mean, std" in note
    assert "in 2 samples" in note


def absmax(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.abs().amax()


def test_a_run_without_failures_says_nothing_about_them(tmp_path: Path) -> None:
    said = run(Chain(), tmp_path / "s", 2, reducers={"absmax": absmax})
    assert not [m for m in said if "error:" in m], said
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    assert "Not measured" not in index


def test_a_gradient_whose_hook_was_refused_is_named_with_its_samples_in_index_md(
    tmp_path: Path,
) -> None:
    said = run(Net(refusing("register_hook"), "output"), tmp_path / "s", 3)
    history = read_history(tmp_path / "s")
    assert history.filter(layer="probe", signal="output_gradient").height == 0
    about = [m for m in said if "refused register_hook" in m]
    assert len(about) == 1, said
    assert "'probe'" in about[0]
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    note = next(line for line in index.splitlines() if "refused register_hook" in line)
    assert "no output_gradient rows" in note
    assert "`probe` (3 samples, from 0 to 2: RuntimeError('refused register_hook'))" in note


def test_failures_in_many_layers_warn_for_the_first_twenty_and_index_md_counts_the_rest(
    tmp_path: Path,
) -> None:
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(25)))
    inject_observer(
        model,
        output_dir=tmp_path / "s",
        sampler=EveryNForwardsSampler(1),
        reducers={"absmax": boom_on_three},
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model(torch.randn(2, 3))
        remove_observer(model)
    messages = [str(w.message) for w in said]
    per_layer = [m for m in messages if "could not be measured (output" in m]
    assert len(per_layer) == 20, messages
    assert len([m for m in messages if "more layers than the first 20" in m]) == 1
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    note = next(line for line in index.splitlines() if "reducer error: ValueError: boom" in line)
    assert "in 25 layers" in note
    assert "`19` (output: absmax in 1 sample) ... (5 more)" in note


def outside_code(markdown: str) -> str:
    """`markdown` without its fenced blocks and inline code spans (any fence length)."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    return re.sub(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)", "", text, flags=re.DOTALL)


def test_the_note_names_the_root_and_each_layer_as_the_layers_section_does(
    tmp_path: Path,
) -> None:
    """`'<root>'` outside a code span is an HTML tag, which GitHub drops from the page, and a
    name holding `*` turned into emphasis: a note names each layer in a code span, as index.md's
    Layers section does; nothing of the page outside code reads as HTML."""
    model = nn.Sequential()
    model.add_module("*b*", nn.Linear(3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inject_observer(
            model,
            output_dir=tmp_path / "s",
            sampler=EveryNForwardsSampler(1),
            selector=lambda name, module: True,  # the root too
            reducers=[boom_on_three],
        )
        model(torch.randn(2, 3)).sum().backward()
        remove_observer(model)
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    note = next(line for line in index.splitlines() if "Not measured (" in line)
    assert "in 2 layers" in note
    assert "`<root>` (output: " in note
    assert "`*b*` (output: " in note
    assert re.findall(r"<[A-Za-z/!]", outside_code(index)) == []


def whole_tensor_on_three(tensor: torch.Tensor) -> torch.Tensor:
    """A reducer that returns the whole tensor, not a scalar, for layer `b`'s tensors (a
    forgotten `.mean()`), and a scalar for every other tensor."""
    return tensor if tensor.shape[-1] == 3 else tensor.abs().amax()


def test_a_custom_reducer_returning_what_cannot_be_a_metric_is_warned_once_and_named(
    tmp_path: Path,
) -> None:
    # Its rows were null with 'reducer returned a tensor of shape ...', said nowhere else.
    said = run(Chain(), tmp_path / "s", 2, reducers={"absmax": whole_tensor_on_three})
    history = read_history(tmp_path / "s")
    failed = history.filter(pl.col("metric") == "absmax", pl.col("value").is_null())
    assert set(failed["layer"].to_list()) == {"b"}
    assert set(failed["unavailable_reason"].to_list()) == {
        "reducer returned a tensor of shape (4, 3), expected a scalar"
    }
    about = [m for m in said if "expected a scalar" in m]
    assert len(about) == 1, about  # one kind, whatever the shape
    assert about[0].startswith("torchinstruments: layer 'b' could not be measured")
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    note = next(line for line in index.splitlines() if "cannot be a metric" in line)
    assert "`b` (output: absmax in 2 samples; output_gradient: absmax in 2 samples)" in note


def unclear_on_three(tensor: torch.Tensor) -> torch.Tensor:
    """A reducer raising, for layer `b`'s tensors, an error with a line break and an escape."""
    if tensor.shape[-1] == 3:
        raise ValueError("bad \x1b[31mvalue\nsee log")
    return tensor.abs().amax()


def test_a_reducer_error_with_unclear_text_is_quoted_in_index_md_as_a_literal(
    tmp_path: Path,
) -> None:
    # Its line break split the note's paragraph, and the escape was written raw to index.md.
    run(Chain(), tmp_path / "s", 1, reducers={"absmax": unclear_on_three})
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    assert "\x1b" not in index
    note = next(line for line in index.splitlines() if "Not measured" in line)
    assert (
        "first as `'reducer error: ValueError: bad \\x1b[31mvalue\\nsee log'`) in 1 layer" in note
    )


class LeavesOutOnThree:
    """Declares `peak` and `spread`; leaves `spread` out for layer `b`'s tensors, and always
    returns a key it does not declare (`count`)."""

    metrics = ("peak", "spread")

    def __call__(self, tensor: torch.Tensor) -> dict[str, torch.Tensor | int]:
        out: dict[str, torch.Tensor | int] = {"peak": tensor.amax(), "count": tensor.numel()}
        if tensor.shape[-1] != 3:
            out["spread"] = tensor.amax() - tensor.amin()
        return out


def test_a_reducer_leaving_out_a_metric_or_returning_more_is_warned_and_named_in_index_md(
    tmp_path: Path,
) -> None:
    # The left-out metric was null with the reason the built-in reducers give an empty tensor,
    # and the extra key was dropped: neither was warned nor named in index.md.
    said = run(Chain(), tmp_path / "s", 2, reducers=[LeavesOutOnThree()])
    history = read_history(tmp_path / "s")
    left_out = "reducer left out 'spread', which its metrics name: its mapping had no entry for it"
    failed = history.filter(unavailable_reason=left_out)
    assert set(failed["layer"].to_list()) == {"b"}
    assert set(failed["metric"].to_list()) == {"spread"}
    assert history.filter(pl.col("metric") == "peak", pl.col("value").is_null()).height == 0
    assert "count" not in set(history["metric"].to_list())
    about = [m for m in said if left_out in m]
    assert len(about) == 1, said
    assert about[0].startswith("torchinstruments: layer 'b' could not be measured")
    extra = [m for m in said if "beyond its metrics" in m]
    assert extra == [
        "torchinstruments: reducer LeavesOutOnThree returned 'count' beyond its metrics "
        "('peak', 'spread'); those are not recorded (name them in its `metrics` to record them; "
        "warned once per reducer, and index.md says so)"
    ]
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    note = next(line for line in index.splitlines() if "reducer left out a metric" in line)
    assert "`b` (output: spread in 2 samples; output_gradient: spread in 2 samples)" in note
    note = next(line for line in index.splitlines() if "Not recorded: 1 custom reducer" in line)
    assert "`LeavesOutOnThree` returned `'count'` beyond its metrics `peak`, `spread`" in note
