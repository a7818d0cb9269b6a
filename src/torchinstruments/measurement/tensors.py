"""Per-tensor rules shared by the statistics, the histograms and the observer, one copy each,
so a tensor's statistics and histogram never disagree about whether or how it is measured:

- Supported: floating (not packed float4), integer or bool dtypes, and quantized ones as the
  reals they stand for; complex and packed ones get null metrics with a reason and no histogram.
- What is measured is the `measured_form`: torch.func wrappers unwrapped (`TORCH_FUNC_NOTE`); a
  DTensor's local tensor, no collective (`DTENSOR_NOTE`); a nested tensor's component entries,
  padding excluded, with a null shape (nn.TransformerEncoder returns them in eval under
  no_grad); a sparse or other non-strided tensor densified, refused above `DENSE_MAX` entries; a
  quantized tensor (a static quantized layer's quint8 output) dequantized, as a user's own hook
  reads it (`out.dequantize()`): its dtype column stays the quantized one.
- Working dtype: float64 stays float64, other floats are read as float32, integers and bools as
  float64 (beyond 2**53 rounded to the nearest).
- Host syncs are free on the CPU only, so only the CPU paths read values back mid-reduction.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from torchinstruments import reasons
from torchinstruments._torch_internals import is_functorch_wrapped, unwrap_functorch

__all__ = [
    "DENSE_MAX",
    "TORCH_FUNC_NOTE",
    "MeasuredForm",
    "dtensor_class",
    "dtype_name",
    "host_floats",
    "host_sync_is_free",
    "is_plain",
    "is_real_dtype",
    "measured_form",
    "shape_of",
    "unsupported_reason",
    "working_dtype",
    "working_values",
]

_INTEGRAL = frozenset(
    {torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
    | {torch.int8, torch.int16, torch.int32, torch.int64}
)


def dtensor_class() -> type | None:
    """torch's DTensor class, or None where `torch.distributed.tensor` was never imported: then
    no DTensor exists, and importing it here would cost seconds at the first measurement."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `float32`."""
    return str(dtype).removeprefix("torch.")


def is_real_dtype(dtype: torch.dtype) -> bool:
    """Floating (not packed: float4_e2m1fn_x2), integer or bool: a dtype torch reads as reals."""
    return dtype != torch.float4_e2m1fn_x2 and (dtype.is_floating_point or dtype in _INTEGRAL)


def unsupported_reason(tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot be measured at all, or None when it can."""
    if tensor.layout != torch.strided or tensor.is_nested:
        return reasons.unsupported_layout(tensor.layout)
    if not is_real_dtype(tensor.dtype):
        return reasons.unsupported_dtype(dtype_name(tensor.dtype))
    return None


# What index.md (and one warning) says when a run measured wrapped or distributed tensors.
TORCH_FUNC_NOTE = (
    "torch.func: layers returned tensors wrapped by a transform (grad, jacrev, jvp, jacfwd, vmap); "
    "they are measured as the values the plain model computes (unwrapped): under vmap over the "
    "whole underlying batch, and their shape is then the vmapped sizes (outermost transform "
    "first) followed by the per-sample shape"
)
DTENSOR_NOTE = (
    "tensor parallel: layers returned DTensors; each DTensor row describes this rank's local "
    "tensor and says so in `placement` and `mesh_coordinate` (Replicate: the whole tensor; "
    "Shard(d): this rank's shard along dim d; Partial: partial sums, null with a reason). Plain "
    "tensors between tensor-parallel layers are this rank's local parts, not the whole activation"
)

# Sparse (or other non-strided) tensors of more entries than this are not densified.
DENSE_MAX = 1 << 26


@dataclass(frozen=True, slots=True)
class MeasuredForm:
    """What is measured of one tensor (`values`, detached; None with a `reason` when nothing
    is) and what its row says: `shape` (None: no fixed one), a DTensor's `placement` ("Shard(0)")
    and `mesh_coordinate`, and the `note` (`TORCH_FUNC_NOTE`, `DTENSOR_NOTE`) it calls for."""

    values: torch.Tensor | None
    shape: tuple[int, ...] | None
    placement: str | None = None
    mesh_coordinate: tuple[int, ...] | None = None
    reason: str | None = None
    note: str | None = None


def measured_form(tensor: torch.Tensor) -> MeasuredForm:
    """The form of `tensor` that is measured (see the module docstring); a copy only for nested
    and non-strided tensors. Never runs a collective."""
    if is_plain(tensor) and not tensor.is_quantized and not is_functorch_wrapped(tensor):
        return MeasuredForm(tensor, shape_of(tensor))  # the common case, kept cheap
    with torch.no_grad():
        plain, batch = unwrap_functorch(tensor)
        note = TORCH_FUNC_NOTE if plain is not tensor else None
        plain = plain.detach()
        placement = coordinate = None
        dtensor = dtensor_class()
        if dtensor is not None and isinstance(plain, dtensor):
            note = DTENSOR_NOTE
            placement = ", ".join(_placement_name(p) for p in plain.placements)
            found = plain.device_mesh.get_coordinate()
            coordinate = None if found is None else tuple(int(c) for c in found)
            if any(p.is_partial() for p in plain.placements):
                shape = shape_of(plain.to_local())
                reason = reasons.partial_placement(placement)
                return MeasuredForm(None, shape, placement, coordinate, reason, note)
            plain = plain.to_local()
        shape = shape_of(plain)
        if batch:  # the unwrapped value holds the vmapped dims where vmap put them: named first
            per_sample = shape_of(tensor)
            shape = None if per_sample is None else batch + per_sample
        if plain.is_nested:
            empty = torch.empty(0, dtype=plain.dtype, device=plain.device)
            plain = torch.cat([component.reshape(-1) for component in plain.unbind()] or [empty])
        elif plain.layout != torch.strided:
            if plain.numel() > DENSE_MAX:
                reason = reasons.unsupported_layout(plain.layout)
                return MeasuredForm(None, shape, placement, coordinate, reason, note)
            plain = plain.to_dense()
        if plain.is_quantized:
            plain = plain.dequantize()
        return MeasuredForm(plain, shape, placement, coordinate, note=note)


def _placement_name(placement: object) -> str:
    """`Shard(0)`, `Replicate`, `Partial(sum)`: one DTensor placement as the row names it."""
    name = type(placement).__name__.lstrip("_")
    detail = getattr(placement, "dim", getattr(placement, "reduce_op", None))
    return name if detail is None else f"{name}({detail})"


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of `dtype` is measured in (see the module docstring)."""
    if dtype in (torch.float32, torch.float64):
        return dtype
    return torch.float32 if dtype.is_floating_point else torch.float64


def working_values(tensor: torch.Tensor) -> torch.Tensor:
    """The flat float32/float64 values that are measured (see the module docstring)."""
    return tensor.to(working_dtype(tensor.dtype)).reshape(-1)


def host_sync_is_free(device: torch.device) -> bool:
    """Whether reading a value of a tensor on `device` back to the host costs nothing."""
    return device.type == "cpu"


def is_plain(tensor: torch.Tensor) -> bool:
    """Of class `torch.Tensor` itself (no subclass such as DTensor) and strided: what NumPy, the
    sample's one transfer and `.tolist()` can read."""
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_nested


def host_floats(vector: torch.Tensor) -> list[float]:
    """The entries of a 1-D result of a tensor subclass, read one by one (`.tolist()` and
    `.numpy()` refuse subclasses; `float()` reads a 0-d tensor through the subclass's own
    dispatch). A sync, paid only by subclasses the general path measured."""
    return [float(value) for value in vector.unbind()]


def shape_of(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The shape as ints, or None where there is none to tell (nested; a subclass that raises)."""
    try:
        return None if tensor.is_nested else tuple(int(size) for size in tensor.shape)
    except Exception:  # nested tensors have symbolic ragged sizes
        return None
