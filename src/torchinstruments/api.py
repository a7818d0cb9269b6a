"""`inject_observer`, `remove_observer`, `has_observer`: the whole public lifecycle.

Every argument is validated here, before anything touches the model or the disk, so a mistake
fails at injection with a message naming the argument, never in the middle of training. The
registry of observed models is a `weakref.WeakKeyDictionary`: it stores nothing on the model and
lets an observed model be garbage collected (its run is then finalized; see observer.py).
"""

from __future__ import annotations

import datetime
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchinstruments.distributed import place_rank, validate_rank_policy
from torchinstruments.finalize import check_output_dir
from torchinstruments.history import HistoryConfig
from torchinstruments.observer import Observer
from torchinstruments.records import LayerInfo, RunInfo
from torchinstruments.sampling import TimeIntervalSampler, describe_sampler
from torchinstruments.sinks import DirectorySink, Sink, SinkGroup, validate_sinks
from torchinstruments.statistics import Measurer, Reducer

Selector = Callable[[str, nn.Module], bool]

_OBSERVERS: weakref.WeakKeyDictionary[nn.Module, Observer] = weakref.WeakKeyDictionary()


def library_version() -> str:
    """The installed torchinstruments version."""
    try:
        return version("torchinstruments")
    except PackageNotFoundError:
        return "unknown"


def inject_observer(
    model: nn.Module,
    *,
    output_dir: str | os.PathLike[str] = "stats",
    sampler: Any = None,
    selector: Selector | None = None,
    reducers: Sequence[Reducer] | None = None,
    histogram_selector: Selector | None = None,
    max_histogram_modules: int = 8,
    history_config: HistoryConfig | None = None,
    rank_policy: str = "rank0",
    capture_direct_forwards: bool = True,
    sinks: Sequence[Sink] = (),
) -> Path | None:
    """Start observing `model`: sampled root forwards and their backward are measured and written.

    Args:
        model: the module your loop calls; its calls are the root forwards.
        output_dir: run directory; must not already hold a run.
        sampler: decides per root forward (`Sampler`); default `TimeIntervalSampler(60)`.
        selector: `selector(name, module) -> bool` picks layers; default: leaf modules.
        reducers: custom scalar reducers added to the default profile (include a
            `DefaultStatistics(...)` to replace or trim the default profile).
        histogram_selector: `(name, module) -> bool` picks focus layers among the observed ones;
            default: all observed, in traversal order.
        max_histogram_modules: at most this many focus layers (a limit on modules, not tags).
        history_config: Parquet chunk size and result.json window size.
        rank_policy: `"rank0"` (only rank 0 attaches) or `"all"` (each rank writes
            `output_dir/rank-NNN/`).
        capture_direct_forwards: if False, calls that bypass `nn.Module.__call__`
            (`module.forward(x)`) are neither root forwards nor measured.
        sinks: extra sinks (e.g. `TensorBoardSink(writer)`) receiving the same records.

    Returns:
        The directory this process writes, or None on a rank that attaches nothing.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).
        RuntimeError: `model` already has an observer.
        FileExistsError: `output_dir` already holds a run.

    Example:
        >>> inject_observer(model, output_dir="stats", sampler=EveryNForwardsSampler(100))
        >>> train(model)
        >>> remove_observer(model)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("model: TorchScript modules cannot be observed; observe the eager model")
    if any(isinstance(module, nn.DataParallel) for module in model.modules()):
        raise TypeError(
            "model: nn.DataParallel cannot be observed (its replicas copy each module's __dict__, "
            "forward included, so they would run the original module); use "
            "DistributedDataParallel, or observe a model that is not replicated"
        )
    if not isinstance(output_dir, str | os.PathLike):
        raise TypeError(f"output_dir must be a str or os.PathLike, got {output_dir!r}")
    sampler = TimeIntervalSampler() if sampler is None else sampler
    if not callable(getattr(sampler, "should_sample", None)):
        raise TypeError(
            f"sampler must have should_sample(forward_index) -> bool (a Sampler), got {sampler!r}"
        )
    _check_selector("selector", selector)
    _check_selector("histogram_selector", histogram_selector)
    if (
        isinstance(max_histogram_modules, bool)
        or not isinstance(max_histogram_modules, int)
        or max_histogram_modules < 0
    ):
        raise ValueError(
            f"max_histogram_modules must be an int >= 0, got {max_histogram_modules!r}"
        )
    history_config = HistoryConfig() if history_config is None else history_config
    if not isinstance(history_config, HistoryConfig):
        raise TypeError(f"history_config must be a HistoryConfig, got {history_config!r}")
    rank_policy = validate_rank_policy(rank_policy)
    if not isinstance(capture_direct_forwards, bool):
        raise TypeError(f"capture_direct_forwards must be a bool, got {capture_direct_forwards!r}")
    user_sinks = validate_sinks(sinks)
    measurer = Measurer(reducers)

    if model in _OBSERVERS:
        raise RuntimeError(
            "model already has an observer; call remove_observer(model) before injecting again"
        )
    placement = place_rank(Path(output_dir), rank_policy)
    if not placement.attach:
        return None
    layers = select_layers(model, selector)
    focus = select_focus_layers(layers, histogram_selector, max_histogram_modules)
    check_output_dir(placement.directory)

    infos = tuple(info for _, info in layers)
    run = RunInfo(
        output_dir=placement.directory,
        library_version=library_version(),
        torch_version=torch.__version__,
        model_class=type(model).__name__,
        layers=infos,
        focus_layers=tuple(info.name for info in infos if info.name in focus),
        sampler=describe_sampler(sampler),
        metrics=measurer.metrics,
        rank=placement.rank,
        world_size=placement.world_size,
        rank_policy=rank_policy,
        capture_direct_forwards=capture_direct_forwards,
        buffer_rows=history_config.buffer_rows,
        window=history_config.window,
        started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    directory = DirectorySink(placement.directory, history_config)
    directory.start(run)
    group = SinkGroup(user_sinks)
    group.start(run)
    group.insert_started(directory)
    observer = Observer(
        directory=placement.directory,
        sampler=sampler,
        measurer=measurer,
        sinks=group,
        rank=placement.rank,
        capture_direct_forwards=capture_direct_forwards,
    )
    observer.install(model, layers, focus)
    _OBSERVERS[model] = observer
    # A model dropped (or a process ending) without remove_observer still gets a complete run.
    observer.finalizer = weakref.finalize(model, observer.close)
    return placement.directory


def remove_observer(model: nn.Module) -> Path | None:
    """Stop observing `model`, restore every `forward` exactly, and finish the run's artifacts.

    Flushes the history, merges `history.parts/` into `history.parquet`, writes result.json and
    index.md, and closes the directory's TensorBoard events. On a model without an observer
    (never injected, already removed, or a rank that attached nothing) it does nothing.

    Returns:
        The run directory that was finished, or None if `model` had no observer.
    """
    observer = _OBSERVERS.pop(model, None)
    if observer is None:
        return None
    if observer.finalizer is not None:
        observer.finalizer.detach()
    left_in_place = observer.restore()
    observer.close()
    if left_in_place:
        warnings.warn(
            f"torchinstruments: {left_in_place} module forward(s) were replaced or wrapped after "
            "inject_observer; they were left in place and the proxies inside them are now inert",
            RuntimeWarning,
            stacklevel=2,
        )
    return observer.directory


def has_observer(model: nn.Module) -> bool:
    """True while `model` is observed (between inject_observer and remove_observer)."""
    return model in _OBSERVERS


def _check_selector(name: str, selector: object) -> None:
    """A selector is None or a callable `(name, module) -> bool`."""
    if selector is not None and not callable(selector):
        raise TypeError(
            f"{name} must be a callable (name, module) -> bool or None, got {selector!r}"
        )


def select_layers(model: nn.Module, selector: Selector | None) -> list[tuple[nn.Module, LayerInfo]]:
    """Selected modules in `named_modules()` traversal order; default: leaf modules."""
    layers = []
    for name, module in model.named_modules():
        chosen = selector(name, module) if selector is not None else not any(module.children())
        if chosen and not isinstance(module, torch.jit.ScriptModule):
            layers.append((module, LayerInfo(name, type(module).__name__)))
    return layers


def select_focus_layers(
    layers: Sequence[tuple[nn.Module, LayerInfo]],
    histogram_selector: Selector | None,
    max_histogram_modules: int,
) -> set[str]:
    """Focus layers: the first `max_histogram_modules` observed layers the selector accepts."""
    candidates = [
        info.name
        for module, info in layers
        if histogram_selector is None or histogram_selector(info.name, module)
    ]
    if histogram_selector is not None and not candidates:
        raise ValueError(
            "histogram_selector matched no observed layer; observed layers are: "
            + ", ".join(repr(info.name) for _, info in layers[:20])
            + (" ..." if len(layers) > 20 else "")
        )
    return set(candidates[:max_histogram_modules])
