"""Gradients into sampled outputs: tensor hooks, one transfer per backward pass, leaf bookkeeping.

Design decision: the only hook the library uses is `Tensor.register_hook` on each sampled output
that requires grad (on a plain non-leaf tensor its own steps, without the handle it would return:
`_torch_internals.hook_without_handle`). The hook launches the gradient's reductions on its
device as the gradient arrives (it never alters the gradient: it returns None), and the first
hook of a backward pass queues one autograd-engine callback
(`_torch_internals.queue_at_backward_end`) that transfers all of that pass's results at once when
the pass ends. Outside a running backward pass (a hook fired by
`torch.autograd.grad` on a finished engine, say), the results are transferred at once, and so
they are under compiled autograd, which never runs such a callback. The hook and the callback
run as plain Python under torch.compile (`_torch_internals.dynamo.opaque_to_compilation`):
dynamo never compiles the statistics, and compiled autograd calls the hook instead of tracing it.

A hook on a non-leaf output dies with the graph. A leaf output (a parameter or an input returned
as is) outlives it, so hooks on leaves are tracked: at most one unfired hook of ours stays on a
leaf, fired ones are removed at the end of their backward pass, and the rest at close. The
bookkeeping itself stays bounded whether or not a backward ever runs: entries of leaves that no
longer exist are dropped at each new leaf hook, and at most `MAX_LEAF_HOOKS` unfired hooks are
kept on live leaves; beyond that the oldest is removed (its gradient, if a backward ever reached
that old output, is then not recorded; warned once). A loop of forwards without backward that
returns a fresh leaf each time (an input returned as is) otherwise kept one entry per sample.

In-place outputs: the gradient recorded for a layer is the one into the tensor as that layer
returned it. A hook registered on a tensor attaches to its autograd node at that moment, and an
in-place op that reuses the object (`Linear -> ReLU(inplace=True)`: both layers return the same
tensor) gives it a new node: the Linear's hook still receives the gradient into the Linear's
result, while the ReLU's gradient flows into the new node. So hooks are keyed by the tensor and
its autograd node at return time (its identity, as `register_hook` attaches to it): a tensor
returned again after an in-place op under autograd gets a hook of its own, registered then,
exactly as `register_hook` on the ReLU's return value does. An in-place op under `torch.no_grad()`
bumps the tensor's version counter but gives it no new node, so it does not change the key: the
tensor returned before and after it receives one gradient, the shared-output case below. A view
whose base was changed in place gets a new node when its `grad_fn` is next read, and so a new key.
The node a layer returned then leaves the graph (unless something used the view before the
change), so no gradient reaches its hook, nor a plain hook: the layer is named in a warning and
index.md (`gradient_gaps.GradientGaps.view_changed`). A hooked view's version is noted when it is
returned and compared at the end of its sampled forward, the view held until then (a view local
to the forward dies at its end, though its base lives on); the views not changed by then are
compared again, while still alive (held weakly), at the first gradient of the next backward
pass, the next sampled forward or the close (a returned view the loss changes in place). The
cost: an `_is_view()` per hooked output, and per hooked view an entry until the forward's end.
A leaf (a Parameter or an input returned as is) has no node: its one gradient sink is the tensor
itself.

Unused pieces: a backward pass that reaches an autograd node with several outputs (`split`,
`chunk`, `unbind`, `linalg.svd`, a custom autograd Function's) calls the hooks of every output,
with None for one the loss never used. None is no gradient: that output gets no row from the pass,
and its hook waits for a pass that brings one, as it waits when no pass reaches the node at all.

Shared outputs: a tensor receives ONE gradient per backward pass, the sum over all its uses. When
one layer returned the same tensor in several sampled calls (a Parameter a shared module returns,
an Identity applied twice to one tensor, a leaf input passed through an Identity in two sampled
forwards before one backward, the same tensor returned before and after an in-place op under
`torch.no_grad()`), that sum belongs to none of those calls, so each of their gradient
rows is null with the reason `reasons.shared_output`, never the sum credited to one call. Distinct
layers returning one tensor once each (a Linear followed by an Identity, or by a Dropout in eval,
which returns its input) each get that tensor's gradient, as a hook on it would. Each tensor gets
at most one unfired hook of ours per autograd node, holding every call that returned it with
that node (the hook of an earlier node stays registered there and records its own calls). An output
returned under `torch.no_grad()` gets no hook: no gradient can flow back through that use.

Removal inside a backward pass (`remove_observer` from a user's tensor hook or module backward
hook): gradients that arrived before it are written, marked (`close`); a sample none of whose
gradients had arrived yet is found through `Awaited`, one small object per sample that its
hooks hold and the recorder only references weakly, so it is alive exactly while one of the
sample's hooks is (its graph is). Each sample whose hooks are alive and not all fired is marked
when the removal runs inside a backward pass. Design decision: which graph the running pass
goes through cannot be asked without holding an autograd node, and holding one would keep the
sample's activations alive, so a sample whose graph is kept alive outside this pass (an output
held with its graph) is marked too: its gradients can no longer be recorded either way. A
sample whose hooks have all fired is whole, and is written unmarked even when the removal (or a
pass that raised) came after its gradients. The cost: one object per sample; per hooked output
one slot, one weak-reference lookup (the latest sample's, as a rule) and two int increments.

A backward pass that raised: the gradients that arrived before it are written at the next sampled
forward or the close, their samples marked (`heal`); so is a sample whose pass raised inside one
of its hooks (a Ctrl-C landing there) before that gradient was launched (`cut_in_hook`), since
the pass had reached its outputs. Design decision: a pass that raised before it reached any of a
sample's outputs (an exception or Ctrl-C in a hook on the loss, or in the loss's own backward)
is not marked. No hook of the sample ran, and the design allows no hook elsewhere, so nothing
tells it from a sample no backward was run for; and none of its rows was cut: it has all its
output rows and no gradient reached it, which is what its rows say (index.md counts it among
the samples without a backward). design.md's marker is for a sample whose rows were cut.
"""

from __future__ import annotations

import signal
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.utils.hooks import RemovableHandle

from torchinstruments import reasons
from torchinstruments._torch_internals import (
    hook_without_handle,
    in_backward_pass,
    in_compiled_autograd,
    is_legacy_batched,
    is_view,
    outer_transform_hides_grad,
    queue_at_backward_end,
    tensor_hooks,
    tensor_version,
)
from torchinstruments._torch_internals.dynamo import opaque_to_compilation
from torchinstruments.ambient import apart
from torchinstruments.capture import WarnOnce
from torchinstruments.gradient_gaps import GradientGaps, series_of
from torchinstruments.gradient_hooks import Awaited, GradientHook, HookSlots
from torchinstruments.interrupts import NOT_HELD, SIGINT, hold_signal, release
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.measurement.transfer import (
    Launched,
    build_records,
    launch,
    launch_tensor,
)
from torchinstruments.notices import shown
from torchinstruments.records import (
    OUTPUT_GRADIENT,
    Measurement,
    SampleFacts,
    SampleRecord,
    TensorKey,
)
from torchinstruments.spare_core import SpareCore

__all__ = [
    "BATCHED_GRADIENTS_NOTE",
    "MAX_AWAITED",
    "MAX_LEAF_HOOKS",
    "RECENT_SAMPLES",
    "Emit",
    "GradientRecorder",
    "Mark",
]

MAX_LEAF_HOOKS = 64
# How many of the latest samples with gradients `GradientRecorder` remembers to count each once:
# a sample whose gradients come again after this many other samples' (a graph kept with
# retain_graph for over a thousand sampled steps) would be counted twice.
RECENT_SAMPLES = 1024

# How many samples' `Awaited` the recorder keeps a weak reference to (the latest ones): the
# samples whose graphs can be alive at once in an ordinary loop are far fewer.
MAX_AWAITED = 64

Emit = Callable[[SampleRecord], None]
# The marker row of a sample whose backward was cut: from one of its gradients' measurements,
# or from its `Awaited` when none arrived.
Mark = Callable[[SampleFacts], Measurement]


def _not_written(error: Exception) -> str:
    """The failure of handing a backward pass's gradient records to the sinks."""
    return f"recording gradients failed: {shown(error)}; those gradient rows are not written"


# What index.md (and one warning) says when a backward pass batched its gradients over cotangents.
BATCHED_GRADIENTS_NOTE = (
    "torch.autograd: a backward with is_grads_batched=True (which torch.autograd.functional's "
    "jacobian and hessian run with vectorize=True) passed sampled outputs gradients batched over "
    "its cotangents; their output_gradient rows describe the whole batch, the count of cotangents "
    "first in `shape`"
)


class GradientRecorder:
    """Records the gradients into the sampled outputs of one observer.

    Args:
        measurer: the observer's reducers.
        rank: written into every record.
        emit: hands one finished `SampleRecord` to the sinks.
        warn_once: reports a failure once per kind; training goes on.
    """

    def __init__(
        self,
        measurer: Measurer,
        rank: int | None,
        emit: Emit,
        warn_once: WarnOnce,
        spare: SpareCore,
    ) -> None:
        self._measurer = measurer
        self._spare = spare
        self._rank = rank
        self._emit = emit
        self.warn_once = warn_once
        self.closed = False
        # Samples whose gradients were recorded: a count, not a set of every id (which grew by
        # ~84 bytes a sample for the whole run). A sample's gradients can arrive in more than one
        # flush (two backward passes through it), always while its outputs are alive, so only
        # the most recent ids are remembered to count each sample once.
        self.backward_samples = 0
        self._recent: deque[int] = deque(maxlen=RECENT_SAMPLES)
        self._lock = threading.Lock()
        self._pending: list[Launched] = []  # in launch order
        self._flush_queued = False
        self._leaf_hooks: list[tuple[weakref.ref[torch.Tensor], RemovableHandle, GradientHook]] = []
        # Sampled series whose outputs (with grad enabled) did not require grad: said why.
        self.gaps = GradientGaps()
        # The latest samples' `Awaited`, weakly: alive while a hook of the sample is.
        self._awaited: deque[weakref.ref[Awaited]] = deque(maxlen=MAX_AWAITED)
        self.batched_over_cotangents = False  # a gradient came batched (`BATCHED_GRADIENTS_NOTE`)
        # Samples whose pass raised inside one of their hooks, before its gradient was pending.
        self._cut: list[Awaited] = []
        self._hooks = HookSlots(self)  # a series' hooks, armed again for its next samples
        # Hooked views of the sampled forwards in progress: (view, version when returned, layer),
        # then, from the forward's end, those not changed yet, held weakly (`end_sample`).
        self._views: list[tuple[torch.Tensor, int, str]] = []
        self._returned_views: list[tuple[weakref.ref[torch.Tensor], int, str]] = []
        # At a close outside a backward pass: samples no gradient had reached whose hooked
        # outputs were alive (`unreached_at_close`), said in index.md by the observer.
        self.unreached: list[int] = []

    def batched_note(self) -> str | None:
        """`BATCHED_GRADIENTS_NOTE` once a gradient came batched over cotangents, else None."""
        return BATCHED_GRADIENTS_NOTE if self.batched_over_cotangents else None

    def hook_output(self, key: TensorKey, tensor: torch.Tensor, focus: bool) -> TensorKey:
        """Register the hook that records the gradient into this sampled output; the key to
        record the output under from now on: the hook where one was made (it is that key too),
        else `key`."""
        try:
            if not key.grad_enabled:  # under no_grad inside a forward with grad: said
                self.gaps.output_without_grad_mode(key.sample_id, key.layer.name)
                return key
            if key.sample_id != self.gaps.latest_with_grad:
                self.gaps.sample_with_grad(key.sample_id)
            call_index, path = key.call_index, key.tensor_path
            # Its name alone for a layer's first call's bare tensor, the common case: no tuple.
            series = (key.layer.name, call_index, path) if call_index or path else key.layer.name
            if not tensor.requires_grad:  # no gradient can arrive here: said (gradient_gaps.py)
                if (transform := outer_transform_hides_grad(tensor)) is not None:
                    self.gaps.under_transform(key.layer.name, transform)
                else:
                    self.gaps.without_grad(series, key.sample_id)
                return key
            if series not in self.gaps.with_grad:
                self.gaps.first_with_grad(series)
            # Read first: it refreshes a stale view's node. A leaf has none (None).
            grad_fn = tensor.grad_fn
            node = None if grad_fn is None else id(grad_fn)
            with self._lock:
                if is_view(tensor):  # a later in-place op would replace its node
                    self._views.append((tensor, tensor_version(tensor), key.layer.name))
                hook = self._unfired_hook(tensor, node)
                if hook is not None:
                    hook.add_call(key, focus)  # the same tensor and node, returned again
                    return key
                # New, or changed in place since (a new autograd node): a hook of its own.
                hook = self._hooks.take(series, key, focus, node, self._awaited_by(key))
                if hook_without_handle(tensor, hook):  # a non-leaf's: never removed
                    return hook
                handle = tensor.register_hook(hook)
            if tensor.grad_fn is None:
                self._track_leaf_hook(tensor, handle, hook)
            return hook
        except Exception as error:  # named per series in index.md (gradient_gaps.py)
            self.gaps.hook_refused(series_of(key), key.sample_id, shown(error))
            return key

    def _awaited_by(self, key: TensorKey) -> Awaited:
        """The `Awaited` of `key`'s sample, or a new one for a new sample (the caller holds
        the lock). Looked up from the latest: almost always the first one looked at, and two
        samples hooked on two threads at once still share one each."""
        for ref in reversed(self._awaited):
            known = ref()
            if known is not None and known.sample_id == key.sample_id:
                return known
        awaited = Awaited(key)
        self._awaited.append(weakref.ref(awaited))
        return awaited

    def _unfired_hook(self, tensor: torch.Tensor, node: int | None) -> GradientHook | None:
        """Our unfired hook on `tensor` for this autograd node, if a sampled call already
        returned it (the caller holds the lock). The tensor holds its node, so the id is that
        node's; a new node comes with a new hook dict, so an old node's hook is not found."""
        for hook in tensor_hooks(tensor):
            if (
                type(hook) is GradientHook
                and hook.recorder is self
                and not hook.fired
                and hook.node == node
            ):
                return hook
        return None

    def launch_gradient(self, hook: GradientHook, grad: torch.Tensor) -> None:
        """Launch the reductions of one gradient (null rows for a shared output); transferred
        when the backward pass ends."""
        if not self.batched_over_cotangents and is_legacy_batched(grad):
            self.batched_over_cotangents = True  # said in index.md, and warned now
            self.warn_once("batched", BATCHED_GRADIENTS_NOTE)
        if hook.more is None:  # one call returned the tensor: its gradient is that call's
            launched = launch(self._measurer, hook, grad, hook.focus, self._spare)
        else:
            launched = self._launch_shared(hook.calls, grad)
        with self._lock:
            hook.awaited.fired += 1
            self._pending.extend(launched)
            queue = not self._flush_queued
            self._flush_queued = True
        if queue and not queue_at_backward_end(self._end_backward):
            # Written now. Compiled autograd calls the hooks from its graph's own list, not from
            # the tensors': the leaves' fired hooks come off now too (else one more on a leaf each
            # sample, and compiled autograd compiles the backward again for each count).
            self.flush(fired_leaf_hooks_first=in_compiled_autograd())
        if queue:  # the pass's first gradient: the views it frees later are still alive
            self._check_views()

    def _launch_shared(
        self, calls: list[tuple[TensorKey, bool]], grad: torch.Tensor
    ) -> list[Launched]:
        """The gradient of a tensor several sampled calls returned: each call's own where the
        calls are of distinct layers, null rows for a layer that returned it more than once."""
        per_layer: dict[str, int] = {}
        for key, _ in calls:
            per_layer[key.layer.name] = per_layer.get(key.layer.name, 0) + 1
        launched: list[Launched] = []
        for key, focus in calls:
            shared = per_layer[key.layer.name]
            if shared == 1:
                launched += launch(self._measurer, key, grad, focus, self._spare)
            else:
                reason = reasons.shared_output(shared)
                launched.append(launch_tensor(self._measurer, key, grad, False, reason))
        return launched

    def flush(
        self,
        mark: Mark | None = None,
        *,
        fired_leaf_hooks_first: bool = False,
    ) -> list[int]:
        """Transfer and emit every gradient launched since the last flush (with
        `fired_leaf_hooks_first`, the leaves' fired hooks are removed first); with `mark`, the
        record of each sample still awaiting gradients gets `mark(...)` appended (one whose
        gradients all arrived is whole: `_all_arrived`). Returns the sample ids emitted, or
        with `mark` those marked. Ctrl-C is held meanwhile (interrupts.py): the records reach
        every sink, or none was taken."""
        try:
            held = signal.signal(SIGINT, hold_signal)
        except KeyboardInterrupt:  # one pending is raised before the swap (interrupts.py)
            held = signal.signal(SIGINT, hold_signal)
            hold_signal(SIGINT, None)
        except ValueError:  # not the main thread
            held = NOT_HELD
        try:
            if fired_leaf_hooks_first:
                self._remove_leaf_hooks(only_fired=True)
            with apart():  # the user's autocast and modes set aside (ambient.py)
                return self._flush(mark)
        finally:
            release(held)

    def _flush(self, mark: Mark | None) -> list[int]:
        """`flush`'s work: the ids emitted, or with `mark`, the ids marked (a sample whose
        gradients have all arrived is whole: its record is emitted unmarked)."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._flush_queued = False
            arrived = self._all_arrived() if mark is not None else set()
        if not pending:
            return []
        emitted, marked = [], []
        try:
            for record in build_records(
                OUTPUT_GRADIENT, pending, self._measurer.metrics, self._rank, self._spare
            ):
                if record.sample_id not in self._recent:
                    self._recent.append(record.sample_id)
                    self.backward_samples += 1
                if mark is not None and record.sample_id not in arrived:
                    marker = mark(record.measurements[0])
                    record = replace(record, measurements=(*record.measurements, marker))
                    marked.append(record.sample_id)
                self._emit(record)
                emitted.append(record.sample_id)
        except Exception as error:
            self.warn_once("flush_backward", _not_written(error))
        return emitted if mark is None else marked

    def _all_arrived(self) -> set[int]:
        """The samples whose hooks are alive and have all fired: every gradient they can get
        arrived (the caller holds the lock). A sample not known here is not taken for whole."""
        self._hooks.let_go()  # a kept hook nothing else holds keeps no sample alive
        live = [a for a in (ref() for ref in self._awaited) if a is not None]
        # a sample hooked on two threads at once can have several: whole only if all are
        waiting = {a.sample_id for a in live if a.fired < a.hooked}
        return {a.sample_id for a in live} - waiting

    def cut_in_hook(self, awaited: Awaited) -> None:
        """A hook of `awaited`'s sample raised (a Ctrl-C inside it) before its gradient was
        launched: the pass raises with that sample's backward begun, so `heal` marks it even
        when none of its gradients is pending."""
        with self._lock:
            self._cut.append(awaited)

    def begin_sample(self, sample_id: int, mark: Mark) -> None:
        """A sampled root forward begins: first `heal`; then, where the forward is called with
        grad enabled, the sample is one with grad from its start (gradient_gaps.py), so that
        layers it runs under no_grad are named even when none of its outputs is made with grad
        (a forward that checkpoints every layer reentrantly). Under the caller's own no_grad
        (evaluation, a frozen teacher) it is not, unless a layer's output is made with grad."""
        self.heal(mark)
        self._check_views()
        if torch.is_grad_enabled() and sample_id != self.gaps.latest_with_grad:
            self.gaps.sample_with_grad(sample_id)

    def heal(self, mark: Mark) -> list[int]:
        """Emit, each record with `mark(record)`, the gradients of a backward pass that raised
        (a Ctrl-C, a hook's or an autograd Function's exception): its end-of-pass callback never
        runs, and until this its gradients would wait, with every later pass's (none queues a
        callback while one is queued), for the run's removal. A sample cut inside one of its
        hooks before any of its gradients was pending gets a record of its marker row alone.
        Called outside a backward pass (a sampled forward, the close); returns the sample ids
        emitted. Outside every pass nothing waits but what such a pass left, whether or not it
        got to queue its callback."""
        if (not self._pending and not self._cut) or in_backward_pass():
            return []
        marked = self.flush(mark, fired_leaf_hooks_first=True)
        with self._lock:
            cut, self._cut = self._cut, []
        return marked + self._mark_samples(mark, cut, set(marked))

    def close(self, mark: Mark | None = None) -> list[int]:
        """Emit outstanding gradients, remove every hook left on a leaf, and stop recording.

        Gradients still waiting for the end of their backward pass mean the run is removed
        inside that pass (from a tensor hook): the records of their samples still awaiting
        gradients get `mark(...)` (a sample whose gradients all arrived is whole). Called
        inside a backward pass, each sample still awaiting some of its gradients is marked too,
        with a record of its marker row alone when none of them had arrived (`Awaited`).
        Returns the ids of the samples marked.
        """
        if self.closed:
            return []
        self.end_sample()  # a forward in progress: what it changed so far
        self._check_views()
        cut = self.flush(mark)
        inside = in_backward_pass()
        if mark is not None and inside:
            cut += self._mark_awaited(mark, set(cut))
        self._remove_leaf_hooks(only_fired=False)
        if not inside:
            self.unreached = self._unreached_at_close()
        self.closed = True
        self._hooks.clear()
        return cut

    def _mark_awaited(self, mark: Mark, marked: set[int]) -> list[int]:
        """Emit the marker row of each sample whose hooks are alive and not all fired, unless
        in `marked` already; returns their ids."""
        with self._lock:
            self._hooks.let_go()
            awaited = [a for a in (ref() for ref in self._awaited) if a is not None]
        waiting = [sample for sample in awaited if sample.fired < sample.hooked]
        return self._mark_samples(mark, waiting, marked)

    def forward_raised(self, sample_id: int) -> None:
        """The sampled forward `sample_id` raised: it is marked `interrupted` already and no
        loss was made of its outputs, so it is not a sample whose backward may come after the
        removal, even where the traceback keeps its outputs alive (a trainer's exception
        callback removes the run while the exception is handled: `_unreached_at_close`)."""
        with self._lock:
            for ref in reversed(self._awaited):
                known = ref()
                if known is not None and known.sample_id == sample_id:
                    known.raised = True
                    return

    def _unreached_at_close(self) -> list[int]:
        """The samples whose hooked outputs are alive (their hooks are, so their autograd graph
        is) and none of whose hooks fired: a backward run after the removal, which the closed
        recorder ignores, or one never run; either way they have no output_gradient rows. A
        sample whose outputs were dropped without a backward holds no hook any more: not one."""
        with self._lock:
            self._hooks.let_go()
            awaited = [a for a in (ref() for ref in self._awaited) if a is not None]
        return [
            sample.sample_id
            for sample in awaited
            if sample.hooked and not sample.fired and not sample.raised
        ]

    def _mark_samples(self, mark: Mark, samples: list[Awaited], marked: set[int]) -> list[int]:
        """Emit a record of its marker row alone for each of `samples` not in `marked` (which
        grows); returns their ids."""
        emitted = []
        for sample in samples:
            if sample.sample_id in marked:
                continue
            marker = mark(sample)
            try:
                self._emit(
                    SampleRecord(OUTPUT_GRADIENT, sample.sample_id, sample.forward_index, (marker,))
                )
            except Exception as error:
                self.warn_once("flush_backward", _not_written(error))
                continue
            marked.add(sample.sample_id)
            emitted.append(sample.sample_id)
        return emitted

    def end_sample(self) -> None:
        """A sampled forward ended: name the layers whose returned view was changed in place
        since (its version moved: a view's node is replaced at any in-place op on it or on its
        base), and hold the others weakly only, for `_check_views`."""
        with self._lock:
            views, self._views = self._views, []
        unchanged = []
        for view, version, layer in views:
            if tensor_version(view) != version:
                self.gaps.view_changed(layer)
            else:
                unchanged.append((weakref.ref(view), version, layer))
        with self._lock:
            self._returned_views.extend(unchanged)

    def _check_views(self) -> None:
        """`end_sample`'s check again, of the views still alive that were unchanged at the end
        of their forward, then forget them: one changed only after this is no such case."""
        with self._lock:
            views, self._returned_views = self._returned_views, []
        for ref, version, layer in views:
            view = ref()
            if view is not None and tensor_version(view) != version:
                self.gaps.view_changed(layer)

    def _end_backward(self) -> None:
        """Autograd-engine callback at the end of a backward pass: no hook is running now.
        Ctrl-C is held throughout (interrupts.py); cut at its entry, the pass raises, and
        `heal` writes its gradients, marked."""
        self.flush(fired_leaf_hooks_first=True)

    def _track_leaf_hook(
        self, tensor: torch.Tensor, handle: RemovableHandle, hook: GradientHook
    ) -> None:
        """Remember a hook on a leaf; drop entries of dead leaves and keep at most
        `MAX_LEAF_HOOKS` unfired ones (see the module docstring)."""
        kept = [entry for entry in self._leaf_hooks if entry[0]() is not None]
        kept.append((weakref.ref(tensor), handle, hook))
        unfired = [entry for entry in kept if not entry[2].fired]
        excess = len(unfired) - MAX_LEAF_HOOKS
        if excess > 0:
            oldest = unfired[:excess]
            for _, old_handle, _ in oldest:
                old_handle.remove()  # off the tensor, so `_unfired_hook` no longer finds it
            dropped = {id(entry) for entry in oldest}
            kept = [entry for entry in kept if id(entry) not in dropped]
            self.warn_once(
                "leaf_hooks",
                f"more than {MAX_LEAF_HOOKS} sampled outputs that are leaf tensors (inputs or "
                "parameters returned as is) are still alive without a backward; the gradient "
                "hooks of the oldest are removed, so a backward through them would not be "
                "recorded",
            )
        self._leaf_hooks = kept

    def _remove_leaf_hooks(self, only_fired: bool) -> None:
        """Remove hooks left on leaf tensors; runs when no backward is iterating over them."""
        keep = []
        for ref, handle, hook in self._leaf_hooks:
            if only_fired and not hook.fired:
                keep.append((ref, handle, hook))
            else:
                handle.remove()
        self._leaf_hooks = keep


# What the autograd engine calls runs as plain Python under torch.compile too: a backward called
# inside a compiled function (a whole training step compiled) would otherwise have dynamo compile
# the statistics and the sinks below them as they run, and compiled autograd would trace the hook
# into the backward's graph.
opaque_to_compilation(GradientHook.__call__)
opaque_to_compilation(GradientRecorder._end_backward)
