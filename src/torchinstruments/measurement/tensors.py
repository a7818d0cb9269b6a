"""Per-tensor rules shared by the statistics, the histograms and the observer.

Which tensors can be measured, in which working dtype, and on which devices a host sync is free.
One copy of each rule, so the statistics and the histograms of a tensor can never disagree about
whether it is measurable or how its values are read:

- Supported: strided tensors of a floating, integer or bool dtype. Complex and quantized dtypes and
  non-strided layouts (sparse, ...) are not: their metrics are null with a reason and they get no
  histogram.
- Nested tensors (nn.TransformerEncoder packs a padded batch into one in eval under no_grad, so
  every layer inside it returns one) are measured over the entries of their components, padding
  excluded: `measured_form` concatenates them into one flat tensor (a copy) before anything else
  reads them. Their shape is null (no fixed shape).
- Working dtype: float64 stays float64; float32, float16, bfloat16 and other low-precision floats
  are read as float32; integers and bools as float64 (bool as 0/1; integers beyond 2**53 round to
  the nearest float64).
- Host syncs are free on the CPU, so the CPU paths may read values back mid-reduction (select
  instead of sort); every other device type takes the sync-free path.
"""

from __future__ import annotations

import torch

from torchinstruments import reasons

INTEGRAL_DTYPES: frozenset[torch.dtype] = frozenset(
    dtype
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
)

# Device types on which a host synchronisation costs nothing.
SYNC_FREE_DEVICE_TYPES: frozenset[str] = frozenset({"cpu"})


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `float32`."""
    return str(dtype).removeprefix("torch.")


def is_integral(dtype: torch.dtype) -> bool:
    """True for bool and the plain integer dtypes (not quantized ones)."""
    return dtype in INTEGRAL_DTYPES


def is_real_dtype(dtype: torch.dtype) -> bool:
    """Floating, integer or bool: a dtype whose values are real numbers."""
    return not dtype.is_complex and (dtype.is_floating_point or is_integral(dtype))


def unsupported_reason(tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot be measured at all, or None when it can."""
    if tensor.layout != torch.strided or tensor.is_nested:
        return reasons.unsupported_layout(tensor.layout)
    if not is_real_dtype(tensor.dtype):
        return reasons.unsupported_dtype(dtype_name(tensor.dtype))
    return None


def measured_form(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose entries are measured: itself, or a nested tensor's entries, flattened."""
    if not tensor.is_nested:
        return tensor
    with torch.no_grad():
        parts = [component.detach().reshape(-1) for component in tensor.unbind()]
        if not parts:
            return torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return torch.cat(parts)


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
    return device.type in SYNC_FREE_DEVICE_TYPES


def is_plain(tensor: torch.Tensor) -> bool:
    """Of class `torch.Tensor` itself (no subclass such as DTensor) and strided: what NumPy, the
    sample's one transfer and `.tolist()` can read."""
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_nested


def host_path_takes(tensor: torch.Tensor) -> bool:
    """Whether the NumPy fast paths may take `tensor`: plain, on a device where syncs are free."""
    return is_plain(tensor) and host_sync_is_free(tensor.device)


def host_floats(vector: torch.Tensor) -> list[float]:
    """The entries of a 1-D result of a tensor subclass, read one by one (`.tolist()` and
    `.numpy()` refuse subclasses; `float()` reads a 0-d tensor through the subclass's own
    dispatch). A sync, paid only by subclasses the general path measured."""
    return [float(value) for value in vector.unbind()]


def shape_of(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The tensor's shape as ints, or None when it has no fixed one (nested tensors)."""
    if tensor.is_nested:
        return None
    try:
        return tuple(int(size) for size in tensor.shape)
    except Exception:  # nested tensors have symbolic ragged sizes
        return None
