"""Objects in an output that the walk does not enter: passed over, and the run says so.

The output walk enters tuples, lists, mappings, named tuples and dataclasses; a tensor inside
any other object (a `torch.distributions` distribution a policy head returns, a Hugging Face
`Cache`, a `SimpleNamespace`, a `deque`) has no row, as plain hooks walking the output the same
way (`hook_reference`) see none. A layer that returns one ran and recorded nothing of it, so the
run names the layer, the object's type and the first path it was seen at: one warning per layer
and type (a list of a thousand distributions is one), and a note in index.md. Plain values (None, strings, numbers, enum members, dtypes, devices) hold no
tensor and pass without a word.

A model whose forward is a generator returns before any layer runs; its layers run as the caller
consumes it, outside the root forward, unobserved as plain hooks see them: said the same way.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributions import Categorical, Normal

from hook_reference import Conformance, run_both


class GaussianPolicy(nn.Module):
    """A policy head as reinforcement-learning code writes it: one module with its own weights
    that returns its action distribution next to a value estimate."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8) * 0.3)
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        out = x @ self.weight.T
        return {"action": Normal(out[:, :2], self.log_std.exp()), "value": out[:, 2]}


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.policy = GaussianPolicy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.policy(torch.tanh(self.body(x)))
        action = heads["action"]
        log_prob = action.log_prob(action.mean.detach() + 0.1).sum(-1)
        return (log_prob + heads["value"]).mean()


def agent_step(model: nn.Module, i: int) -> torch.Tensor:
    loss = model(torch.randn(5, 4))
    loss.backward()
    return loss.detach()


def observe_warned(
    model: nn.Module, run_dir: Path, steps: int, step: Any = agent_step
) -> tuple[Conformance, list[str]]:
    """Run `model` observed and hooked; the library's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_both(model, step, run_dir, steps=steps)
    said = [str(w.message) for w in caught if str(w.message).startswith("torchinstruments")]
    return result, said


def test_a_distribution_returned_by_a_layer_is_named_in_one_warning_and_in_index(
    run_dir: Path,
) -> None:
    result, said = observe_warned(Agent(), run_dir, steps=2)
    result.assert_conforms()  # the rows: every tensor plain hooks see, and no more
    paths = set(result.history.filter(layer="policy")["tensor_path"].to_list())
    assert paths == {"['value']"}
    passed = [message for message in said if "does not enter" in message]
    assert len(passed) == 1, said  # two samples, one warning
    assert "layer 'policy'" in passed[0]
    assert "torch.distributions.normal.Normal at tensor_path \"['action']\"" in passed[0]
    page = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "torch.distributions.normal.Normal" in page
    assert "tensors inside it, if any, have no rows" in page


class PerAgentPolicies(nn.Module):
    """A layer returning one distribution per agent, in a list."""

    def __init__(self, agents: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(agents, 4, 2) * 0.3)

    def forward(self, x: torch.Tensor) -> list[Any]:
        logits = torch.einsum("bi,aij->abj", x, self.weight)
        return [logits, *(Categorical(logits=agent) for agent in logits)]


def test_a_list_of_distributions_is_one_warning_at_the_first_path(run_dir: Path) -> None:
    def step(model: nn.Module, i: int) -> torch.Tensor:
        out = model(torch.randn(3, 4))
        loss = sum(d.entropy().sum() for d in out[1:]) + out[0].sum()
        loss.backward()
        return loss.detach()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_both(nn.Sequential(PerAgentPolicies(50)), step, run_dir, steps=2)
    result.assert_conforms()
    passed = [str(w.message) for w in caught if "does not enter" in str(w.message)]
    assert len(passed) == 1, passed
    assert "Categorical at tensor_path '[1]' (the first place seen)" in passed[0]


class Color(enum.Enum):
    RED = 1


class PlainValues(nn.Module):
    """A layer (its own weight, no children) whose output holds tensors next to values that hold
    none."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        y = x @ self.weight
        extras = (None, "tag", b"raw", 3, 0.5, True, 1j, Color.RED, torch.float32)
        return (y, y.shape, torch.device("cpu"), nn.Linear, *extras)


def test_plain_values_in_an_output_pass_without_a_word(run_dir: Path) -> None:
    def step(model: nn.Module, i: int) -> torch.Tensor:
        out = model(torch.randn(2, 4))[0]
        out.sum().backward()
        return out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_both(nn.Sequential(PlainValues()), step, run_dir)
    assert not [w for w in caught if "does not enter" in str(w.message)]
    result.assert_conforms()
    assert set(result.history["tensor_path"].to_list()) == {"[0]"}
    assert "does not enter" not in (run_dir / "index.md").read_text(encoding="utf-8")


class Deep(nn.Module):
    """A layer (its own weight, no children) whose output nests a tensor 17 lists deep (the walk
    follows 16, as plain hooks walking the output do)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> list[Any]:
        y = x @ self.weight
        nested: list[Any] = [y]
        for _ in range(15):  # the list around the tensor at depth 16, the tensor at 17
            nested = [nested]
        return [y.sum(), nested]


def test_an_output_nested_deeper_than_the_walk_follows_is_said(run_dir: Path) -> None:
    def step(model: nn.Module, i: int) -> torch.Tensor:
        out = model(torch.randn(2, 4))[0]
        out.backward()
        return out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_both(nn.Sequential(Deep()), step, run_dir)
    result.assert_conforms()  # plain hooks follow 16 levels too
    assert set(result.history["tensor_path"].to_list()) == {"[0]"}
    passed = [str(w.message) for w in caught if "does not enter" in str(w.message)]
    assert len(passed) == 1
    assert "layer '0' returned an object nested deeper than 16" in passed[0]


class Streaming(nn.Module):
    """A streaming model whose forward is a generator: one output per chunk, as it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, chunks: torch.Tensor) -> Iterator[torch.Tensor]:
        for chunk in chunks:
            yield self.act(self.encode(chunk))


def streaming_step(model: nn.Module, i: int) -> torch.Tensor:
    outputs = torch.stack(list(model(torch.randn(3, 2, 4))))
    outputs.square().sum().backward()
    return outputs.detach()


def test_a_generator_forward_is_said_to_run_its_layers_after_the_root_forward(
    run_dir: Path,
) -> None:
    result, said = observe_warned(Streaming(), run_dir, steps=2, step=streaming_step)
    # Calling the model returns the generator before any layer runs: plain hooks on the root
    # see the root forward end first, so no layer call falls inside one there either.
    result.assert_conforms()
    assert result.history.height == 0
    assert all(map(torch.equal, result.observed_outputs, result.reference_outputs))
    deferred = [message for message in said if "returned a generator" in message]
    assert len(deferred) == 1, said
    assert "forward returned a generator (first in sample 0)" in deferred[0]
    assert "returned a generator" in (run_dir / "index.md").read_text("utf-8")
