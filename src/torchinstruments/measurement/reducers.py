"""Reducers: the default statistics profile (`numerics`) and custom metrics (`custom`), as one
`Measurer`.

Design decision: a reduction has two halves. `Measurer.launch` runs on the tensor's device and
returns a `PendingReduction` whose `device_vector` holds what must cross to the host; `transfer`
moves one sampled forward's vectors with ONE transfer and calls `PendingReduction.resolve`.
"""

from __future__ import annotations

import contextlib
import copy
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from torchinstruments import reasons
from torchinstruments._torch_internals import tensor_version
from torchinstruments.measurement import custom, numerics, paths, tensors
from torchinstruments.measurement.custom import Reducer, ReducerSpec
from torchinstruments.measurement.histograms import DEFAULT_BINS, HistogramVector
from torchinstruments.notices import repr_of, warn
from torchinstruments.records import MetricValue

__all__ = ["DEFAULT_METRICS", "DefaultStatistics", "Measurer", "PendingReduction"]

# The nine metrics of the default profile, in the order `numerics` computes and reports them.
DEFAULT_METRICS: tuple[str, ...] = numerics.PROFILE


class DefaultStatistics:
    """The default profile, or a subset of it.

    Pass an instance in `reducers` to replace the implicit default profile, e.g.
    `DefaultStatistics(("mean", "std"))`, or `DefaultStatistics(())` for custom reducers only.

    Args:
        metrics: Names from `DEFAULT_METRICS`, in the order they should be reported.

    Raises:
        TypeError: If `metrics` is not a sequence of strings.
        ValueError: If a name is unknown or repeated.
    """

    def __init__(self, metrics: Sequence[str] = DEFAULT_METRICS) -> None:
        custom.check_names("metrics", metrics, DEFAULT_METRICS)
        self.metrics: tuple[str, ...] = tuple(metrics)

    def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
        """Measures `tensor` synchronously, unavailable metrics left out: the default profile is
        a `Reducer` too (`Measurer` launches it in two halves instead)."""
        pending = Measurer([self]).launch(tensor)
        vector = pending.device_vector
        values = pending.resolve([] if vector is None else vector.tolist())
        pairs = zip(self.metrics, values, strict=True)
        return {name: value.value for name, value in pairs if value.value is not None}

    def __repr__(self) -> str:
        return f"DefaultStatistics(metrics={self.metrics!r})"


_NO_VALUE = MetricValue(None, reasons.NO_VALUE)


@dataclass(frozen=True, slots=True)
class _Part:
    """What one reducer produced for one tensor, waiting for the host values."""

    metrics: tuple[str, ...]
    host: dict[str, float] = field(default_factory=dict)
    refs: dict[str, int] = field(default_factory=dict)
    fixed: dict[str, MetricValue] = field(default_factory=dict)
    derive: Callable[[dict[str, float]], dict[str, MetricValue]] | None = None

    @classmethod
    def null(cls, metrics: Sequence[str], reason: str) -> _Part:
        """Every metric null with `reason`."""
        return cls(tuple(metrics), fixed=dict.fromkeys(metrics, MetricValue(None, reason)))

    def resolve(self, host_values: Sequence[float]) -> tuple[MetricValue, ...]:
        """Resolves the raw values and turns them into metric values."""
        raw = dict(self.host)
        raw.update({key: float(host_values[index]) for key, index in self.refs.items()})
        if self.derive is not None:  # the default profile: every metric derived from `raw`
            known = self.derive(raw) | self.fixed
        else:
            known = {name: numerics.metric_value(value) for name, value in raw.items()}
            known |= self.fixed
        return tuple(known.get(name, _NO_VALUE) for name in self.metrics)


@dataclass(slots=True)  # not frozen: a frozen one's __init__ costs more, per tensor
class PendingReduction:
    """One tensor's result: `device_vector` (1-D float64 on its device, or None) holds what must
    cross to the host; `resolve` finishes it after the sample's single transfer."""

    device_vector: torch.Tensor | None
    parts: Sequence[_Part]

    def resolve(self, host_values: Sequence[float]) -> tuple[MetricValue, ...]:
        """One `MetricValue` per name in `Measurer.metrics` from `host_values`
        (`device_vector.tolist()`, or empty when it is None). Never raises: null + reason."""
        size = 0 if self.device_vector is None else self.device_vector.numel()
        if len(host_values) != size:  # a transfer that lost values: never wrong numbers
            reason = reasons.host_values_mismatch(size, len(host_values))
            return tuple(MetricValue(None, reason) for part in self.parts for _ in part.metrics)
        out: list[MetricValue] = []
        for part in self.parts:
            try:
                out.extend(part.resolve(host_values))
            except Exception as error:  # resolving must never crash the training step
                reason = reasons.error("statistics", error)
                out.extend(MetricValue(None, reason) for _ in part.metrics)
        return tuple(out)


class Measurer:
    """All metrics of one observer: the default profile and custom reducers, validated up front.

    Args:
        reducers: As `inject_observer` takes them (`api`): None, or reducers added after the
            default profile, which a `DefaultStatistics` among them replaces in its position.
        host_paths: Whether plain CPU tensors may take the NumPy paths (`paths.choose`); False
            measures every tensor on the general path, as on a GPU (tests and benchmarks).

    Raises:
        TypeError, ValueError: As `custom.expand` and `custom.check_unique` raise them.
    """

    def __init__(
        self,
        reducers: Sequence[ReducerSpec] | Mapping[str, Callable] | None,
        *,
        host_paths: bool = True,
    ) -> None:
        checked = [] if reducers is None else custom.expand(reducers)
        if not any(isinstance(reducer, DefaultStatistics) for reducer in checked):
            checked.insert(0, DefaultStatistics())  # the implicit default profile
        custom.check_unique(checked)
        # Each reducer with its `metrics`, read once here (the Reducer protocol says so): a
        # reducer whose `metrics` changes later still fills the columns named at inject.
        self._reducers: tuple[tuple[Reducer, tuple[str, ...]], ...] = tuple(
            (reducer, tuple(reducer.metrics)) for reducer in checked
        )
        self.host_paths = host_paths
        self._warned: set[int] = set()  # ids of the reducers warned about
        self._extra_said: set[int] = set()  # ids of the reducers warned about extra keys
        # Each reducer that returned keys beyond its metrics: its name -> (metrics, those keys).
        self.extra_keys: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self.metrics: tuple[str, ...] = tuple(
            name for _, metrics in self._reducers for name in metrics
        )
        # The metrics when the default profile (or a non-empty subset) is the only reducer:
        # then the small-tensor lane (`lane`) may measure a tensor. None otherwise.
        only_default = len(checked) == 1 and isinstance(checked[0], DefaultStatistics)
        self.default_only: tuple[str, ...] | None = (
            self.metrics if only_default and self.metrics else None
        )

    def for_run(self) -> Measurer:
        """These reducers with nothing warned or kept yet, for one run: a trainer callback's
        config serves every fit, and each fit's run warns and says in its own index.md what its
        reducers did (shared, a second fit warned nothing and named the first one's keys)."""
        fresh = copy.copy(self)
        fresh._warned, fresh._extra_said, fresh.extra_keys = set(), set(), {}
        return fresh

    def _modified_input(self, reducer: Reducer, metrics: tuple[str, ...]) -> _Part:
        """Null metrics for a reducer that modified its argument; warned once per reducer."""
        reason = reasons.reducer_modified_input(_name_of(reducer))
        if id(reducer) not in self._warned:  # the reducers live as long as this Measurer
            self._warned.add(id(reducer))
            warn(f"torchinstruments: {reason}; its metrics are null")
        return _Part.null(metrics, reason)

    def _extra_keys_said(
        self, reducer: Reducer, metrics: tuple[str, ...], result: Mapping[Any, object]
    ) -> None:
        """Warns once per reducer whose `result` had keys beyond its `metrics`, which are not
        recorded, and keeps them for index.md (`extra_keys`): dropped without a word, a metric
        the user meant to record was missing with nothing saying why."""
        self._extra_said.add(id(reducer))
        extra = _extra_keys(result, metrics)
        if not extra:  # its keys could not be read
            return
        name = _name_of(reducer)
        self.extra_keys[name] = (metrics, extra)
        warn(
            f"torchinstruments: reducer {name} returned {', '.join(extra)} beyond its metrics "
            f"{metrics!r}; those are not recorded (name them in its `metrics` to record them; "
            "warned once per reducer, and index.md says so)"
        )

    def launch(self, tensor: torch.Tensor) -> PendingReduction:
        """Starts measuring `tensor` (detached, never modified); never raises and, off the CPU,
        never syncs with the host. Resolve it with `device_vector.tolist()` on the host."""
        return self.launch_with_histogram(tensor, None)[0]

    @torch.no_grad()
    def launch_with_histogram(
        self, tensor: torch.Tensor, bins: int | None = DEFAULT_BINS
    ) -> tuple[PendingReduction, HistogramVector | None]:
        """`launch` plus the tensor's histogram vector of `bins` bins (None where it has none, or
        `bins` is None), counted by the default profile's own passes (`numerics.measure_on_cpu`,
        `numerics.raw_on_device`), also when its metrics are `DefaultStatistics(())`. Every
        reducer's device values are packed into one vector. Never raises."""
        blocks: list[torch.Tensor] = []
        parts: list[_Part] = []
        histogram: HistogramVector | None = None
        copy: torch.Tensor | None = None  # custom reducers' own copy, made once per tensor
        try:
            # A plain tensor that needs no grad is read as it is (a torch call saved); any
            # other is detached first, as a subclass's attributes may raise when read.
            plain = type(tensor) is torch.Tensor and not tensor.requires_grad
            detached = tensor if plain else tensor.detach()
            for reducer, metrics in self._reducers:
                offset = sum(int(block.numel()) for block in blocks)
                try:
                    if isinstance(reducer, DefaultStatistics):
                        part, block, counted = _reduce_default(
                            detached, metrics, offset, bins, self.host_paths
                        )
                        histogram = counted if histogram is None else histogram
                    elif isinstance(reducer, custom.READY) and (
                        unsupported := tensors.unsupported_reason(detached)
                    ):
                        part, block = _Part.null(metrics, unsupported), None
                    else:
                        if copy is None:
                            copy = _reducers_copy(detached)
                        version = tensor_version(copy)
                        part, block, extra = _reduce_custom(
                            reducer, metrics, copy, offset, self.host_paths
                        )
                        if extra is not None and id(reducer) not in self._extra_said:
                            self._extra_keys_said(reducer, metrics, extra)
                        if tensor_version(copy) != version:
                            part, block = self._modified_input(reducer, metrics), None
                            copy = None  # the next reducer gets a fresh copy
                except Exception as error:
                    reason = reasons.error("statistics", error)
                    part, block = _Part.null(metrics, reason), None
                parts.append(part)
                if block is not None:
                    blocks.append(block)
            vector = (blocks[0] if len(blocks) == 1 else torch.cat(blocks)) if blocks else None
        except Exception as error:  # measuring must never crash the training step
            return self.unavailable(reasons.error("statistics", error)), None
        return PendingReduction(vector, parts), histogram

    def unavailable(self, reason: str) -> PendingReduction:
        """A reduction whose every metric is null with `reason` (nothing to transfer)."""
        return PendingReduction(None, [_Part.null(self.metrics, reason)])


def _name_of(reducer: Reducer) -> str:
    """What a warning or a reason calls a custom reducer: its `__name__`, or its type's name
    (also where reading `__name__` raises)."""
    try:
        return str(getattr(reducer, "__name__", None) or type(reducer).__name__)
    except Exception:
        return type(reducer).__name__


def _reducers_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The custom reducers' copy of `tensor`, a normal tensor also under `torch.inference_mode`:
    there a clone is an inference tensor, whose version (`tensor_version`, which shows that a
    reducer wrote into its copy) cannot be read: every custom metric was null."""
    if not torch.is_inference_mode_enabled():
        return tensor.clone()
    with torch.inference_mode(False):
        return tensor.clone()


def _reduce_default(
    tensor: torch.Tensor,
    metrics: tuple[str, ...],
    offset: int,
    bins: int | None,
    host_paths: bool,
) -> tuple[_Part, torch.Tensor | None, HistogramVector | None]:
    """The default profile of one tensor (host values or a device block), and its histogram."""
    if not metrics and bins is None:
        return _Part(metrics), None, None
    unsupported = tensors.unsupported_reason(tensor)
    if unsupported is not None or tensor.numel() == 0:
        return _Part.null(metrics, unsupported or reasons.EMPTY), None, None
    derive = partial(numerics.derived, numel=tensor.numel(), metrics=metrics)
    if paths.choose(tensor, host_paths=host_paths, lane_ok=False) == "host":
        with contextlib.suppress(Exception):  # a failure is handed to the general path below
            result = numerics.measure_on_cpu(tensor, bins)
            return _Part(metrics, host=result.raw, derive=derive), None, result.histogram
    block, vector = numerics.raw_on_device(tensors.working_values(tensor), bins)
    histogram: HistogramVector | None = vector  # counted with the statistics' min, max and sums
    if vector is not None and not tensors.is_plain(vector):
        histogram = tensors.host_floats(vector)  # read now: it never joins, or breaks, the transfer
    if not metrics:
        return _Part(metrics), None, histogram
    if not tensors.is_plain(block):  # a subclass's values are read now, outside the transfer
        host = dict(zip(numerics.RAW, tensors.host_floats(block), strict=True))
        return _Part(metrics, host=host, derive=derive), None, histogram
    refs = {key: offset + index for index, key in enumerate(numerics.RAW)}
    return _Part(metrics, refs=refs, derive=derive), block, histogram


@contextlib.contextmanager
def _rng_kept(device: torch.device) -> Iterator[None]:
    """The random state of the CPU and of `device` as it was before a custom reducer drew from
    it (a random subsample): observing must not change the training's later draws (dropout
    masks, shuffling). A device whose generator cannot be read keeps the CPU's alone."""
    cpu = torch.get_rng_state()
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    state = None
    with contextlib.suppress(Exception):
        state = None if module is None else module.get_rng_state(device)
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if state is not None:
            with contextlib.suppress(Exception):
                module.set_rng_state(state, device)  # type: ignore[union-attr]


def _reduce_custom(
    reducer: Reducer,
    metrics: tuple[str, ...],
    tensor: torch.Tensor,
    offset: int,
    host_paths: bool,
) -> tuple[_Part, torch.Tensor | None, Mapping[Any, object] | None]:
    """One custom reducer's `metrics`: plain device scalars wait for the sample's transfer. The
    third value: its result where that has keys beyond `metrics` (not recorded: the caller says
    so), else None."""
    try:
        with _rng_kept(tensor.device):
            result = reducer(tensor)
    except Exception as error:
        return _Part.null(metrics, reasons.error("reducer", error)), None, None
    if not isinstance(result, Mapping):
        return _Part.null(metrics, reasons.reducer_returned(type(result).__name__)), None, None
    part = _Part(metrics)
    device_values: list[torch.Tensor] = []
    found = 0
    for name in metrics:
        try:  # a lazy mapping's lookup runs the reducer's code: its error is the reducer's
            present = name in result
            value = result[name] if present else None
        except Exception as error:
            part.fixed[name] = MetricValue(None, reasons.error("reducer", error))
            continue
        if not present:
            part.fixed[name] = _left_out(reducer, name)
            continue
        found += 1
        try:
            _take_value(part, device_values, name, value, tensor, offset, host_paths)
        except OverflowError:  # an int beyond float64 (10**400): no finite value
            part.fixed[name] = MetricValue(None, reasons.NON_FINITE_RESULT)
        except Exception as error:  # the reducer's value, not the default statistics, failed
            part.fixed[name] = MetricValue(None, reasons.error("reducer", error))
    block = torch.stack(device_values) if device_values else None
    return part, block, _beyond(result, found)


def _left_out(reducer: Reducer, name: str) -> MetricValue:
    """A metric the reducer's mapping had no entry for: the library's own reducers give none for
    an empty tensor (the tensor's reason), any other reducer failed to give what it declared."""
    if isinstance(reducer, custom.READY):
        return _NO_VALUE
    return MetricValue(None, reasons.reducer_left_out(name))


def _beyond(result: Mapping[Any, object], found: int) -> Mapping[Any, object] | None:
    """`result` where it has more keys than the `found` metrics (keys beyond `metrics`), else
    None, as None where its length cannot be read (its values were taken already)."""
    try:
        return result if len(result) > found else None
    except Exception:
        return None


def _extra_keys(result: Mapping[Any, object], metrics: tuple[str, ...]) -> tuple[str, ...]:
    """The first `_KEYS_SHOWN` keys of `result` beyond `metrics`, quoted (at most 100
    characters each), then `... (n more)`; () where its keys cannot be read."""
    try:
        extra = [key for key in result if key not in metrics]
    except Exception:
        return ()
    shown = [reasons.cut_message(repr_of(key), 100) for key in extra[:_KEYS_SHOWN]]
    more = len(extra) - len(shown)
    return (*shown, f"... ({more} more)") if more else tuple(shown)


_KEYS_SHOWN = 10


def _take_value(
    part: _Part,
    device_values: list[torch.Tensor],
    name: str,
    value: object,
    tensor: torch.Tensor,
    offset: int,
    host_paths: bool,
) -> None:
    """One custom metric's `value` into `part`: a device scalar waiting for the transfer, a
    host float, or null with the reason it cannot be a metric."""
    if isinstance(value, torch.Tensor):
        problem = _scalar_tensor_problem(value)
        if problem is not None:
            part.fixed[name] = MetricValue(None, problem)
        elif (
            value.device == tensor.device
            and not (host_paths and tensors.host_sync_is_free(value.device))
            and tensors.is_plain(value)  # a subclass's value is read now (see host_floats)
        ):
            part.refs[name] = offset + len(device_values)
            device_values.append(value.detach().reshape(()).to(torch.float64))
        else:
            part.host[name] = float(value.detach().reshape(()).to(torch.float64))
    elif isinstance(value, numbers.Real):
        part.host[name] = float(value)
    else:
        part.fixed[name] = MetricValue(None, reasons.reducer_value(type(value).__name__, name))


def _scalar_tensor_problem(value: torch.Tensor) -> str | None:
    """Why a custom reducer's tensor value cannot be a metric, or None if it can."""
    if value.layout != torch.strided:
        return reasons.reducer_tensor_layout(value.layout)
    if not tensors.is_real_dtype(value.dtype):
        return reasons.reducer_tensor_dtype(tensors.dtype_name(value.dtype))
    if value.numel() != 1:
        return reasons.reducer_tensor_shape(tuple(value.shape))
    return None
