"""The conformance reference's values: which tensors a forward returned, what each one's rows
should say, and its statistics with NumPy.

Independent of the library on purpose. Statistics come from NumPy over float64 copies of the values, as design.md defines them: over the finite entries
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
- complex tensors: null with "unsupported dtype <dtype>" (complex values have no order for min,
  max and percentiles; the statistics are not taken of a part of them).
- quantized tensors: the reals they stand for, as `out.dequantize()` gives them.
- float4_e2m1fn_x2 (two 4-bit floats packed in each byte, which torch cannot convert to any other
  dtype): null with a reason that says "packed dtype".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite_fraction")


MOMENTS = ("mean", "std")


FRACTIONS = ("zero_fraction", "nonfinite_fraction")


FINITE_ONLY = ("mean", "std", "min", "max", "p25", "p50", "p75")


PARTIAL_REASON = r"(?i)partial"


SHARED_REASON = r"^shared output"


EMPTY_REASON = r"^empty tensor$"


NO_FINITE_REASON = r"^no finite entries$"


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
        return dict.fromkeys(METRICS), EMPTY_REASON
    finite = values[np.isfinite(values)]
    out: dict[str, float | None] = {
        "zero_fraction": float(np.count_nonzero(values == 0)) / values.size,
        "nonfinite_fraction": float(values.size - finite.size) / values.size,
    }
    if finite.size == 0:
        out.update(dict.fromkeys(FINITE_ONLY))
        return out, NO_FINITE_REASON
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
    if tensor.is_complex():
        return ReferenceTensor(nulls, rf"^unsupported dtype {dtype}$", shape, dtype)
    if tensor.is_quantized:
        tensor = tensor.dequantize()
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
    # torch's quantized Linear (dynamic and static) hands its packed weights to its kernel.
    "torch.ao.nn.quantized.dynamic.modules.linear.Linear": ("_packed_params",),
    "torch.ao.nn.quantized.modules.linear.Linear": ("_packed_params",),
}


def _computes_nothing(module: nn.Module) -> bool:
    """A module class that defines no forward (ModuleList, ModuleDict), or nn.Sequential itself
    (the class's attribute as stored: TorchScript's raises when read through the class)."""
    forward = next(c.__dict__["forward"] for c in type(module).__mro__ if "forward" in c.__dict__)
    return forward is nn.Module.forward or forward is nn.Sequential.forward


def default_layer_names(model: nn.Module) -> list[str]:
    """The layers design.md's default rule selects, computed here independently: every leaf
    module but those that compute nothing (no forward of their own class, or an empty
    nn.Sequential), where children in which nothing computes (an nn.ParameterList) do not
    count; the modules of `HELD_NOT_CALLED` as one layer each, without the children they
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
        children = {
            child: sub
            for child, sub in module.named_children()
            if any(  # a child in which nothing computes (a ParameterList) does not count
                isinstance(inner, torch.jit.ScriptModule) or not _computes_nothing(inner)
                for inner in sub.modules()
            )
        }
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
