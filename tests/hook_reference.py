"""The conformance reference: plain PyTorch hooks on a deep copy, reduced with NumPy.

Independent of the library on purpose. `register_forward_hook(..., prepend=True)` sees what each
module's forward returned (before any other forward hook, such as a tensor-parallel style's
output conversion, changes it), and `Tensor.register_hook` on each returned tensor, registered
right then, sees the gradient into that tensor as that module returned it (its autograd node at
return time: a later in-place op on the same object does not move the hook). What a reference
tensor is, and its statistics with NumPy (as design.md defines them), is `reference_values`'.

Unused outputs: a backward pass that reaches an autograd node with several outputs (`split`, a
custom Function) calls the hook of an output the loss never used with None. That is no gradient:
no row from that pass, and the output's gradient is the first a later pass brings.

Shared outputs: a tensor (one autograd identity) returned by one layer in several calls before a
backward receives the sum of the gradients of all its uses; that sum belongs to no single call,
so each of those rows is null with a reason saying "shared output".

`assert_conforms` compares in both directions: every reference tensor has a row (or a stated
reason for its absence, `unrecorded`), and every row has a reference tensor. Where a run has the
ready `AbsMax` reducer beside the default profile, its `abs_max` rows are compared too: NumPy's
largest finite magnitude, or null (with the profile's reason where the tensor cannot be measured).
"""

from __future__ import annotations

import copy
import json
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from reference_values import (
    EMPTY_REASON,
    FRACTIONS,
    METRICS,
    MOMENTS,
    NO_FINITE_REASON,
    ReferenceTensor,
    default_layer_names,
    output_tensors,
    reference_tensor,
    shared_reference,
)

Key = tuple[str, int, str, str]  # layer, call_index, signal, tensor_path
SampleKey = tuple[int, str, int, str, str]  # sample_id, layer, call_index, signal, tensor_path


def during_backward() -> bool:
    """Whether the autograd engine runs a backward pass on this thread (a module called now is
    called by it: checkpointing's recomputation)."""
    return torch._C._current_graph_task_id() != -1


# --- the recorder on the copy ------------------------------------------------------------------


class HookRecorder:
    """Forward hooks on the named modules of a model; gradient hooks on what they return.

    Root forward `i` of `model` is sample `i // every` when `i % every == 0` (as
    EveryNForwardsSampler(every) decides); each call of a named module inside a sampled root
    forward is recorded in `tensors[(sample_id, layer, call_index, signal, tensor_path)]`, and
    the gradient into each returned tensor under signal "output_gradient". `profiles` holds the
    latest sample as plain metric dicts (the shape older tests compare).

    `call_index` numbers a layer's invocations in the order they begin, as design.md defines a
    call (the n-th invocation): a forward pre-hook, run after any other pre-hook (so once the
    inputs the forward gets are final), takes the number, and the forward hook of that call
    records under it. So a call made inside a call of the same layer (a module that calls
    itself, or the root called inside its own forward) comes after the call that made it, and
    a call that raised keeps its number (and has no rows), even when the model caught the
    exception and called the layer again.

    A call the autograd engine makes during a backward pass (activation checkpointing
    recomputing a block, or the whole model under `checkpoint(model, x)`) is torch's
    recomputation of calls already seen: of the model, no root forward (not counted); of a
    layer, no call, even inside a root forward that runs a backward itself (`autograd.grad`).
    """

    def __init__(self, model: nn.Module, names: Iterable[str], every: int = 1) -> None:
        self.sample_id: int | None = None
        self.tensors: dict[SampleKey, ReferenceTensor] = {}
        self.calls: dict[str, int] = {}
        # Per thread and layer, the call_index (None outside a sampled forward) of each call
        # begun and not yet returned, innermost last: on one thread, calls of one layer return
        # in the reverse order they began.
        self._open: dict[tuple[int, str], list[int | None]] = {}
        self.root_forwards = 0
        self._every = every
        self._depth = 0
        # Per root call begun and not yet ended, innermost last: whether it is a root forward
        # or part of one (False: a recomputation during a backward pass).
        self._root_calls: list[bool] = []
        # Unfired gradient hooks by autograd identity: the keys of every call that returned it.
        self._uses: dict[tuple[int, int, int], list[SampleKey]] = {}
        self._alive: list[Any] = []
        modules = dict(model.named_modules())
        self.names = list(names)
        # A root forward delimits a sample: a module run outside one (checkpointing's recompute
        # during backward) is not a call of a sampled forward. The end hook is registered first
        # and the layer hooks prepended, so a root that is itself a layer is recorded before.
        model.register_forward_pre_hook(self._begin_root)
        model.register_forward_hook(self._end_root, always_call=True)  # also when it raises
        for name in self.names:
            # Appended, so after `_begin_root`: a root that is a layer numbers its call in the
            # sample that call opens.
            modules[name].register_forward_pre_hook(self._call_begins(name))
            # always_call: a call that raised gives its number back (and records nothing).
            modules[name].register_forward_hook(
                self._forward_hook(name), prepend=True, always_call=True
            )

    @property
    def profiles(self) -> dict[Key, dict[str, float]]:
        """The latest sample's rows, metric -> value (older tests' view)."""
        latest = max((key[0] for key in self.tensors), default=None)
        return {
            key[1:]: {m: v for m, v in row.values.items() if v is not None}  # type: ignore[misc]
            for key, row in self.tensors.items()
            if key[0] == latest
        }

    def _begin_root(self, module: nn.Module, args: Any) -> None:
        recomputed = self._depth == 0 and during_backward()
        self._root_calls.append(not recomputed)
        if recomputed:
            return
        self._depth += 1
        if self._depth > 1:
            return  # a root call inside a root forward belongs to it
        index = self.root_forwards
        self.root_forwards += 1
        self.sample_id = index // self._every if index % self._every == 0 else None
        self.calls = {}

    def _end_root(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._root_calls.pop():
            return
        self._depth -= 1
        if self._depth == 0:
            self.sample_id = None

    def _call_begins(self, name: str) -> Callable[..., None]:
        """The forward pre-hook that gives a call of `name` its call_index as it begins."""

        def pre_hook(module: nn.Module, args: Any) -> None:
            call_index = None
            if self.sample_id is not None and not during_backward():
                call_index = self.calls.get(name, 0)
                self.calls[name] = call_index + 1
            self._open.setdefault((threading.get_ident(), name), []).append(call_index)

        return pre_hook

    def _forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            open_calls = self._open.get((threading.get_ident(), name))
            if not open_calls:
                return  # its pre-hook never ran: an earlier pre-hook raised
            call_index = open_calls.pop()
            if self.sample_id is None or call_index is None:
                return
            for path, tensor in output_tensors(output):
                key = (self.sample_id, name, call_index, "output", path)
                self.tensors[key] = reference_tensor(tensor)
                if tensor.requires_grad and torch.is_grad_enabled():
                    self._hook_gradient(tensor, (self.sample_id, name, call_index, path))

        return hook

    def _hook_gradient(self, tensor: torch.Tensor, where: tuple[int, str, int, str]) -> None:
        """One hook per autograd identity (tensor object, node, output number) at return time."""
        sample_id, name, call_index, path = where
        gradient_key = (sample_id, name, call_index, "output_gradient", path)
        node = tensor.grad_fn
        # Held for the recorder's life, so no id below is reused by a later object.
        self._alive.append((tensor, node))
        identity = (id(tensor), id(node), tensor.output_nr)
        uses = self._uses.get(identity)
        if uses is not None:
            uses.append(gradient_key)
            return
        uses = [gradient_key]
        self._uses[identity] = uses

        def on_gradient(grad: torch.Tensor | None) -> None:
            if grad is None:
                return  # no gradient: the pass reached its node through another output only
            if self._uses.get(identity) is not uses:
                return  # fired before: the first backward that reaches an output counts
            del self._uses[identity]
            row = reference_tensor(grad)
            per_layer: dict[str, int] = {}
            for key in uses:
                per_layer[key[1]] = per_layer.get(key[1], 0) + 1
            for key in uses:
                shared = per_layer[key[1]]
                self.tensors[key] = row if shared == 1 else shared_reference(row)

        tensor.register_hook(on_gradient)


# --- the observed side -------------------------------------------------------------------------


@dataclass
class ObservedTensor:
    """The rows of one tensor in history.parquet."""

    values: dict[str, float | None] = field(default_factory=dict)
    reasons: dict[str, str | None] = field(default_factory=dict)
    shape: tuple[int, ...] | None = None
    dtype: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def observed_tensors(history: pl.DataFrame) -> dict[SampleKey, ObservedTensor]:
    """history.parquet grouped by tensor: (sample_id, layer, call_index, signal, tensor_path)."""
    known = {"sample_id", "layer", "call_index", "signal", "tensor_path", "metric", "value"}
    known |= {"unavailable_reason", "shape", "dtype"}
    out: dict[SampleKey, ObservedTensor] = {}
    for row in history.iter_rows(named=True):
        key = (row["sample_id"], row["layer"], row["call_index"], row["signal"], row["tensor_path"])
        entry = out.setdefault(key, ObservedTensor())
        entry.values[row["metric"]] = row["value"]
        entry.reasons[row["metric"]] = row["unavailable_reason"]
        entry.shape = None if row["shape"] is None else tuple(row["shape"])
        entry.dtype = row["dtype"]
        entry.extra = {k: v for k, v in row.items() if k not in known}
    return out


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


# --- the comparison ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """How close a value must be to NumPy's, per kind of metric.

    On the CPU both sides reduce the very same values in float64: moments agree to rounding
    (relative 1e-9, plus 1e-12 of the largest magnitude for means near 0), order statistics
    and fractions to the last bits. On an accelerator the observed and the reference runs are
    two runs of the model, which may differ in the last bits of float32 kernels.
    """

    moments: float = 1e-9
    order: float = 1e-12
    fractions: float = 1e-12

    def close(self, metric: str, got: float, want: float, scale: float) -> bool:
        if metric in MOMENTS:
            return abs(got - want) <= self.moments * (abs(want) + scale) + 1e-300
        if metric in FRACTIONS:
            return abs(got - want) <= self.fractions
        return abs(got - want) <= self.order * max(abs(want), scale) + 1e-300


CPU_TOLERANCE = Tolerance()
ACCELERATOR_TOLERANCE = Tolerance(moments=1e-5, order=1e-5, fractions=1e-3)


def _coordinate(value: Any) -> tuple[int, ...] | None:
    """A mesh_coordinate cell (a list, or null) as a tuple."""
    return None if value is None else tuple(int(c) for c in value)


def compare(
    observed: Mapping[SampleKey, ObservedTensor],
    reference: Mapping[SampleKey, ReferenceTensor],
    *,
    tolerance: Tolerance = CPU_TOLERANCE,
    compare_shapes: bool = True,
    unrecorded: Mapping[SampleKey, str] | None = None,
) -> list[str]:
    """Every difference between the rows and the reference, both directions, as lines."""
    problems: list[str] = []
    unrecorded = unrecorded or {}
    for key in sorted(set(observed) - set(reference), key=str):
        problems.append(f"row without a reference tensor: {key}")
    for key in sorted(set(reference) - set(observed), key=str):
        if key not in unrecorded:
            problems.append(f"reference tensor without a row (and no stated reason): {key}")
    for key in sorted(set(reference) & set(observed), key=str):
        want, got = reference[key], observed[key]
        if compare_shapes and (got.shape, got.dtype) != (want.shape, want.dtype):
            problems.append(
                f"{key}: shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}"
            )
        placed = (got.extra.get("placement"), _coordinate(got.extra.get("mesh_coordinate")))
        if placed != (want.placement, want.mesh_coordinate):
            wanted = (want.placement, want.mesh_coordinate)
            problems.append(f"{key}: placement, mesh_coordinate {placed} != {wanted}")
        for metric in METRICS:
            if metric not in got.values:
                problems.append(f"{key}: no {metric} row")
                continue
            value, reason = got.values[metric], got.reasons.get(metric)
            expected = want.values[metric]
            if expected is None:
                if value is not None or reason is None:
                    problems.append(f"{key} {metric}: {value} ({reason}), expected null + reason")
                elif want.reason is not None and not re.search(want.reason, reason):
                    problems.append(f"{key} {metric}: reason {reason!r} !~ {want.reason!r}")
            elif value is None:
                problems.append(f"{key} {metric}: null ({reason}), expected {expected!r}")
            elif not (
                math.isfinite(value) and tolerance.close(metric, value, expected, want.scale)
            ):
                problems.append(f"{key} {metric}: {value!r} != {expected!r} (NumPy)")
        problems += _abs_max_problems(key, got, want, tolerance)
    return problems


def _abs_max_problems(
    key: SampleKey, got: ObservedTensor, want: ReferenceTensor, tolerance: Tolerance
) -> list[str]:
    """The ready `AbsMax` reducer's row, where the run has one (the custom path runs it beside
    the default profile): the largest finite magnitude, NumPy's `want.scale`; where the default
    profile has no max, null, and for a tensor that cannot be measured at all (its dtype, its
    device, partial sums) with the profile's own reason."""
    if "abs_max" not in got.values:
        return []
    value, reason = got.values["abs_max"], got.reasons.get("abs_max")
    if want.values["max"] is None:
        if value is not None or reason is None:
            return [f"{key} abs_max: {value} ({reason}), expected null + reason"]
        if want.reason in (EMPTY_REASON, NO_FINITE_REASON, None) or re.search(want.reason, reason):
            return []
        return [f"{key} abs_max: reason {reason!r} !~ {want.reason!r}"]
    if value is None or not tolerance.close("max", value, want.scale, want.scale):
        return [f"{key} abs_max: {value!r} ({reason}) != {want.scale!r} (NumPy)"]
    return []


def assert_conforms(
    history: pl.DataFrame,
    recorder: HookRecorder,
    *,
    tolerance: Tolerance = CPU_TOLERANCE,
    compare_shapes: bool = True,
    unrecorded: Mapping[SampleKey, str] | None = None,
) -> None:
    """history.parquet equals the reference in both directions (see `compare`)."""
    problems = compare(
        observed_tensors(history),
        recorder.tensors,
        tolerance=tolerance,
        compare_shapes=compare_shapes,
        unrecorded=unrecorded,
    )
    shown = "\n  ".join(problems[:40])
    more = f"\n  ... {len(problems) - 40} more" if len(problems) > 40 else ""
    assert not problems, f"{len(problems)} differences from plain hooks:\n  {shown}{more}"


# --- running one model both ways ---------------------------------------------------------------

Step = Callable[[nn.Module, int], Any]


@dataclass
class Conformance:
    """One model observed and, on a deep copy, hooked; what both saw."""

    history: pl.DataFrame
    recorder: HookRecorder
    layers: list[str]
    catalog: list[str]
    observed_outputs: list[Any]
    reference_outputs: list[Any]

    def assert_conforms(self, **kwargs: Any) -> None:
        """The catalog lists the reference's layers, and every row equals the reference."""
        assert self.catalog == self.layers
        assert_conforms(self.history, self.recorder, **kwargs)


def run_both(
    model: nn.Module,
    step: Step,
    run_dir: Path,
    *,
    reference_step: Step | None = None,
    steps: int = 1,
    every: int = 1,
    prepare: Callable[[nn.Module], Any] | None = None,
    prepare_both: Callable[[nn.Module], Any] | None = None,
    names: list[str] | None = None,
    **inject_kwargs: Any,
) -> Conformance:
    """Observe `model` for `steps` steps and run a deep copy of it with plain hooks.

    `step(model, i)` is one step (forward, and backward if any), seeded identically on both sides
    (`torch.manual_seed(1000 + i)` before it). `reference_step` replaces it on the copy (a
    torch.func step's plain equivalent). `prepare` turns the model into what is observed (e.g.
    `torch.compile`); the copy runs eagerly. `prepare_both` changes the model and the copy alike
    before anything is attached (e.g. `parallelize_module`, `fully_shard`, which a deep copy of an
    already distributed model would not reproduce). Forward `i` is sampled when `i % every == 0`.
    """
    reference_model = copy.deepcopy(model)
    if prepare_both is not None:
        prepare_both(model)
        prepare_both(reference_model)
    layers = names if names is not None else default_layer_names(reference_model)
    recorder = HookRecorder(reference_model, layers, every)
    observed_model = prepare(model) if prepare is not None else model
    directory = inject_observer(
        observed_model, output_dir=run_dir, sampler=EveryNForwardsSampler(every), **inject_kwargs
    )
    assert directory is not None
    observed_outputs = []
    try:
        for i in range(steps):
            torch.manual_seed(1000 + i)
            observed_outputs.append(step(observed_model, i))
    finally:
        remove_observer(observed_model)
    reference_outputs = []
    for i in range(steps):
        torch.manual_seed(1000 + i)
        reference_outputs.append((reference_step or step)(reference_model, i))
    history = pl.read_parquet(directory / "history.parquet")
    result = json.loads((directory / "result.json").read_text("utf-8"))
    catalog = [entry["layer"] for entry in result]
    return Conformance(history, recorder, layers, catalog, observed_outputs, reference_outputs)


def leaves(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a step's result, for comparing the two runs' results."""
    for _, tensor in output_tensors(output):
        yield tensor
