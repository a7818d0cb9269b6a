"""Custom scalar reducers: the extension point for metrics beyond the default profile.

Custom reducers come in the forms users write first (`ReducerSpec`). Mappings and functions are
turned into one single-metric reducer per function, so one failing function nulls only its own
metric. A lambda has no usable name (`<lambda>`): refused at inject, with how to name it.
`AbsMax` and `L2Norm` are the built-ins. `reducers.Measurer` runs them next to the default profile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from torchinstruments.measurement import tensors
from torchinstruments.notices import repr_of
from torchinstruments.records import INTERRUPTED

__all__ = ["READY", "AbsMax", "L2Norm", "Reducer", "ReducerSpec"]


@runtime_checkable
class Reducer(Protocol):
    """A custom scalar reducer: the extension point for metrics beyond the default profile.

    `metrics` names every metric the reducer returns; it is read once when the observer is
    injected, so name clashes fail early. A metric it names but leaves out of its mapping is
    null with a reason saying so (warned, named in index.md); a key beyond it is not recorded
    (warned once per reducer, named in index.md). The call receives a copy of the tensor, detached and
    under `torch.no_grad()`, and returns one scalar per metric: a 0-d (or one-element) tensor,
    which stays on the device until the sample's single host transfer, or a Python number. It
    runs outside the user's `torch.autocast` and torch function/dispatch modes (ambient.py), so
    its result does not depend on the precision or the modes the training step runs under.

    A reducer can never change the training values it reads: the custom reducers of one tensor
    share one copy of it (the default profile reads the live tensor, and never writes). A reducer
    that modifies its argument in place (detected by the copy's version counter; `.data` writes
    are not seen) gets null metrics with a reason naming it, one warning, and the reducers after
    it get a fresh copy. The cost: one copy per measured tensor when custom reducers are used.

    Example:
        >>> class AbsMax:
        ...     metrics = ("abs_max",)
        ...     def __call__(self, tensor):
        ...         return {"abs_max": tensor.abs().amax()}
    """

    @property
    def metrics(self) -> tuple[str, ...]:
        """Names of the metrics the reducer returns (a plain class attribute is fine)."""
        ...

    def __call__(self, tensor: torch.Tensor) -> Mapping[str, torch.Tensor | float]:
        """Returns one scalar per name in `metrics`."""
        ...


@dataclass(frozen=True)  # for its repr, `AbsMax()`, which error messages name it by
class AbsMax:
    """`abs_max`: the largest absolute value among the finite entries (null when there are none).

    Example:
        >>> inject_observer(model, reducers=[AbsMax(), L2Norm()])  # doctest: +SKIP
    """

    metrics: ClassVar[tuple[str, ...]] = ("abs_max",)

    def __call__(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        values = tensors.working_values(tensor)
        if values.numel() == 0:
            return {}
        # -inf when nothing is finite: stored as null with reason "non-finite result".
        magnitude = torch.where(values.isfinite(), values.abs(), float("-inf"))
        return {"abs_max": magnitude.amax()}


@dataclass(frozen=True)
class L2Norm:
    """`l2_norm`: the Euclidean norm of the finite entries, sqrt(sum x^2) (null when none).

    The working values (`float32` or better), divided by the largest magnitude, are squared and
    summed in float64: no square overflows (float64 beyond 1e154) or underflows to 0 (below 1e-154).
    """

    metrics: ClassVar[tuple[str, ...]] = ("l2_norm",)

    def __call__(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        values = tensors.working_values(tensor)
        if values.numel() == 0:
            return {}
        finite = values.isfinite()
        wide = torch.where(finite, values, 0.0).to(torch.float64)
        top = wide.abs().amax().clamp(min=torch.finfo(torch.float64).tiny)  # all zeros: 0 / tiny
        norm = torch.where(finite.any(), (wide / top).square().sum().sqrt() * top, float("nan"))
        return {"l2_norm": norm}


# The library's own reducers. They describe real values, as the default profile does: a tensor
# the profile cannot measure (complex, packed) is null with the profile's
# reason for them too (`Measurer`), not a number read from a cast (a complex tensor's real part).
READY = (AbsMax, L2Norm)


class _FunctionReducer:
    """One metric computed by a plain function `fn(tensor) -> scalar`."""

    def __init__(self, name: str, function: Callable[[torch.Tensor], torch.Tensor | float]) -> None:
        self.metrics: tuple[str, ...] = (name,)
        self._function = function
        # What reasons and warnings call it: the function's own name, or, for one without a
        # usable name (a lambda in a mapping), the function of its metric.
        own = getattr(function, "__name__", None)
        usable = isinstance(own, str) and own.isidentifier()
        self.__name__ = own if usable else f"{own or type(function).__name__} of metric {name!r}"

    def __call__(self, tensor: torch.Tensor) -> dict[str, torch.Tensor | float]:
        # Whatever the function returns is checked by `reducers` (null + reason if unusable).
        return {self.metrics[0]: self._function(tensor)}

    def __repr__(self) -> str:
        function = getattr(self._function, "__qualname__", self._function)
        return f"{{{self.metrics[0]!r}: {repr_of(function)}}}"


ReducerSpec = Reducer | Mapping[str, Callable[[torch.Tensor], object]] | Callable[..., object]
"""What `reducers=` accepts per item: a `Reducer`, a `{metric_name: fn}` mapping, or a named
function `fn(tensor) -> scalar` (metric named `fn.__name__`)."""


def check_names(label: str, names: object, allowed: Sequence[str] = ()) -> None:
    """Metric names: a sequence of distinct non-empty strings, none of them reserved, and each
    one of `allowed` when it is given (the default profile's)."""
    hint = f"; allowed: {', '.join(allowed)}" if allowed else ""
    if isinstance(names, str | bytes) or not isinstance(names, Sequence):
        raise TypeError(f"{label} must be a sequence of metric names, got {names!r}{hint}")
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{label} has metric name {name!r}; expected a non-empty str{hint}")
        if allowed and name not in allowed:
            raise ValueError(f"{label} contains unknown metric {name!r}{hint}")
        if name == INTERRUPTED:
            raise ValueError(
                f"{label} has metric name {INTERRUPTED!r}, which is reserved: history rows with "
                "that metric mark interrupted samples. Rename it"
            )
    repeated = sorted({name for name in names if list(names).count(name) > 1})
    if repeated:
        raise ValueError(
            f"{label} repeats metric(s) {', '.join(map(repr, repeated))}: give each metric one name"
        )


def _as_reducers(label: str, item: object) -> list[Reducer]:
    """One `reducers` item as checked reducers (a mapping or named function wrapped)."""
    if isinstance(item, Mapping):
        check_names(label, list(item))
        for name, function in item.items():
            if not callable(function):
                raise TypeError(
                    f"{label}[{name!r}] must be a function tensor -> scalar, got {repr_of(function)}"
                )
        return [_FunctionReducer(name, function) for name, function in item.items()]
    if isinstance(item, type):  # callable, and has `metrics` when it is a Reducer class
        raise TypeError(
            f"{label} is the class {item.__name__}, not a reducer: instantiate it, e.g. "
            f"reducers=[{item.__name__}()]"
        )
    if not callable(item):
        raise TypeError(
            f"{label} must be a Reducer (callable with `metrics`), a {{metric_name: fn}} "
            f"mapping, or a named function tensor -> scalar; got {repr_of(item)}"
        )
    if hasattr(item, "metrics"):
        check_names(f"{label} ({repr_of(item)}).metrics", item.metrics)
        return [item]  # type: ignore[list-item]
    name = getattr(item, "__name__", None)
    if name == "<lambda>":
        raise TypeError(
            f"{label} is a lambda, which has no name to give its metric: pass it in a mapping, "
            '`reducers=[{"my_metric": lambda t: ...}]`, or define it with `def my_metric(t): ...`'
        )
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(
            f"{label} ({repr_of(item)}) has no `metrics` and no function name to name its metric: "
            "give it a `metrics` tuple (a Reducer), or pass `{metric_name: fn}`"
        )
    check_names(label, [name])
    return [_FunctionReducer(name, item)]  # type: ignore[arg-type]


def expand(reducers: object) -> list[Reducer]:
    """`reducers=` (a sequence, or one mapping) as checked reducers, in order; TypeError or
    ValueError for an item of no accepted form, or a bad, repeated or reserved metric name."""
    if isinstance(reducers, Mapping):
        reducers = [reducers]
    if isinstance(reducers, str | bytes) or not isinstance(reducers, Sequence):
        raise TypeError(
            "reducers must be None, a sequence of reducers (Reducer objects, {metric_name: fn} "
            f"mappings or named functions), or one mapping; got {reducers!r}"
        )
    return [
        r for index, item in enumerate(reducers) for r in _as_reducers(f"reducers[{index}]", item)
    ]


def check_unique(reducers: Sequence[Reducer]) -> None:
    """Raises ValueError when two reducers (or one and the default profile) share a metric."""
    owners: dict[str, list[str]] = {}
    for reducer in reducers:
        for name in reducer.metrics:
            owners.setdefault(name, []).append(repr_of(reducer))
    clashes = {name: who for name, who in owners.items() if len(who) > 1}
    if clashes:
        described = "; ".join(f"{name!r} from {' and '.join(who)}" for name, who in clashes.items())
        raise ValueError(
            f"reducers: metric names must be unique across reducers and the default profile; "
            f"clashing: {described}. Rename the custom metric, or pass DefaultStatistics(...) "
            "with a subset to replace the default profile."
        )
