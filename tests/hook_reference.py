"""Reference recordings made with plain PyTorch hooks on a deep copy, reduced with NumPy.

Independent of the library on purpose: `register_forward_hook` sees each module call, and
`Tensor.register_hook` on what it returned sees the gradient into that output; statistics come
from NumPy over float64 copies of the values. Tests compare these against history.parquet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import polars as pl
import torch
from torch import nn

Key = tuple[str, int, str, str]  # layer, call_index, signal, tensor_path


def numpy_profile(tensor: torch.Tensor) -> dict[str, float]:
    """The default profile of `tensor`, computed with NumPy (population std, linear quartiles);
    a nested tensor over the entries of its components."""
    if tensor.is_nested:
        everything = np.concatenate([c.detach().double().numpy().ravel() for c in tensor.unbind()])
    else:
        everything = tensor.detach().to(torch.float64).cpu().numpy().ravel()
    finite = everything[np.isfinite(everything)]
    return {
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "min": float(finite.min()),
        "max": float(finite.max()),
        "p25": float(np.percentile(finite, 25)),
        "p50": float(np.percentile(finite, 50)),
        "p75": float(np.percentile(finite, 75)),
        "zero_fraction": float(np.mean(everything == 0)),
        "nonfinite_fraction": float(np.mean(~np.isfinite(everything))),
    }


def output_tensors(output: Any) -> list[tuple[str, torch.Tensor]]:
    """A bare tensor at `""`, or the tensors of a tuple/list at `[i]` (enough for these models)."""
    if isinstance(output, torch.Tensor):
        return [("", output)]
    if isinstance(output, tuple | list):
        return [(f"[{i}]", t) for i, t in enumerate(output) if isinstance(t, torch.Tensor)]
    return []


class HookRecorder:
    """Forward hooks on the named modules of a model; gradient hooks on what they return.

    `profiles[key]` is the NumPy profile of each output (signal "output") and of the gradient into
    it ("output_gradient"), for the forwards run since the last `reset()`.
    """

    def __init__(self, model: nn.Module, names: Iterable[str]) -> None:
        self.profiles: dict[Key, dict[str, float]] = {}
        self.calls: dict[str, int] = {}
        modules = dict(model.named_modules())
        for name in names:
            modules[name].register_forward_hook(self._forward_hook(name))

    def reset(self) -> None:
        self.profiles = {}
        self.calls = {}

    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            call_index = self.calls.get(name, 0)
            self.calls[name] = call_index + 1
            for path, tensor in output_tensors(output):
                self.profiles[(name, call_index, "output", path)] = numpy_profile(tensor)
                if tensor.requires_grad:
                    tensor.register_hook(self._gradient_hook((name, call_index, path)))

        return hook

    def _gradient_hook(self, where: tuple[str, int, str]) -> Any:
        name, call_index, path = where

        def hook(grad: torch.Tensor) -> None:
            self.profiles.setdefault(
                (name, call_index, "output_gradient", path), numpy_profile(grad)
            )

        return hook


def observed_profiles(history: pl.DataFrame, sample_id: int) -> dict[Key, dict[str, float | None]]:
    """The rows of one sample in history.parquet, shaped like `HookRecorder.profiles`."""
    out: dict[Key, dict[str, float | None]] = {}
    for row in history.filter(pl.col("sample_id") == sample_id).iter_rows(named=True):
        key = (row["layer"], row["call_index"], row["signal"], row["tensor_path"])
        out.setdefault(key, {})[row["metric"]] = row["value"]
    return out


def assert_profiles_match(
    observed: dict[Key, dict[str, float | None]],
    reference: dict[Key, dict[str, float]],
    *,
    rel: float = 1e-6,
    abs_: float = 1e-7,
) -> None:
    """Same tensors on both sides, and every metric equal within a float32-rounding tolerance."""
    assert sorted(observed) == sorted(reference)
    for key, metrics in reference.items():
        for metric, expected in metrics.items():
            got = observed[key][metric]
            assert got is not None, (key, metric)
            assert abs(got - expected) <= abs_ + rel * abs(expected), (key, metric, got, expected)
