"""A model with hooks of its own: the rows equal plain hooks, and the hooks still do what they do.

The observer never registers a module hook; the user's model may. Its forward pre-hooks change
the inputs a layer's forward gets, its forward hooks may replace or change in place what the next
layer gets, and its full backward hooks (and pre-hooks) wrap the layer's inputs and outputs in
autograd functions of torch's and may change the gradients further back. A row describes what the
layer's forward returned and the gradient into that tensor, as a forward hook run first and
`Tensor.register_hook` on its result see it (design.md's reference), compared both ways.

With `capture_direct_forwards=False` a call counts only when it came through `nn.Module.__call__`;
a module with a hook of any kind is called from within `__call__`'s hook-running path (a nested
function of its own), which is such a call too: its rows are there, as they are without hooks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hook_reference import run_both


def hooked_model() -> nn.Sequential:
    """Five layers, each with a different kind of user hook, and a root hook that only counts
    the model's calls (`model.calls`)."""
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 2)
    )
    model.calls = 0  # type: ignore[assignment]

    def count(module: nn.Module, args: tuple) -> None:
        module.calls += 1  # type: ignore[operator]

    model.register_forward_pre_hook(count)
    model[0].register_forward_hook(lambda module, args, output: output * 3)  # replaces it
    model[1].register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    model[2].register_forward_hook(lambda module, args, output: output.mul_(2))  # in place
    model[3].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 5,))
    model[4].register_full_backward_pre_hook(lambda module, grad_out: (grad_out[0] * 7,))
    return model


def step(model: nn.Module, i: int) -> torch.Tensor:
    out = model(torch.randn(4, 8))
    out.square().sum().backward()
    return out.detach()


@pytest.mark.parametrize("capture_direct_forwards", [True, False])
def test_rows_of_layers_with_user_hooks_equal_plain_hooks(
    run_dir: Path, one_thread: None, capture_direct_forwards: bool
) -> None:
    model = hooked_model()
    result = run_both(
        model, step, run_dir, steps=2, capture_direct_forwards=capture_direct_forwards
    )
    assert model.calls == 2
    result.assert_conforms()
    assert set(result.history["layer"]) == {"0", "1", "2", "3", "4"}
    for observed, reference in zip(result.observed_outputs, result.reference_outputs, strict=True):
        assert torch.equal(observed, reference)  # the user's hooks changed the result alike
