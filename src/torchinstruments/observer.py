"""The running observer: root forwards, samples, call indices; recording.py records the values.

One `Observer` serves one model. Its state lives here, outside the model: the proxies hold the
observer, the observer holds the model's modules only through weak references, so a model that
is dropped without `remove_observer` is collected and its run is finalized by `weakref.finalize`.

Timing of work, by design:
- unsampled root forward: one Python call of `on_root_call` (counter, sampler) and nothing per
  layer: layer proxies are installed only for the duration of a sampled root forward;
- sampled root forward: each tensor is measured as it was returned (the lane's or the spare
  core's copy, host statistics, or device reductions crossing in one transfer at the end);
- backward: `gradients.GradientRecorder` (the hooks on sampled outputs, one transfer per pass).

A value's path, from a layer's return to the sinks' rows, is recording.py's.

Fused fast paths (an `nn.TransformerEncoderLayer` in eval running one kernel that calls none of
its submodules): a sampled forward runs them layer by layer (fused_paths.py); unsampled forwards
keep the fused kernel, bit-identical.

Coverage: per selected layer the observer counts the sampled forwards in which it was called
(`RunCounts.layer_samples`, shown in index.md and result.json); removal warns once about layers
that never ran in one. A layer `forward` replaced between forwards is still observed (the proxy
goes on top of the replacement for each sampled forward); one replaced during a sampled forward
keeps the proxy inside it, and that is warned about when the forward ends. The root's class
`forward` replaced (fx's `recompile()`) is followed at its next call (`_follow_class_forward`).

torch.compile: `on_root_call` is never compiled (compilation.exclude_from_compilation) and decides
with compilation paused; an unsampled forward then calls the compiled forward as the plain model
would, so it runs the same graphs with the same guards (no layer proxy is installed then). A
sampled forward runs eagerly (compilation.call_eagerly): the same rows as an eager run, at the cost
of one eager step, and its outputs are eager numerics. Compiled code is never traced with a
proxy in it, so alternating sampled and unsampled steps never recompiles; the one exception is
a higher-order op compiling its body in a sampled forward (`torch.cond`), whose layers then run
unmeasured, which the run says (compilation.TracedLayers).

Threads: the open sample and the root depth are per thread, so a model run from several threads
keeps each thread's forwards apart; a selected layer called on a thread without a root forward
of its own (a thread pool inside the forward) belongs to the one sampled forward in flight, and
calls no sample can take are counted and said (`samples.py` explains the decision). A call on a
thread in a root forward of another observed model (a layer both models share) is that model's.

Ctrl-C: a sampled forward's start and end, and a backward pass's end, run with SIGINT held
(interrupts.py), so a Ctrl-C reaches the user's handler right after them and never cuts a sample
in half. The thread's root depth is set before the sampling decision and back to 0 only once a
sampled forward's end is complete; a KeyboardInterrupt that still cuts it (not delivered through
Python's SIGINT handler) leaves the depth above 0, and the thread's next root forward (which
reads the depth anyway: nothing more on the unsampled path) or the removal tells that from a
call of the root inside its own forward (`_torch_internals.running`, a walk up the stack) and finishes
the end (`_heal`: the layers' proxies off, the sample ended and written, marked, said once).

Root forwards: the outermost call of the root's `forward` (via `model(x)` or `model.forward(x)`).
A call of the root inside its own forward is part of the enclosing root forward: it is not
counted, not sampled on its own, and (if the root is a selected layer) gets the next call_index.
A call of the root made during a backward pass (`checkpoint(model, x)` recomputing the forward)
is torch's, not a root forward: it runs unobserved and is counted apart (counting.py).
A selected layer called outside any root forward (for instance `self.encoder(x)` in a Lightning
step when the LightningModule is the root) is not observed: it runs untouched and nothing is
recorded; inject into the module your loop calls. An encoder-decoder's generate() runs its encoder
so, then hands its outputs to each token's root forward: that is said (encoder_outputs.py).
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from torchinstruments import forks, reasons
from torchinstruments._torch_internals import (
    is_tracing,
    ran_by_a_backward,
    running,
)
from torchinstruments._torch_internals.dynamo import called_within
from torchinstruments.capture import LayerCapture, Proxies, by_module_call
from torchinstruments.compilation import (
    CompiledCalls,
    ForwardEntry,
    TracedLayers,
    call_eagerly,
    eager_samples_note,
    exclude_from_compilation,
    pause_compilation,
    resume_compilation,
    wrapped_before_inject_note,
)
from torchinstruments.config import ObserverConfig
from torchinstruments.counting import Counter, recomputed_note
from torchinstruments.deferred_forwards import say_deferred
from torchinstruments.distributed import joined_after_inject
from torchinstruments.eager_backward import release_held_backwards
from torchinstruments.encoder_outputs import EncoderOutputs
from torchinstruments.failed_measurements import FailedMeasurements
from torchinstruments.global_statistics import open_run
from torchinstruments.interrupts import NOT_HELD, SIGINT, hold_signal, release
from torchinstruments.left_in_place import Forward, left_in_place_note
from torchinstruments.loss_scale import LossScales
from torchinstruments.model_changes import ModelAtInject
from torchinstruments.notices import RecordingFailures, warn
from torchinstruments.phases import PASSED_THROUGH, TRAIN, Phases
from torchinstruments.rebuilt_forwards import THROUGH_CODE, compiled_through_note
from torchinstruments.recording import Recording
from torchinstruments.records import (
    LayerInfo,
    Measurement,
    RunCounts,
    RunInfo,
    SampleFacts,
    module_type,
)
from torchinstruments.rundir.attempts import UNREMOVED_NOTE, Continuation
from torchinstruments.samples import (
    InFlight,
    Sample,
    backward_marker,
    cut_note,
    no_backward_before_removal_note,
    removed_in_flight_note,
)
from torchinstruments.sampling import ask, read_step
from torchinstruments.sinks.dispatch import SinkGroup
from torchinstruments.spare_core import SpareCore
from torchinstruments.unremoved import finalize_unremoved

__all__ = ["Observer"]

# What `_begin_root_forward` returns besides a sample or None (unsampled).
_PASS_THROUGH = object()  # closed, tracing, or a direct call not captured
_NESTED = object()  # a root call inside a root forward of the same thread


class Observer:
    """Runtime state of one observed model; created by `inject_observer`.

    Args:
        config: the run's options, kept as given (`self.config`: the object the caller built).
        run: the run this observer records (its directory, and the rank written into records).
        sinks: the run directory first, then the caller's sinks.
        sampler: the sampler to ask instead of `config.sampler` (None: `config.sampler`).
        continuation: where a continued run's attempt starts (None: a new run).
        no_dtensor: `global_option.holds_no_dtensor` of the model (True: no global collective).
    """

    def __init__(
        self,
        *,
        config: ObserverConfig,
        run: RunInfo,
        sinks: SinkGroup,
        sampler: Any = None,
        continuation: Continuation | None = None,
        no_dtensor: bool = False,
    ) -> None:
        self.config, self.directory = config, run.output_dir
        # any object with should_sample (checked by config); a callback's fresh copy of it
        self.sampler: Any = config.sampler if sampler is None else sampler
        self.measurer = config.measurer.for_run()  # its warnings and keys this run's own
        self.capture_direct_forwards = config.capture_direct_forwards
        self.sinks = sinks
        self.rank = run.rank
        self.global_option = open_run(config.global_option, no_dtensor)  # its groups, made now
        # A continued run (resume=True) numbers its forwards and samples after the earlier ones.
        # Each sampler's schedule continues too (`rundir.attempts.plan_continuation`).
        self.continued = continuation  # what removal says of the earlier attempts' samples
        c = continuation
        self.counter = Counter(
            0 if c is None else c.first_forward_index,
            0 if c is None else c.first_sample_id,
            None if c is None else c.first_train_index,
            0 if c is None else c.first_eval_index,
        )
        # The sampled root forwards in flight (samples.py); `in_flight.samples.__len__` is every
        # layer proxy's `enabled` test, evaluated in wrapt's C code.
        self.in_flight = InFlight(self.counter, self.warn_once)
        # Root depth and the open sample are per thread: a model run from several threads keeps
        # each thread's forwards apart. Counts and the sampler are shared, under one lock.
        self._local = threading.local()
        # Every attached observer of the process (`registry.OBSERVERS`, set at inject by api.py):
        # a layer two observed models share is measured for the model whose forward called it.
        self.attached: Callable[[], Iterable[Observer]] = tuple
        self.closed = self.forked = False  # forked: in a process forked from its maker (forks.py)
        self._parent_pid = os.getpid()
        self.proxies = Proxies(self.warn_once)
        self._finalizer: weakref.finalize | None = None
        self._entry = ForwardEntry()
        self._entry_checked = False  # how compiled code calls the root: read once (`_check_entry`)
        self._root_layer: LayerCapture | None = None
        self._class_forward: object = None  # the class forward the root's proxy wraps, if any
        self._root_ref: weakref.ref[nn.Module] | None = None
        self._root_type = ""
        self.layer_names: tuple[str, ...] = ()
        self.at_inject: ModelAtInject | None = None  # what changed is said at removal (api)
        self._warned: set[str] = set()
        # Failures that leave rows out, or null + reason: warned once, said in index.md (`counts`).
        self.failed_once = RecordingFailures(self.warn_once)
        self.failed_measurements = FailedMeasurements(self.warn_once, self.measurer.extra_keys)
        self.loss_scales = LossScales(config.grad_scaler, self.failed_once, self.warn_once)
        self.notes: list[str] = []  # `tensors.TORCH_FUNC_NOTE` and the like, in the order seen
        self.removed_after: str | None = None  # the exception a trainer's fit ended with
        self.cut_samples: list[int] = []  # samples whose end an interrupt cut (`_heal`)
        self.called_compiled = CompiledCalls()  # ran eagerly; index.md says so
        self.traced = TracedLayers()  # layers a torch.cond compiled: said
        self.spare = SpareCore()  # plain CPU tensors measured on a core torch leaves idle
        # A sample's values to the sinks (recording.py); bound once, so a layer call and a
        # sample's end cost no lookup more than they did as this class's methods.
        self.recording = Recording(
            measurer=self.measurer,
            rank=self.rank,
            sinks=sinks,
            global_option=self.global_option,
            spare=self.spare,
            counter=self.counter,
            failed_once=self.failed_once,
            failed_measurements=self.failed_measurements,
            loss_scales=self.loss_scales,
            notes=self.notes,
            warn_once=self.warn_once,
        )
        self.record_output = self.recording.record_output  # capture.LayerCapture calls it
        self._emit_forward = self.recording.emit_forward
        self.gradients = self.recording.gradients
        # The `step` column: a value a plain loop sets (`set_step`), or a trainer's step read at
        # each sampled forward (`follow_step`, for the callbacks); None for neither.
        self.step: int | None = None
        self.step_source: Callable[[], object] | None = None
        self.phases = Phases()  # which schedule a root forward is on (trainer callbacks)
        self.encoder_outputs = EncoderOutputs(self.warn_once)  # said in index.md

    def install(
        self, root: nn.Module, layers: Sequence[tuple[nn.Module, LayerInfo]], focus: set[str]
    ) -> None:
        """Install the root's proxy (which delimits root forwards). Layer proxies, and a fused-path
        guard on every module that could skip selected layers with a fused kernel, are installed
        per sampled forward (`Proxies.install_layers`). A model dropped (or a process ending)
        without `remove` still gets a complete run: it closes when `root` is garbage collected,
        with a note (unremoved.py)."""
        self._root_layer = self.proxies.register(self, root, layers, focus)
        self.layer_names = tuple(info.name for _, info in layers)
        self.gradients.gaps.weigh(layers)  # which layers hold parameters
        self._root_ref, self._root_type = weakref.ref(root), module_type(root)
        if "forward" not in vars(root):  # else the proxy wraps the root's own: nothing to follow
            self._class_forward = type(root).forward
        self.proxies.install_root(root, self.on_root_call)
        self._finalizer = finalize_unremoved(root, self)  # with a note on why it ended

    def remove(self) -> tuple[Forward, ...]:
        """Undo every proxy and close; returns the forwards whose proxy was left in place
        (replaced or wrapped by someone else), which index.md names too."""
        if self._finalizer is not None:
            self._finalizer.detach()
        if getattr(self._local, "depth", 0) > 0 and not running(_ROOT_CODE, self):
            self._heal()  # this thread's last sampled forward was cut: ended, marked
        left_in_place = self.proxies.restore()
        if left_in_place and not self.closed:
            self.notes.append(left_in_place_note(left_in_place))  # said in index.md
        self.close()
        return left_in_place

    def on_root_call(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        """Count root forwards, ask the sampler, and hold the sample open while the forward runs.

        Never compiled (see the end of this module); compilation is paused while it decides, so
        its bookkeeping never ends up in a graph, and resumed for an unsampled forward.
        """
        paused = pause_compilation()
        try:
            if self._class_forward is not None:
                # A staticmethod or plain callable as forward gives no instance, a classmethod
                # its class: the root is then the one the proxy was installed on.
                root = instance if isinstance(instance, nn.Module) else None
                if root is None and self._root_ref is not None:
                    root = self._root_ref()
                if root is not None:  # None: the model was collected, nothing to follow
                    now = type(root).forward
                    # `!=` after `is not`: a classmethod gives a new bound method at each
                    # lookup, equal to the last while the class's forward is the same one.
                    if now is not self._class_forward and now != self._class_forward:
                        wrapped = self._follow_class_forward(root)
            if paused is not None and not self._entry_checked:
                self._check_entry()
            sample = self._begin_root_forward()
        except BaseException:
            resume_compilation(paused)
            raise
        if sample is _PASS_THROUGH:
            resume_compilation(paused)
            return wrapped(*args, **kwargs)
        if sample is _NESTED:
            resume_compilation(paused)
            return self._call_nested(wrapped, args, kwargs)
        local = self._local
        if sample is None:
            # Compiled, if the model is: entered as torch.compile enters the plain model.
            through_caller = paused is not None and self._entry.through_caller(wrapped)
            resume_compilation(paused)
            try:  # `_begin_root_forward` set the thread's depth to 1
                if through_caller:
                    return self._entry.call_forward(wrapped, args, kwargs)
                return wrapped(*args, **kwargs)
            finally:
                local.depth = 0
        if paused is not None:  # called from compiled code: this sample runs eagerly
            self.called_compiled.add()
        try:
            return self._run_sample(sample, wrapped, args, kwargs)  # type: ignore[arg-type]
        finally:
            resume_compilation(paused)

    def _check_entry(self) -> None:
        """At the first root forward called from compiled code: a compiled wrapper made before
        inject that breaks the graph at the root is said, once (`wrapped_before_inject_note`)."""
        self._entry_checked = True
        root = self._root_ref() if self._root_ref is not None and not self.closed else None
        try:
            note = wrapped_before_inject_note(root, _ROOT_CODE)
            if note is None and root is not None and called_within(THROUGH_CODE, 4):
                note = compiled_through_note(type(root).__name__)  # rebuilt_forwards.py
        except Exception:  # a torch whose frames differ: nothing is said, the step goes on
            return
        if note is not None:
            self.notes.append(note)  # index.md, live and at removal
            warn(f"torchinstruments: {note}")

    def _follow_class_forward(self, root: nn.Module) -> Callable[..., Any]:
        """The root's class `forward` was replaced since the proxy was made (a torch.fx
        GraphModule's `recompile()`, an assignment to the class): the root runs the new one."""
        self._entry = ForwardEntry()  # how compiled code enters it is decided again
        self._class_forward = type(root).forward
        return self.proxies.follow_class_forward(root)

    def _begin_root_forward(self) -> Sample | object | None:
        """Classify a call of the root: pass through, nested, unsampled (None), or a new sample."""
        if self.closed:
            if self.forked:  # the child's first root forward: said once
                self.warn_once(
                    "forked", forks.forked_child_message(self._parent_pid, self.directory)
                )
            return _PASS_THROUGH
        direct = not self.capture_direct_forwards and not by_module_call(self._root_ref)
        if is_tracing() or direct:
            return _PASS_THROUGH
        local = self._local
        if getattr(local, "depth", 0) > 0:
            if running(_ROOT_CODE, self):
                return _NESTED
            self._heal()  # the end of this thread's last sampled forward was cut
        if ran_by_a_backward():  # checkpointing's recomputation: no root forward (counting.py)
            self.counter.count_recomputed()
            self.warn_once("recomputed", recomputed_note())
            return _PASS_THROUGH
        release_held_backwards()  # a sampled backward that raised left torch.compile off
        schedule = self.phases.of_call() if self.phases.following else self.phases.current
        if schedule != TRAIN and self.phases.fit_ended():  # the callback removed the observer
            return _PASS_THROUGH
        if schedule in PASSED_THROUGH:
            self.counter.count_unobserved(schedule)
            return _PASS_THROUGH
        # Before the decision, and back to 0 only once a sampled forward's end is complete: a
        # Ctrl-C that cuts it leaves the depth above 0, which the next root forward reads anyway.
        local.depth = 1
        forward_index, sample_id, held = self.counter.next_forward(self._should_sample, schedule)
        if sample_id is None:
            return None
        try:  # held from the decision on (counting.py): released once the forward is called
            mode = self.phases.mode_of(schedule)  # phases.py
            local.sample = Sample(sample_id, forward_index, self.current_step(), mode)
            local.sample.held = held
            if self.global_option is not None:  # only its header reads the kind of forward
                root = self._root_ref() if self._root_ref is not None else None
                training = "train" if root is None or root.training else "eval"
                local.sample.kind = (mode or training, torch.is_grad_enabled())
        except BaseException:
            release(held)
            raise
        return local.sample

    def _run_sample(
        self, sample: Sample, wrapped: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        """A sampled root forward: layer proxies on, torch.compile off, then one emission.

        Its start (from the sampling decision) and its end (to the last sink) run with Ctrl-C
        held (interrupts.py): an interrupt there reaches the user's handler right after, so a
        sample is never cut in half; one that arrives during the start is raised before the
        user's forward runs, which marks the sample. The thread's depth and sample (set by
        `_begin_root_forward`) are reset last; an end cut otherwise is finished by `_heal`.
        """
        held, raised = sample.held, None
        try:
            self.gradients.begin_sample(sample.sample_id, self._backward_raised)
            self.in_flight.begin(sample)
            self.encoder_outputs.see(
                sample.sample_id, wrapped, args, kwargs
            )  # an encoder run outside it
            self.proxies.install_layers(self.in_flight.samples.__len__, sample)
            release(held)
            with self.proxies.root_fused_path():  # a bare encoder layer observed itself
                output = call_eagerly(self._call_root_layer, wrapped, args, kwargs)
            self.traced.say(self.notes, self.warn_once)  # a torch.cond's layers, unmeasured
            say_deferred(output, sample.sample_id, self.notes, self.warn_once)  # a generator
            return output
        except BaseException as error:
            raised = error  # marked below, with Ctrl-C held
            raise
        finally:
            if held is not NOT_HELD:  # inline, first: nothing before it can be interrupted
                try:
                    again = signal.signal(SIGINT, hold_signal)
                except KeyboardInterrupt:  # one pending is raised before the swap
                    again = signal.signal(SIGINT, hold_signal)
                    hold_signal(SIGINT, None)
                if again is not hold_signal:  # else the start's hold was never released
                    held = again
            if raised is not None:
                root = LayerInfo("", self._root_type)
                sample.mark(raised, root, self._root_mode, self.rank, self.failed_once)
                self.gradients.forward_raised(sample.sample_id)
            if not self.forked:  # forked during this forward: the child records nothing
                self.proxies.restore_layers(sample)
                self.in_flight.end(sample)  # calls of other threads land before, or are counted
                self.gradients.end_sample()  # its views changed in place are said now
                if not self.closed:  # removed during this forward: emitted then (`close`)
                    self._emit_forward(sample)
            self._local.sample = None
            self._local.depth = 0
            release(held)  # a Ctrl-C held meanwhile is raised here

    def _heal(self) -> None:
        """This thread's last sampled forward left its state behind (its end was cut by a
        KeyboardInterrupt inside the library's own bookkeeping): take the layers' proxies off,
        end the sample and emit it, marked, unless it was emitted; said once, and in index.md."""
        try:
            held = signal.signal(SIGINT, hold_signal)
        except KeyboardInterrupt:  # one pending is raised before the swap (interrupts.py)
            held = signal.signal(SIGINT, hold_signal)
            hold_signal(SIGINT, None)
        except ValueError:  # not the main thread
            held = NOT_HELD
        local = self._local
        sample: Sample | None = getattr(local, "sample", None)
        if sample is not None and not self.forked:
            self.proxies.restore_layers(sample)
            self.in_flight.end(sample)
            if not sample.emitted and not self.closed:
                if sample.interrupted is None:
                    root = LayerInfo("", self._root_type)
                    mode = sample.mode or self._root_mode()
                    sample.interrupted = sample.root_marker(
                        root, mode, self.rank, reasons.CUT_IN_BOOKKEEPING
                    )
                self._emit_forward(sample)
            self.cut_samples.append(sample.sample_id)
            self.warn_once("cut", cut_note(self.cut_samples))
        local.sample = None
        local.depth = 0
        release(held)

    def _backward_raised(self, sample: SampleFacts) -> Measurement:
        """The marker row of a sample whose backward pass raised (`GradientRecorder.heal`)."""
        root = LayerInfo("", self._root_type)
        return backward_marker(sample, root, self.rank, reasons.BACKWARD_RAISED)

    @property
    def current(self) -> Sample | None:
        """The sampled root forward running in this thread, if any."""
        return getattr(self._local, "sample", None)

    def _in_another_root_forward(self) -> bool:
        """Whether this thread is in a root forward of another attached observer. Read only for
        a call this observer could borrow (a layer called on a thread without a root forward of
        its own): a layer two observed models share, called by the other model's forward on
        another thread, was measured into this model's sample in flight, whose rows then held
        the other model's calls."""
        return any(
            other is not self and getattr(other._local, "depth", 0) for other in self.attached()
        )

    def sample_in_flight(self, count: bool) -> Sample | None:
        """For a thread without a sampled forward of its own: the one in flight (samples.py);
        None in a root forward of its own (its calls are its own), in a root forward of another
        observer's model (a layer two observed models share: the call is that model's), or with
        none or several in flight."""
        if getattr(self._local, "depth", 0) or self._in_another_root_forward():
            return None
        return self.in_flight.only(count)

    def _call_nested(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A root call inside a root forward (same thread): part of the enclosing forward."""
        self._local.depth += 1
        try:
            return self._call_root_layer(wrapped, args, kwargs)
        finally:
            self._local.depth -= 1

    def _call_root_layer(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run the root's forward, measuring it when the root is itself a selected layer."""
        sample = self.current
        if self._root_layer is None or sample is None:
            return wrapped(*args, **kwargs)
        return self._root_layer.measured_call(sample, wrapped, args, kwargs)

    def current_step(self) -> int | None:
        """The step of a sample taken now (`sampling.read_step`)."""
        return read_step(self.step_source, self.step, self.failed_once)

    def _should_sample(self, forward_index: int, schedule: str) -> bool:
        """The decision of the schedule's sampler (`forward_index`: the count of root forwards
        on that schedule), as `sampling.ask` takes it."""
        sampler = self.sampler if schedule == TRAIN else self.phases.eval_sampler
        return ask(sampler, forward_index, self.failed_once)

    def _root_mode(self) -> str:
        """`train` or `eval` of the root module."""
        root = self._root_ref() if self._root_ref is not None else None
        return "train" if root is None or root.training else "eval"

    def counts(self, so_far: bool = False) -> RunCounts:
        """What this observer saw (`so_far`: for the live state's notes, Counter.counts)."""
        batched = self.gradients.batched_note()
        cut = cut_note(self.cut_samples) if self.cut_samples else None
        said = (*self.gradients.gaps.notes(), batched, self.in_flight.note(), cut)
        said = (*said, self.encoder_outputs.note())
        notes = (*self.notes, *(n for n in said if n is not None), *self.failed_once.notes())
        notes = (*notes, *self.failed_measurements.notes())
        counts = self.counter.counts(self.gradients.backward_samples, notes, so_far)
        return self.loss_scales.add_to(counts)

    def close(self) -> None:
        """Make every proxy inert, emit outstanding gradients, and close the sinks (idempotent)."""
        if self.closed:
            return
        late = joined_after_inject(self.rank)  # placed before its process had a rank: say so
        if late is not None:
            self.notes.append(late)
            warn(f"torchinstruments: {late}")
        # Removed while samples were in flight (from inside a forward or a backward, or from
        # another thread): each is emitted with what it has, marked; the rest runs unobserved.
        root = LayerInfo("", self._root_type)
        self.gradients.heal(self._backward_raised)  # a pass that raised: marked as such
        forwards = self.in_flight.take_all(root, self._root_mode, self.rank)
        for sample in forwards:
            self._emit_forward(sample)
        removed = reasons.removed_during("backward")
        backwards = self.gradients.close(
            lambda sample: backward_marker(sample, root, self.rank, removed)
        )
        if forwards or backwards:
            note = removed_in_flight_note([s.sample_id for s in forwards], backwards)
            self.notes.append(note)
            self.sinks.removed_in_flight([*(s.sample_id for s in forwards), *backwards])
        cut_forwards = {s.sample_id for s in forwards}
        if waiting := [i for i in self.gradients.unreached if i not in cut_forwards]:
            removed = not any(n.startswith(UNREMOVED_NOTE) for n in self.notes)
            said = no_backward_before_removal_note(waiting, self.removed_after, removed=removed)
            self.notes.append(said)  # index.md
        root_module = self._root_ref() if self._root_ref is not None else None
        eager = eager_samples_note(root_module, self.counter.samples, self.called_compiled)
        if eager is not None:  # read at close: a model may be compiled after inject
            self.notes.append(eager)
        release_held_backwards()  # a sampled backward that raised: torch.compile on again
        self.spare.close()
        self.closed = True
        forks.untrack(self)
        with self.recording.sink_lock:
            self.sinks.close(self.counts())

    def after_fork_in_child(self) -> None:
        """In a forked child: pass every call through and record nothing (see forks.py).

        Takes no lock: another thread of the parent may have held any of them at the fork.
        """
        self.forked = self.closed = True
        self.in_flight.samples.clear()  # layer proxies of a forward in progress become inert
        self.proxies.after_fork_in_child()  # the child's remove_observer takes their lock
        self.gradients.closed = True

    def warn_once(self, key: str, message: str) -> None:
        """Report a measurement failure once per kind; training goes on."""
        if key not in self._warned:
            self._warned.add(key)
            warn(f"torchinstruments: {message}")


# The root wrapper runs as plain Python even inside a compiled region; what it calls is compiled.
exclude_from_compilation(Observer.on_root_call)
# A frame running it, for this observer, is a root forward in progress (`interrupts.running`).
_ROOT_CODE = Observer.on_root_call.__code__
