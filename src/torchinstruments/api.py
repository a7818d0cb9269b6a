"""`inject_observer`, `remove_observer`, `has_observer`, `set_step`: the whole public lifecycle.

Injection is two steps: `ObserverConfig` (config.py) checks every option, then `start_run` checks
the model, opens the run directory and installs the proxies; a mistake fails at injection with a
message naming the argument, before anything touches the model or the disk, never in the middle
of training. `start_run` is the one way a run starts: `inject_observer` builds the config from its
keywords, and a trainer callback hands over the config it built when it was built. Which models
are observed, and how a model is found through torch.compile wrappers, is registry.py's.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, SupportsIndex

import torch
from torch import nn

from torchinstruments import forks
from torchinstruments.bypass import bypassing_copy
from torchinstruments.capture import forward_is_property
from torchinstruments.compilation import (
    compile_notes,
    compiled_modules,
    compiled_original,
    eager_samples_note,
    fullgraph_unchecked_warning,
)
from torchinstruments.config import OPTION_NAMES, ObserverConfig
from torchinstruments.distributed import place_rank
from torchinstruments.fused_paths import fused_path_modules
from torchinstruments.global_option import global_notes, holds_no_dtensor
from torchinstruments.global_statistics import close_run
from torchinstruments.history_config import HistoryConfig
from torchinstruments.left_in_place import forwards_said
from torchinstruments.loss_scale import describe_scaler, scaler_notes
from torchinstruments.measurement.custom import ReducerSpec
from torchinstruments.model_changes import ModelAtInject
from torchinstruments.never_ran import cannot_run, never_ran_warning
from torchinstruments.notices import repr_of, warn
from torchinstruments.observer import Observer
from torchinstruments.reasons import utf8_text
from torchinstruments.records import RunInfo
from torchinstruments.registry import OBSERVERS, UNATTACHED, registered
from torchinstruments.rundir.attempt_states import BY_RESUME
from torchinstruments.rundir.continuation_notes import continuation_notes
from torchinstruments.rundir.output_dir import check_rank_layout, resolve_output_dir
from torchinstruments.rundir.ranges import plural, was_were
from torchinstruments.rundir.shell import layer_span, literal_if_unclear
from torchinstruments.rundir.unsampled import no_sample_warning, passed_through
from torchinstruments.sampling import describe_sampler
from torchinstruments.selection import (
    Selector,
    property_note,
    select_focus_layers,
    select_layers,
    torchscript_note,
)
from torchinstruments.sinks.directory import DirectorySink
from torchinstruments.sinks.dispatch import SinkGroup
from torchinstruments.sinks.protocol import Sink

__all__ = [
    "check_model",
    "global_notes",
    "has_observer",
    "inject_observer",
    "library_version",
    "remove_observer",
    "set_step",
    "start_run",
]

# Why a model has no observer: a copy is the likeliest surprise (a model sent to a process started
# with 'spawn' or 'forkserver' is unpickled there), and it cannot be told from a model never observed.
_NO_OBSERVER_WHY = (
    "never injected, already removed, or a copy of an observed model: deepcopy, pickle, torch.load "
    "and a process started with 'spawn' or 'forkserver' get a plain, unobserved model"
)


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
    reducers: Sequence[ReducerSpec] | Mapping[str, Callable[..., object]] | None = None,
    histogram_selector: Selector | None = None,
    max_histogram_modules: int = 8,
    history_config: HistoryConfig | None = None,
    rank_policy: str = "rank0",
    capture_direct_forwards: bool = True,
    sinks: Sequence[Sink] = (),
    resume: bool = False,
    global_statistics: Any = False,
    global_statistics_timeout: Any = None,
    grad_scaler: Any = None,
) -> Path | None:
    """Start observing `model`: sampled root forwards and their backward are measured and written.

    Args:
        model: the module your loop calls; its calls are the root forwards.
        output_dir: run directory; must not already hold a run.
        sampler: decides per root forward (`Sampler`); default `TimeIntervalSampler(60)`.
        selector: `selector(name, module) -> bool` picks layers; default: the modules that
            compute: leaf modules (an empty container aside), and as one layer a module that
            hands its children's weights or settings to a kernel instead of calling them
            (`nn.MultiheadAttention`) or is parametrized by `torch.nn.utils.parametrize`
            (`weight_norm`); see selection.py.
        reducers: custom scalar metrics added to the default profile: `Reducer` objects (e.g.
            `AbsMax()`, `L2Norm()`), `{metric_name: fn}` mappings, or named functions
            `fn(tensor) -> scalar` (the metric is named after the function); include a
            `DefaultStatistics(...)` to replace or trim the default profile.
        histogram_selector: `(name, module) -> bool` picks focus layers among the observed ones;
            default: all observed, in traversal order.
        max_histogram_modules: at most this many focus layers, >= 1 (a limit on modules, not
            tags; histograms are always on, so 0 is refused).
        history_config: Parquet chunk size and result.json window size.
        rank_policy: `"rank0"` (only rank 0 attaches) or `"all"` (each rank writes
            `output_dir/rank-NNN/`).
        capture_direct_forwards: if False, calls that bypass `nn.Module.__call__`
            (`module.forward(x)`) are neither root forwards nor measured.
        sinks: extra sinks (e.g. `TensorBoardSink(writer)`) receiving the same records.
        resume: if True and `output_dir` already holds a run (a restarted job), continue it:
            an earlier attempt that was killed is finalized first, its rows stay as they are,
            sample_id and forward_index continue, and each row's `attempt` column says which
            process wrote it. Without a run there, a new one starts. Default False: such a
            directory is refused.
        global_statistics: False (default: no collective ever); True: DTensor outputs with a
            Shard or Partial placement (1-D mesh) are measured as the whole tensor they stand
            for, exactly, over the mesh's ranks (a model holding no DTensor parameter or buffer
            at inject: no collective at all, its DTensors local); a `ProcessGroup`: also
            every other floating output, as the union of that group's ranks' tensors (e.g.
            the data-parallel global batch). Rows then say `population="global:ranks=..."`.
            Costs a fixed number of packed collectives per sampled forward (see
            `global_statistics.py`); needs `rank_policy="all"` and a sampler that decides the
            same on every rank (`EveryNForwardsSampler`).
        global_statistics_timeout: how long a rank waits in those collectives for the other
            ranks (seconds or a `timedelta`, finite, > 0; default None: 60 s); a wait that
            runs out stops global statistics for the rest of the run (null rows, a reason).
            Raise it when ranks can be minutes apart at a sampled forward (one rank compiling).
        grad_scaler: the `torch.amp.GradScaler` the loop scales its loss with (float16
            autocast), or None. Gradient rows stay as plain hooks see them (times the loss
            scale); the scale of each sample is recorded (`.state.json`, index.md, with a query
            that divides the rows by it). The trainer callbacks pass their trainer's own.

    Returns:
        The directory this process writes, or None on a rank that attaches nothing.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).
        RuntimeError: `model` already has an observer.
        FileExistsError: `output_dir` already holds a run (and `resume` is False), or
            `resume` cannot continue it (the message says why).
        RunLockedError: `resume` and a live process still writes the run.
        OSError: `output_dir` cannot hold the run: a first write there failed (the same kind,
            e.g. PermissionError; the message names output_dir), or did not return within a
            flush interval, at least 10 s (TimeoutError: a file system that stopped answering).

    Example:
        >>> inject_observer(model, output_dir="stats", sampler=EveryNForwardsSampler(100))
        >>> train(model)
        >>> remove_observer(model)
    """
    arguments = locals()  # first, so exactly the parameters: ObserverConfig's fields and model
    config = ObserverConfig(**{name: arguments[name] for name in OPTION_NAMES})
    return start_run(model, config)


def remove_observer(model: nn.Module) -> Path | None:
    """Stop observing `model`, restore every `forward` exactly, and finish the run's artifacts.

    Flushes the history, merges `history.parts/` into `history.parquet`, writes result.json and
    index.md, and closes the directory's TensorBoard events. `model` may be the module given
    to `inject_observer` or a `torch.compile` wrapper of it (or the module a wrapper given to
    `inject_observer` compiles). On a rank that attached nothing it does nothing, quietly; on a
    model that has no observer (never injected, already removed, or a copy) it does nothing and warns,
    so a `try/finally` that removes is always safe, and a removal that missed is never silent.
    In a process forked from the observing one it only restores the forwards there (the run
    is the parent's: nothing of it is touched) and returns None.

    Returns:
        The run directory that was finished, or None if `model` had no observer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"remove_observer(model): model must be the nn.Module given to inject_observer "
            f"(or its torch.compile wrapper), got {type(model).__name__} {model!r}"
        )
    key = registered(model)
    if key is None:
        if model in UNATTACHED:
            UNATTACHED.discard(model)
            return None
        warn(
            f"torchinstruments: remove_observer: this {type(model).__name__} has no observer "
            f"({_NO_OBSERVER_WHY}); nothing was done"
        )
        return None
    observer = OBSERVERS.pop(key)
    if observer.forked:  # a forked child: the run is the parent's (forks.py)
        observer.remove()  # restores the forwards; the observer is closed already
        return None
    changed = None if observer.at_inject is None else observer.at_inject.changes_note(model)
    if changed is not None:
        observer.notes.append(changed(layer_span))  # before the removal, which writes index.md
    idle = observer.counter.never_ran(observer.layer_names)
    quiet, notes, fused = cannot_run(
        model, idle, [name for name in observer.layer_names if name not in idle]
    )
    observer.notes.extend(notes)  # index.md names them; the warning leaves them out
    if not observer.counter.root_forwards and observer.layer_names:
        observer.counter.bypassed_by = bypassing_copy(model)  # before the root proxy goes
    left_in_place = observer.remove()
    if changed is not None:
        warn(f"torchinstruments: {changed(repr)}")
    never_ran = [n for n in observer.counter.never_ran(observer.layer_names) if n not in quiet]
    if observer.counter.samples and never_ran:
        total = len(observer.layer_names)
        warn(never_ran_warning(never_ran, total, observer.counter.samples, fused))
    counts = observer.counts()
    calls = observer.called_compiled
    if said := fullgraph_unchecked_warning(calls, counts.root_forwards, counts.samples):
        warn(said)
    if counts.samples == 0 and observer.layer_names:
        warn(no_sample_warning(counts, observer.directory, observer.continued))
    if left_in_place:
        warn(
            f"torchinstruments: {len(left_in_place)} module forward(s) were replaced or wrapped "
            f"after inject_observer ({forwards_said(left_in_place)}); they were left in place and the "
            "proxies inside them are now inert; calls through a replacement that skipped the "
            "proxy were not observed (index.md says so)"
        )
    directory = observer.directory
    if observer.global_option is not None:
        close_run(observer.global_option)  # the library's process groups, made at inject
        # The observer's objects form reference cycles, which the collector frees later, at the
        # latest at the interpreter's end: there, those of a run that measured global statistics
        # of outputs under torch.func.vmap aborted the process (SIGABRT, "terminate called
        # without an active exception") in about a third of runs, after destroy_process_group.
        # Freed now, while the process group lives: one full collection per removal, on the
        # distributed runs that measure globally only.
        del observer
        gc.collect()
    return directory


def has_observer(model: nn.Module) -> bool:
    """True while `model` is observed (between inject_observer and remove_observer).

    Sees through torch.compile wrappers like `remove_observer`: `has_observer(torch.compile(m))`
    is True while `m` is observed, and the other way round.
    """
    return registered(model) is not None


# The history's `step` column is Int64: a step beyond it could not be written.
_STEP_RANGE = range(-(2**63), 2**63)


def _step_value(step: SupportsIndex) -> int:
    """`step` as a Python int, refused here when it is not one (naming `set_step`), or beyond
    Int64: such a step was accepted, and every history part holding one then failed to write,
    losing the rows of every sample in it."""
    if isinstance(step, bool):
        raise TypeError(f"set_step: step must be an integer or None, got {step!r}")
    try:
        value = operator.index(step)
    except Exception:  # a float, a str; a tensor that cannot be read (on the meta device)
        raise TypeError(
            f"set_step: step must be an integer or None, got {step!r} ({type(step).__name__})"
        ) from None
    if value not in _STEP_RANGE:
        raise ValueError(
            f"set_step: step must fit the history's Int64 step column (-2**63 to 2**63 - 1), "
            f"got {value}"
        )
    return value


def set_step(model: nn.Module, step: SupportsIndex | None) -> None:
    """Give the step of the samples taken from now on: history's `step` column.

    Call it from the training loop, once per step, before the model's forward; nothing on the
    model changes. Samples taken before the first call, or after `set_step(model, None)`, have
    a null step. On a rank that attaches nothing it does nothing. Under a trainer callback the
    trainer's global step is used and a value given here is ignored.

    Args:
        model: the observed model (or a torch.compile wrapper of it).
        step: an integer (Python, NumPy or 0-d integer tensor), or None for "no step".

    Raises:
        TypeError: `step` is not an integer (a bool or a float is refused). A model without an
            observer (never injected, or removed) is warned about, not refused: the loop goes on.
        ValueError: `step` is beyond the history's Int64 `step` column.

    Example:
        >>> for step, (x, y) in enumerate(loader):
        ...     set_step(model, step)
        ...     loss_fn(model(x), y).backward()
    """
    value = None if step is None else _step_value(step)
    key = registered(model)
    if key is None:
        if model not in UNATTACHED:
            warn(
                f"torchinstruments: set_step: this {type(model).__name__} has no observer "
                f"({_NO_OBSERVER_WHY}); the step was not recorded"
            )
        return
    OBSERVERS[key].step = value


def check_model(model: object) -> None:
    """Refuse a model that cannot be observed, naming why (before anything is touched)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"model must be an eager nn.Module, got a TorchScript {type(model).__name__}: "
            "TorchScript modules cannot be observed; observe the eager model"
        )
    if forward_is_property(model):
        raise TypeError(
            f"model's class {type(model).__name__} defines forward as a property, which Python "
            "reads before the instance forward the observer installs, so its calls could not be "
            "observed: define forward as a method (it may call what the property returns), or "
            "observe a module that calls this one"
        )
    for name, module in model.named_modules():
        if isinstance(module, nn.DataParallel):
            where = "model" if not name else f"model.{name}"
            raise TypeError(
                f"model must not hold an nn.DataParallel, got one at {where} (its replicas copy "
                "each module's __dict__, forward included, so they would run the original "
                "module): use DistributedDataParallel, or observe a model that is not replicated"
            )


def start_run(
    model: nn.Module,
    config: ObserverConfig,
    *,
    directory: Path | None = None,
    resume: bool = False,
    continued_by: str | None = None,
    extra_sinks: Sequence[Sink] = (),
    sampler: Any = None,
    sampler_line: str | None = None,
    grad_scaler: Any = None,
) -> Path | None:
    """Observe `model` with `config`: the one way a run starts (`inject_observer`, the callbacks).

    The run keeps `config` itself (`Observer.config`): a trainer callback builds its config once,
    when it is built, and that object is the run's; nothing is rebuilt or checked again. What a
    callback only learns at the start of a fit comes as the arguments below, never as a changed
    copy of the options.

    Args:
        model: the module to observe (checked here).
        config: the run's options, already checked.
        directory: where the run goes instead of `config.directory` (a callback's default,
            under the trainer's own directory).
        resume: continue a run already there even if `config.resume` is False (a fit resumed
            from a checkpoint).
        continued_by: `resume` is a trainer callback's, and why (`rundir.attempt_states`:
            `BY_CHECKPOINT` for a fit resumed from a checkpoint, `BY_RETRY` for a trainer's
            retry of its training loop); the run's state records it, and `show` says so rather
            than "resume=True". None: the caller's own resume.
        extra_sinks: sinks after `config.sinks` (a trainer's TensorBoard logger).
        sampler: the sampler this run asks instead of `config.sampler` (a trainer callback's
            fresh copy of it for each fit, so one fit's sampler state never reaches the next).
        sampler_line: index.md's sampler line instead of the sampler's description (a
            callback's, where the sampler is not asked with forward_index).
        grad_scaler: the trainer's own loss scaler (a callback's), used where
            `config.grad_scaler` is None.

    Returns:
        The directory this process writes, or None on a rank that attaches nothing.

    Raises:
        TypeError: `model` cannot be observed.
        RuntimeError: `model` already has an observer, or this process was forked from one
            that had opened a run (live at the fork or ended before it; see forks.py).
        FileExistsError: the directory already holds a run (and neither `resume` nor
            `config.resume` is set), or the run there cannot be continued.
    """
    check_model(model)
    if forks.forked_from_a_run():
        raise RuntimeError(
            "inject_observer: this process was forked from a process with a live "
            "torchinstruments run, or one that had ended; Polars' thread pool (every run uses "
            "it) and the parent's locks do not survive a fork, so a run here could hang. Start "
            "the child with the 'spawn' or 'forkserver' method "
            "(torch.multiprocessing.set_start_method('spawn')) and inject in it, or fork before "
            "the parent's first inject_observer"
        )
    if registered(model) is not None:
        raise RuntimeError(
            "model already has an observer (directly or through a torch.compile wrapper); call "
            "remove_observer(model) before injecting again"
        )
    _refuse_held_sinks(config.sinks)
    observer = _open_run(
        model,
        config,
        config.directory if directory is None else resolve_output_dir(directory),
        (continued_by or BY_RESUME) if resume or config.resume else None,
        (*config.sinks, *extra_sinks),
        config.sampler if sampler is None else sampler,
        describe_sampler(config.sampler) if sampler_line is None else sampler_line,
        grad_scaler if config.grad_scaler is None else config.grad_scaler,
    )
    if observer is None:
        UNATTACHED.add(model)
        return None
    OBSERVERS[model] = observer
    observer.attached = lambda: list(OBSERVERS.values())
    return observer.directory


def _refuse_held_sinks(sinks: Sequence[Sink]) -> None:
    """Refuse a sink a live run already writes to (two observed models, a GAN's generator and
    discriminator, given one sink): it started and closed twice and took both runs' records
    under the same layer names, a TensorBoardSink two events a step for a layer both models
    have, of which TensorBoard shows one; nothing said so."""
    for index, sink in enumerate(sinks):
        for observer in list(OBSERVERS.values()):
            if not observer.closed and observer.sinks.holds(sink):
                raise ValueError(
                    f"sinks[{index}] ({literal_if_unclear(repr_of(sink))}) is a sink of the live "
                    f"run in {literal_if_unclear(str(observer.directory))}: it would take both "
                    "runs' records under the same layer names (a TensorBoardSink: two events "
                    "a step for a layer both models have, of which TensorBoard shows one); give "
                    "each observed model a sink of its own, or call remove_observer on the "
                    "other model first"
                )


def _open_run(
    model: nn.Module,
    config: ObserverConfig,
    output_dir: Path,
    resume: str | None,
    sinks: Sequence[Sink],
    sampler: Any,
    sampler_line: str,
    grad_scaler: Any,
) -> Observer | None:
    """Place this rank, select layers, open the run directory and install the proxies
    (`resume`: continue a run there, and how it was asked for, `rundir.attempt_states`).

    Returns:
        The running observer, or None on a rank that attaches nothing.
    """
    placement = place_rank(output_dir, config.rank_policy)
    if not placement.attach:
        return None
    check_rank_layout(output_dir, placement.directory)
    layers = select_layers(model, config.selector)
    focus = select_focus_layers(
        model, layers, config.histogram_selector, config.max_histogram_modules
    )
    infos = tuple(info for _, info in layers)
    history = config.history
    no_dtensor = holds_no_dtensor(config.global_option, model)  # alike on every rank
    run = RunInfo(
        output_dir=placement.directory,
        library_version=library_version(),
        torch_version=torch.version.__version__,
        model_class=type(compiled_original(model) or model).__name__,
        layers=infos,
        focus_layers=tuple(info.name for info in infos if info.name in focus),
        sampler=sampler_line,
        metrics=config.measurer.metrics,
        rank=placement.rank,
        world_size=placement.world_size,
        rank_policy=config.rank_policy,
        capture_direct_forwards=config.capture_direct_forwards,
        # The cap in force, stated in index.md even where the option was left at None.
        history=dataclasses.replace(history, max_buffered_rows=history.buffered_rows_cap),
        started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        notes=(
            *compile_notes(model),
            *torchscript_note(model),
            *property_note(model),
            *global_notes(config.global_option, no_dtensor),
            *scaler_notes(describe_scaler(grad_scaler)),
        ),
        grad_scaler=describe_scaler(grad_scaler),
        fused_paths=tuple(utf8_text(name) for name, _ in fused_path_modules(model, layers)),
    )
    directory = DirectorySink(run.output_dir, history)
    # Refuses a directory that already holds a run, or (resume) continues it.
    continuation = directory.open_run(
        run, resume=resume is not None, continued_by=resume or BY_RESUME
    )
    for note in run.notes:
        warn(f"torchinstruments: {note}")
    group = SinkGroup(sinks)
    group.start(run)
    group.insert_started(directory)
    observer = Observer(
        config=config,
        run=run,
        sinks=group,
        sampler=sampler,
        continuation=continuation,
        no_dtensor=no_dtensor,
    )
    observer.loss_scales.scaler = grad_scaler  # the config's, or the trainer's
    observer.counter.taken = directory.ids_taken  # each sample's ids marked as it is taken
    for said in (
        continuation_notes(continuation, run.metrics, run.focus_layers) if continuation else ()
    ):
        observer.sinks.add_note(said)
        warn(f"torchinstruments: {said}")
    observer.install(model, layers, focus)
    compiled = compiled_modules(model)  # once: a live note's, never a walk per flush round
    directory.follow_notes(functools.partial(_notes_so_far, observer, group, compiled))
    directory.live_scales.follow(observer.loss_scales.spans)  # rundir.live_scales
    observer.at_inject = ModelAtInject(model, layers, config.selector)
    forks.track(observer)
    return observer


def _notes_so_far(observer: Observer, group: SinkGroup, compiled: list[str]) -> tuple[str, ...]:
    """What the run has said so far, which the flush thread keeps in the run state so that a
    run killed before removal still says it (`rundir.live_notes`): the observer's notes, the
    sinks' (the TensorBoard sinks', a trainer callback's: `SinkGroup.live_notes`), the samples
    called through compiled code and the `compiled` modules of inject (removal walks the model
    again: here that would cost each round), and a trainer callback's evaluation forwards so
    far, passed through or seen with record_eval (the fit's end says their whole count; a run
    killed before it has this lower bound)."""
    counts = observer.counts(so_far=True)
    # the setup forwards' count is final when the fit's first loop starts, and said then
    passed = passed_through(dataclasses.replace(counts, unobserved_setup_forwards=0))
    seen = counts.eval_forwards  # nonzero only under a trainer callback's record_eval
    said = [] if passed is None else [passed]
    if seen:
        said.append(f"{plural(seen, 'evaluation forward')} {was_were(seen)} seen (record_eval)")
    so_far = (
        f"up to the run's last save of its state while it went on, {' and '.join(said)} (a "
        "lower bound where the run ended without removal: the fit's end gives the whole count)"
    )
    eager = eager_samples_note(None, counts.samples, observer.called_compiled, compiled)
    live = (*((eager,) if eager else ()), *((so_far,) if said else ()))
    return (*counts.notes, *group.live_notes(), *live)
