"""The conformance reference: plain PyTorch hooks on a deep copy, reduced with NumPy.

Independent of the library on purpose. `register_forward_hook(..., prepend=True)` sees what each
module's forward returned (before any other forward hook, such as a tensor-parallel style's
output conversion, changes it), and `Tensor.register_hook` on each returned tensor, registered
right then, sees the gradient into that tensor as that module returned it (its autograd node at
return time: a later in-place op on the same object does not move the hook). Statistics come from
NumPy over float64 copies of the values, as design.md defines them: over the finite entries
mean, population std, min, max, p25/p50/p75 (linear interpolation), and over all entries
zero_fraction and nonfinite_fraction.

What a reference tensor is, where a tensor is not a plain one:
- nested tensor: the entries of its components (padding excluded); shape None.
- DTensor: Replicate describes the whole tensor and Shard(d) this rank's local shard (both: the
  values of `to_local()`); Partial holds partial sums, not the layer's output, so its row is
  null with a reason that says "partial". Shape: that of the local tensor the values describe.
  Its rows carry `placement` ("Shard(1)", "Replicate", "Partial(sum)"; one per mesh dimension,
  comma-separated) and `mesh_coordinate` (this rank's coordinate in the mesh); plain tensors
  carry null in both.
- torch.func: the reference is the plain model run without the transform (see the zoo's cases).
- wrapper subclass (`__torch_dispatch__` over inner tensors, no storage of its own: TwoTensor):
  its entries as the subclass itself reads them, one `float()` each (for TwoTensor, whose ops run
  on both inner tensors and whose scalars are its first's, that first tensor's values); the
  values a user gets from `out.min().item()` and the like on the plain model's output.
- complex and quantized tensors: null with "unsupported dtype <dtype>" (complex values have no
  order for min, max and percentiles; the statistics are not taken of a part of them).
- float4_e2m1fn_x2 (two 4-bit floats packed in each byte, which torch cannot convert to any other
  dtype): null with a reason that says "packed dtype".

Unused outputs: a backward pass that reaches an autograd node with several outputs (`split`, a
custom Function) calls the hook of an output the loss never used with None. That is no gradient:
no row from that pass, and the output's gradient is the first a later pass brings.

Shared outputs: a tensor (one autograd identity) returned by one layer in several calls before a
backward receives the sum of the gradients of all its uses; that sum belongs to no single call,
so each of those rows is null with a reason saying "shared output".

`assert_conforms` compares in both directions: every reference tensor has a row (or a stated
reason for its absence, `unrecorded`), and every row has a reference tensor.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

Key = tuple[str, int, str, str]  # layer, call_index, signal, tensor_path
SampleKey = tuple[int, str, int, str, str]  # sample_id, layer, call_index, signal, tensor_path

METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")
MOMENTS = ("mean", "std")
FRACTIONS = ("zero_fraction", "nonfinite_fraction")
FINITE_ONLY = ("mean", "std", "min", "max", "p25", "p50", "p75")
PARTIAL_REASON = r"(?i)partial"
SHARED_REASON = r"^shared output"


def during_backward() -> bool:
    """Whether the autograd engine runs a backward pass on this thread (a module called now is
    called by it: checkpointing's recomputation)."""
    return torch._C._current_graph_task_id() != -1


# --- NumPy statistics --------------------------------------------------------------------------


def _float64_values(tensor: torch.Tensor) -> np.ndarray:
    """All entries of a plain, nested or wrapper-subclass tensor as a flat float64 array on the
    host (a wrapper subclass's as it reads them itself: `.numpy()` refuses it)."""
    if tensor.is_nested:  # a jagged one is a wrapper subclass too, read by its components
        parts = [c.detach().to(torch.float64).cpu().numpy().ravel() for c in tensor.unbind()]
        return np.concatenate(parts) if parts else np.zeros(0)
    if is_traceable_wrapper_subclass(tensor):
        entries = tensor.detach().reshape(-1).unbind()
        return np.array([float(entry) for entry in entries], dtype=np.float64)
    return tensor.detach().to(torch.float64).cpu().numpy().ravel()


def profile_of_values(values: np.ndarray) -> tuple[dict[str, float | None], str | None]:
    """The default profile of flat float64 `values`, and the reason for its nulls (if any)."""
    if values.size == 0:
        return dict.fromkeys(METRICS), r"^empty tensor$"
    finite = values[np.isfinite(values)]
    out: dict[str, float | None] = {
        "zero_fraction": float(np.count_nonzero(values == 0)) / values.size,
        "nonfinite_fraction": float(values.size - finite.size) / values.size,
    }
    if finite.size == 0:
        out.update(dict.fromkeys(FINITE_ONLY))
        return out, r"^no finite entries$"
    p25, p50, p75 = np.percentile(finite, [25, 50, 75], method="linear")
    out.update(
        mean=float(np.mean(finite)),
        std=float(np.std(finite)),
        min=float(finite.min()),
        max=float(finite.max()),
        p25=float(p25),
        p50=float(p50),
        p75=float(p75),
    )
    return out, None


def numpy_profile(tensor: torch.Tensor) -> dict[str, float]:
    """The default profile of a tensor with finite entries (nested: over its components)."""
    values, reason = profile_of_values(_float64_values(tensor))
    assert reason is None, reason
    return {name: value for name, value in values.items() if value is not None}


# --- what a reference tensor describes ---------------------------------------------------------


@dataclass
class ReferenceTensor:
    """What the row(s) of one tensor should say.

    `values[m] is None` means a null with a reason matching `reason` (a regex; None: any reason).
    `scale` is the largest finite magnitude (for the moments' absolute tolerance).
    """

    values: dict[str, float | None]
    reason: str | None
    shape: tuple[int, ...] | None
    dtype: str
    scale: float = 0.0
    placement: str | None = None
    mesh_coordinate: tuple[int, ...] | None = None


def placement_label(placement: Any) -> str:
    """One DTensor placement as design.md's rows name it: Shard(d), Replicate, Partial(op)."""
    if placement.is_shard():
        return f"Shard({placement.dim})"
    if placement.is_partial():
        return f"Partial({placement.reduce_op})"
    return "Replicate"


def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch without distributed
        return None
    return DTensor


def reference_tensor(tensor: torch.Tensor) -> ReferenceTensor:
    """The reference row of `tensor` (see the module docstring for nested tensors and DTensor)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        placements = tuple(tensor.placements)
        label = ", ".join(placement_label(p) for p in placements)
        coordinate = tensor.device_mesh.get_coordinate()
        mesh_coordinate = None if coordinate is None else tuple(int(c) for c in coordinate)
        shape = tuple(int(s) for s in tensor.to_local().shape)
        if any(p.is_partial() for p in placements):
            nulls = dict.fromkeys(METRICS)
            return ReferenceTensor(nulls, PARTIAL_REASON, shape, dtype, 0.0, label, mesh_coordinate)
        row = reference_tensor(tensor.to_local())
        row.placement, row.mesh_coordinate = label, mesh_coordinate
        return row
    shape = None if tensor.is_nested else tuple(int(s) for s in tensor.shape)
    nulls = dict.fromkeys(METRICS)
    if tensor.is_complex() or tensor.is_quantized:
        return ReferenceTensor(nulls, rf"^unsupported dtype {dtype}$", shape, dtype)
    if tensor.dtype == torch.float4_e2m1fn_x2:
        return ReferenceTensor(nulls, rf"^packed dtype {dtype}: ", shape, dtype)
    values = _float64_values(tensor)
    profile, reason = profile_of_values(values)
    finite = values[np.isfinite(values)]
    scale = float(np.abs(finite).max()) if finite.size else 0.0
    return ReferenceTensor(profile, reason, shape, dtype, scale)


def shared_reference(like: ReferenceTensor) -> ReferenceTensor:
    """A gradient several calls of one layer share: null with the shared-output reason."""
    return dataclasses.replace(like, values=dict.fromkeys(METRICS), reason=SHARED_REASON)


def output_tensors(output: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a forward's output with its tensor_path, as design.md spells paths.

    Tuples and lists `[i]`, mappings `['key']` (a Hugging Face ModelOutput is one), namedtuples
    (torch's own too: `torch.return_types`, which PyTorch documents as named tuples, by the
    fields `__match_args__` lists) and dataclasses `.field`; anything else is opaque (a Cache
    object, a string). Each object is visited once: a tensor reachable twice is described at its
    first path. A second tensor at a path already given (mapping keys whose repr is the same)
    gets `#1` appended (`#2`, ...). A key is named by its repr without any memory address.
    """
    found: list[tuple[str, torch.Tensor]] = []
    _collect(output, "", set(), found, 0)
    return found


def _collect(obj: Any, path: str, seen: set[int], found: list, depth: int) -> None:
    """Depth-first walk behind `output_tensors`."""
    if id(obj) in seen or depth > 16 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        seen.add(id(obj))
        given = {p for p, _ in found}
        number = 0
        while (f"{path}#{number}" if number else path) in given:  # keys alike: `#1`, `#2`
            number += 1
        found.append((f"{path}#{number}" if number else path, obj))
        return
    if isinstance(obj, str | bytes | int | float | bool):
        return
    seen.add(id(obj))
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            name = repr(key)
            if not isinstance(key, str | bytes):  # a memory address, not a string's own text
                name = re.sub(r" at 0x[0-9a-fA-F]+", "", name)
            _collect(value, f"{path}[{name}]", seen, found, depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name, value in zip(obj._fields, obj, strict=False):
            _collect(value, f"{path}.{name}", seen, found, depth + 1)
    elif type(obj).__module__ == "torch.return_types":
        for name in type(obj).__match_args__:
            _collect(getattr(obj, name), f"{path}.{name}", seen, found, depth + 1)
    elif isinstance(obj, tuple | list):
        for index, value in enumerate(obj):
            _collect(value, f"{path}[{index}]", seen, found, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for item in dataclasses.fields(obj):
            _collect(getattr(obj, item.name, None), f"{path}.{item.name}", seen, found, depth + 1)


# Modules that hand some children's weights or settings to a functional kernel and never call
# those children (read from their source): each is one layer, and those children are not layers.
HELD_NOT_CALLED = {
    "torch.nn.modules.activation.MultiheadAttention": ("out_proj",),
    "torchvision.models.swin_transformer.ShiftedWindowAttention": ("qkv", "proj"),
    "torchvision.models.swin_transformer.ShiftedWindowAttentionV2": ("qkv", "proj"),
    "transformers.models.mamba.modeling_mamba.MambaMixer": ("conv1d", "dt_proj"),
    "transformers.models.bert.modeling_bert.BertSelfAttention": ("dropout",),  # its rate, `p`
    "transformers.models.roberta.modeling_roberta.RobertaSelfAttention": ("dropout",),
    "transformers.models.distilbert.modeling_distilbert.DistilBertSelfAttention": ("dropout",),
    "transformers.models.albert.modeling_albert.AlbertAttention": ("attention_dropout",),
    # Passes `attn_dropout`'s rate on every forward; calls it only with reorder_and_upcast_attn.
    "transformers.models.gpt2.modeling_gpt2.GPT2Attention": ("attn_dropout",),
}


def _computes_nothing(module: nn.Module) -> bool:
    """A module class that defines no forward (ModuleList, ModuleDict), or nn.Sequential itself
    (the class's attribute as stored: TorchScript's raises when read through the class)."""
    forward = next(c.__dict__["forward"] for c in type(module).__mro__ if "forward" in c.__dict__)
    return forward is nn.Module.forward or forward is nn.Sequential.forward


def default_layer_names(model: nn.Module) -> list[str]:
    """The layers design.md's default rule selects, computed here independently: every leaf
    module but those that compute nothing (no forward of their own class, or an empty
    nn.Sequential); the modules of `HELD_NOT_CALLED` as one layer each, without the children they
    never call; a module parametrized by torch.nn.utils.parametrize as one layer (its
    `parametrizations`, which compute its weights, are not layers); and no TorchScript module,
    nor any module inside one."""
    names: list[str] = []
    skipped: list[str] = []
    for name, module in model.named_modules():
        if any(name == top or name.startswith(f"{top}.") for top in skipped):
            continue
        if isinstance(module, torch.jit.ScriptModule):  # compiled: no forward to replace
            skipped.append(name)
            continue
        children = dict(module.named_children())
        if torch.nn.utils.parametrize.is_parametrized(module):
            del children["parametrizations"]
            skipped.append(f"{name}.parametrizations" if name else "parametrizations")
        passed = HELD_NOT_CALLED.get(f"{type(module).__module__}.{type(module).__qualname__}")
        if passed:
            skipped += [f"{name}.{child}" if name else child for child in passed]
            names.append(name)
        elif not children and not _computes_nothing(module):
            names.append(name)
    return names


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
    return problems


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
