"""torch.compile(fullgraph=True) observed: a sampled forward runs eagerly, and the run says so.

Without the observer, a model with a graph break under fullgraph=True raises at its first
forward. A sampled forward runs with torch.compile off, so it cannot raise: the error comes at
the first unsampled forward, or never when every forward is sampled. The observer warns at the
end of a run in which every forward was sampled (fullgraph=True never checked), and index.md
counts the sampled forwards under it; a run that left forwards unsampled, and a compile
without fullgraph, are not warned about.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

FORWARDS = 3


class Breaking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        torch._dynamo.graph_break()
        return y.relu()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model: nn.Module, how: str, fullgraph: bool) -> nn.Module:
    if how == "model_compile":
        model.compile(backend="eager", fullgraph=fullgraph)
        return model
    result = torch.compile(model, backend="eager", fullgraph=fullgraph)
    assert isinstance(result, nn.Module)
    return result


def outcomes(call: nn.Module, model: nn.Module | None = None) -> tuple[list[str], list[str]]:
    """Per forward `ok` or the exception's class name, and the library's warnings up to the
    removal of `model`'s observer (when given)."""
    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(FORWARDS):
            try:
                call(torch.randn(2, 4))
                said.append("ok")
            except Exception as error:
                said.append(type(error).__name__)
        if model is not None:
            remove_observer(model)
    return said, [str(w.message) for w in caught if "torchinstruments" in str(w.message)]


def test_plain_fullgraph_model_with_a_break_raises_at_every_forward() -> None:
    """The reference: what the user sees without the observer."""
    said, _ = outcomes(compiled(Breaking(), "torch_compile", fullgraph=True))
    assert said == ["Unsupported"] * FORWARDS


@pytest.mark.parametrize("how", ["torch_compile", "model_compile"])
@pytest.mark.parametrize(
    ("every", "expected", "samples"), [(2, ["ok", "Unsupported", "ok"], 2), (1, ["ok"] * 3, 3)]
)
def test_sampled_forwards_under_fullgraph_are_warned_and_counted_as_unchecked(
    how: str, every: int, expected: list[str], samples: int, tmp_path: Path
) -> None:
    model = Breaking()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(every))
    said, warned = outcomes(compiled(model, how, fullgraph=True), model)
    index = (tmp_path / "run" / "index.md").read_text()

    assert said == expected  # sampled forwards (0, and 2 with every=2) run eagerly
    if every == 1:  # the contract was never checked: said loudly
        assert len(warned) == 1
        assert warned[0].startswith(
            "torchinstruments: every root forward was sampled (3 samples), and 3 sampled "
            "forwards were called under torch.compile(fullgraph=True)"
        )
        assert "fullgraph=True was never checked in this run" in warned[0]
    else:  # an unsampled forward checked it (and raised)
        assert warned == []
    word = "forward was" if samples == 1 else "forwards were"
    assert (
        f"{samples} sampled {word} called under torch.compile(fullgraph=True), which is not "
        "checked on a forward that runs eagerly" in index
    )


def test_compile_without_fullgraph_is_not_warned_about(tmp_path: Path) -> None:
    model = Breaking()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    model.compile(backend="eager")
    said, warned = outcomes(model, model)
    assert said == ["ok"] * FORWARDS
    assert warned == []
    assert "torch.compile(fullgraph=True)" not in (tmp_path / "run" / "index.md").read_text()
