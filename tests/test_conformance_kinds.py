"""Outputs and gradients of unusual dtypes, layouts and tensor kinds equal plain hooks, row by row.

Each case is a small model with one layer (`Kind`) that returns one kind of tensor between ordinary
layers, run for two steps with a backward where the kind has a gradient: float16 and bfloat16
models, values overflowing to inf in float16, float8 dtypes (e4m3fn, e5m2, their fnuz variants and
e8m0fnu, and their NaN on overflow), integer and bool heads, uint64 beyond 2**63, zero strides
(`expand`), a negative-bit view, channels_last and transposed outputs, 0-d and 0-size outputs,
float64 near 1e307 and subnormal, a Parameter, a `__torch_function__` subclass and a wrapper
subclass (TwoTensor, whose ops run on two inner tensors) returned, a layer returning its input
changed in place afterwards, tensors made in and returned from inference mode, sparse COO/CSR and
nested outputs, complex (an FFT), quantized, packed float4 and meta outputs; steps under
`torch.no_grad()` and `torch.inference_mode()`. Each is observed and, on a deep copy, hooked
(`hook_reference.run_both`) on every CPU path (`test_conformance_compositions.PATHS`), and every row
equals the reference both ways.

Where plain hooks and NumPy cannot read a tensor, `kind_reference` says what its row is, as the
contract and index.md state it: a sparse tensor is the dense tensor it stands for; a tensor on
the meta device (no values) is null with "unsupported device meta", and the other tensors of its
sample keep their rows. (Complex, quantized, packed float4 and wrapper-subclass tensors are
`hook_reference`'s own cases.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_conformance_compositions import PATHS
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import hook_reference
from hook_reference import run_both
from reference_values import METRICS, ReferenceTensor, reference_tensor

Step = Callable[[nn.Module, int], Any]
_plain_reference = reference_tensor


def kind_reference(tensor: torch.Tensor) -> ReferenceTensor:
    """`reference_values.reference_tensor` (patched in as `hook_reference`'s), with what plain
    hooks and NumPy cannot read said."""
    if tensor.is_nested:
        return _plain_reference(tensor)
    dtype = str(tensor.dtype).removeprefix("torch.")
    shape = tuple(int(s) for s in tensor.shape)
    nulls = dict.fromkeys(METRICS)
    if tensor.is_meta:
        return ReferenceTensor(nulls, r"^unsupported device meta$", shape, dtype)
    if tensor.layout != torch.strided:
        row = _plain_reference(tensor.to_dense())
        row.shape = shape
        return row
    return _plain_reference(tensor)


class Kind(nn.Module):
    """Returns `make(x)`: the kind of tensor under test."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.make(x)


class Side(nn.Module):
    """Calls `kind` on the hidden activation and passes the activation on: for kinds the rest
    of the model cannot compute with (meta, quantized, sparse, nested)."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 6)
        self.kind = Kind(make)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        self.kind(h)
        return self.head(h)


class Returned(nn.Module):
    """Returns `tensor` itself, whatever its input: a Parameter, a cached inference tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tensor


class Subclass(torch.Tensor):
    """A `__torch_function__` subclass (its ops return the subclass)."""


def through(
    make: Callable[[torch.Tensor], torch.Tensor], back: Callable[[torch.Tensor], torch.Tensor]
) -> nn.Module:
    """Linear -> the kind -> `back` (a real dense tensor again), so a gradient flows into it."""
    return nn.Sequential(nn.Linear(4, 6), Kind(make), Kind(back))


def sparse_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.sparse.sum(x, dim=1).to_dense()


def entries(x: torch.Tensor) -> torch.Tensor:
    """A nested tensor's components' entries, one after the other."""
    return torch.cat([component.reshape(-1) for component in x.unbind()])


def chain(make: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> nn.Module:
    """Linear -> the kind -> Tanh, in `dtype`."""
    return nn.Sequential(nn.Linear(4, 6), Kind(make), nn.Tanh()).to(dtype)


def train(dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = (3, 4)) -> Step:
    """A forward of a batch in `dtype` and, where the output has a gradient, a backward."""

    def step(model: nn.Module, i: int) -> Any:
        out = model(torch.randn(shape).to(dtype))
        if out.requires_grad:
            out.float().square().sum().backward()
        return out.detach()

    return step


def under(context: Callable[[], Any]) -> Step:
    """A forward under `context` (no_grad, inference_mode)."""

    def step(model: nn.Module, i: int) -> Any:
        with context():
            return model(torch.randn(3, 4)).clone()

    return step


def autocast(model: nn.Module, i: int) -> Any:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(3, 4))
    out.float().sum().backward()
    return out.detach()


def changed_after(model: nn.Module, i: int) -> Any:
    """The Identity's output (its input) changed in place after the layer returned it."""
    x = torch.randn(3, 4, requires_grad=True) * 1
    out = model(x)
    out.mul_(3).add_(1)
    out.sum().backward()
    return out.detach()


def to_float(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def overflowing(x: torch.Tensor) -> torch.Tensor:
    return x * 60000.0  # float16: entries beyond 65504 become inf, and so does their gradient


def huge(x: torch.Tensor) -> torch.Tensor:
    return x * 1e307


def subnormal(x: torch.Tensor) -> torch.Tensor:
    return x * 1e-310


def uint64(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([2**64 - 1, 2**63, 5, 0], dtype=torch.uint64)


def two_tensor(x: torch.Tensor) -> torch.Tensor:
    """A TwoTensor whose inner tensors differ everywhere (its second: 10x + 5), so statistics
    that mixed them would differ from either's."""
    return TwoTensor(x, x * 10 + 5)


def float4(x: torch.Tensor) -> torch.Tensor:
    """Bytes of `x` as float4_e2m1fn_x2: two 4-bit floats in each."""
    return (x.abs() * 40).to(torch.uint8).view(torch.float4_e2m1fn_x2)


def nested(x: torch.Tensor) -> torch.Tensor:
    return torch.nested.as_nested_tensor([row[: i + 2] for i, row in enumerate(x)])


def jagged(x: torch.Tensor) -> torch.Tensor:
    return torch.nested.as_nested_tensor(
        [row[: i + 2] for i, row in enumerate(x)], layout=torch.jagged
    )


with torch.inference_mode():
    CACHED = torch.randn(3, 6)  # an inference tensor a layer returns in an ordinary forward

CASES: dict[str, Callable[[], tuple[nn.Module, Step]]] = {
    "float16 model": lambda: (chain(torch.relu, torch.float16), train(torch.float16)),
    "bfloat16 model": lambda: (chain(torch.relu, torch.bfloat16), train(torch.bfloat16)),
    "bfloat16 autocast": lambda: (chain(torch.relu, torch.float32), autocast),
    "float16 overflow to inf": lambda: (chain(overflowing, torch.float16), train(torch.float16)),
    "float8_e4m3fn": lambda: (
        nn.Sequential(nn.Linear(4, 6), Kind(lambda x: x.to(torch.float8_e4m3fn)), Kind(to_float)),
        train(),
    ),
    "float8_e5m2": lambda: (Side(lambda x: x.to(torch.float8_e5m2)), train()),
    "float8_e4m3fn NaN on overflow": lambda: (
        Side(lambda x: (x * 1000).to(torch.float8_e4m3fn)),
        train(),
    ),
    "float8_e4m3fnuz": lambda: (Side(lambda x: x.to(torch.float8_e4m3fnuz)), train()),
    "float8_e5m2fnuz NaN on overflow": lambda: (
        Side(lambda x: (x * 1e5).to(torch.float8_e5m2fnuz)),
        train(),
    ),
    "float8_e8m0fnu": lambda: (Side(lambda x: x.abs().to(torch.float8_e8m0fnu)), train()),
    "argmax head": lambda: (Side(lambda x: x.argmax(dim=1)), train()),
    "bool mask": lambda: (Side(lambda x: x > 0), train()),
    "uint64 beyond 2**63": lambda: (Side(uint64), train()),
    "expand (zero strides)": lambda: (chain(lambda x: x[:1].expand(5, 6), torch.float32), train()),
    "negative-bit view": lambda: (chain(torch._neg_view, torch.float32), train()),
    "conj of a real tensor": lambda: (chain(torch.conj, torch.float32), train()),
    "transposed": lambda: (chain(torch.t, torch.float32), train()),
    "channels_last": lambda: (
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).to(memory_format=torch.channels_last),
        train(shape=(2, 3, 6, 6)),
    ),
    "0-d": lambda: (chain(torch.sum, torch.float32), train()),
    "0-size": lambda: (chain(lambda x: x[:0], torch.float32), train()),
    "float64 near 1e307": lambda: (chain(huge, torch.float64), train(torch.float64)),
    "float64 subnormal": lambda: (chain(subnormal, torch.float64), train(torch.float64)),
    "Parameter returned": lambda: (
        nn.Sequential(nn.Linear(4, 6), Returned(nn.Parameter(torch.randn(3, 6)))),
        train(),
    ),
    "__torch_function__ subclass": lambda: (
        chain(lambda x: x.as_subclass(Subclass), torch.float32),
        train(),
    ),
    "wrapper subclass (TwoTensor) with its gradient": lambda: (
        chain(two_tensor, torch.float32),
        train(),
    ),
    "input returned, changed in place after": lambda: (nn.Sequential(nn.Identity()), changed_after),
    "inference tensor returned": lambda: (Side(lambda x: CACHED), train()),
    "no_grad step": lambda: (chain(torch.relu, torch.float32), under(torch.no_grad)),
    "inference_mode step": lambda: (chain(torch.relu, torch.float32), under(torch.inference_mode)),
    "sparse COO": lambda: (Side(lambda x: x.relu().to_sparse()), train()),
    "sparse CSR": lambda: (Side(lambda x: x.relu().to_sparse_csr()), train()),
    "nested": lambda: (Side(nested), train()),
    "nested jagged": lambda: (Side(jagged), train()),
    "sparse COO with its gradient": lambda: (
        through(lambda x: x.relu().to_sparse(), sparse_sum),
        train(),
    ),
    "nested with its gradient": lambda: (through(nested, entries), train()),
    "complex (FFT) with its gradient": lambda: (through(torch.fft.fft, torch.abs), train()),
    "quantized": lambda: (
        Side(lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)),
        train(),
    ),
    "packed float4_e2m1fn_x2": lambda: (Side(float4), train()),
    "meta device": lambda: (Side(lambda x: torch.empty(x.shape, device="meta")), train()),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_each_kind_of_tensor_equals_plain_hooks(
    run_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
    case: str,
    path: str,
) -> None:
    monkeypatch.setattr(hook_reference, "reference_tensor", kind_reference)
    model, step = CASES[case]()
    extra = PATHS[path](monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors' prototype note, no-histogram notes
        result = run_both(model, step, run_dir, steps=2, **extra)
    result.assert_conforms()
    assert result.history.height > 0
    if case.endswith("with its gradient"):  # the kind's own gradient rows are there
        gradients = result.history.filter(layer="1", signal="output_gradient", metric="mean")
        assert gradients.height == 2
