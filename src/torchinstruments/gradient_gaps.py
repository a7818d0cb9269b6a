"""Sampled outputs no gradient reaches: which series have no output_gradient rows, and why.

The cases: outputs that required no grad (below), layers run under no_grad inside a forward
called with grad enabled, outputs wrapped by a torch.func transform, gradient hooks a tensor
refused, and returned views that a later in-place op changed (each said where it is kept).

A sampled output (with grad enabled) that does not require grad gets no hook, since no gradient
can arrive, exactly as plain `Tensor.register_hook` users skip it; its output_gradient rows are
absent, not null. The run says why, per tensor series (layer, call_index, tensor_path), in two
cases: a layer none of whose outputs ever required grad (nothing before it does: a layer without
parameters fed the input data, a frozen stem), and a series that required grad in some samples
and not in others (a part of the model frozen or unfrozen with `requires_grad_` mid-run, as
fine-tuning does): its gradient rows stop, or start late, and a reader must not take that for a
layer that stopped running. The second is warned once, when first seen, and both are in
index.md. Kept per series, not per layer: a layer that returns a tensor with grad beside a
detached one in every sample changed nothing. Bounded: one entry per series.

A third case is per layer: outputs made under `torch.no_grad()` inside sampled forwards that
otherwise ran with grad enabled. Reentrant `torch.utils.checkpoint` runs its block so in the
forward (and again, with grad, during backward: outside any root forward, so unobserved, as a
plain hook on the forward sees it too), and so does a `torch.no_grad()` block in a model's
forward. No gradient flows into such an output; a warning says so when a layer holding
parameters is first seen so (a parameter-free one, a mask or positions computed under no_grad,
loses no gradient anyone trains on), and index.md names every such layer. A forward called
under the caller's own no_grad (evaluation, a frozen teacher) is not this case. A sample counts
as "with grad" from its start when its root forward is called with grad enabled (so a forward
that checkpoints every selected layer reentrantly, none of whose outputs is made with grad, is
this case: `GradientRecorder.begin_sample`), else from its first output made with grad enabled
(an `enable_grad` block inside a forward called under no_grad), which may come after its
no_grad outputs, so the no_grad layers of the latest `RECENT` samples wait until then. A
forward that turns grad off itself (`@torch.no_grad()` on its `forward`) is named too: it was
called with grad enabled, and its layers have no output_gradient rows.

A fourth is per layer too: outputs a torch.func transform wraps so that they report
`requires_grad=False` though the value under the wrapper requires grad: `vmap` (an ensemble of
`stack_module_state` + `functional_call`, backward outside vmap), `jvp`, `jacfwd`. Gradients do
reach the plain value, through the transform, but the wrapper the layer returned takes no hook
(nor does it for plain `Tensor.register_hook`), so the layer has no output_gradient rows. That is
no frozen model: a warning says so when first seen, naming the layer and the transform, and
index.md names every such layer.

A fifth is per layer too: a returned view that a later in-place op (on the view, its base or
another view of the base: `Flatten` then `ReLU(inplace=True)`) gave a new autograd node. The
gradient flows into the new node; the one the layer returned leaves the graph, so its hook (and
a plain one) receives nothing and the layer has no output_gradient rows. gradients.py finds it
by the view's version; a warning says so when first seen, and index.md names every such layer.

A sixth is per series: a sampled output whose gradient hook could not be made (a tensor subclass
that raises when asked `requires_grad` or `grad_fn`, or refuses `register_hook`). Design
decision: it gets no output_gradient rows, not null ones. A hook is the only way the library may
learn that a backward reached a tensor (design: no other hooks), so without one nothing tells a
sample whose backward reached it from one without a backward, or a tensor the loss never used,
and both have no gradient rows; a null row would claim a gradient that may not exist (and plain
`Tensor.register_hook`, the reference, is refused the same way). So the run names it instead,
exactly: a warning when first seen, and index.md lists every such series with its samples (count,
first, last) and the error.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from torch import nn

from torchinstruments.notices import warn
from torchinstruments.records import LayerInfo, TensorKey
from torchinstruments.rundir.ranges import listed, plural
from torchinstruments.rundir.shell import layer_span, literal_span

__all__ = ["GradientGaps", "series_of"]

# (layer, call_index, tensor_path); the layer's name alone for call 0's bare tensor (`""`), which
# is most outputs: a string's hash is cached, a tuple's is computed at every lookup.
Series = str | tuple[str, int, str]

_SHOWN = 20  # names listed per note (index.md stays bounded on any model)
RECENT = 8  # samples whose no_grad outputs may still meet a grad-enabled one (threads overlap)

CHANGED_WARNING = (
    "torchinstruments: a sampled output requires no grad where its series required grad in "
    "another sample (or the reverse): a part of the model frozen or unfrozen with "
    "requires_grad_ mid-run, say; those samples have no output_gradient rows for it, and "
    "index.md names every such series at removal"
)


class GradientGaps:
    """Which sampled series' outputs (with grad enabled) did or did not require grad."""

    def __init__(self) -> None:
        self.with_grad: set[Series] = set()
        # Per series without grad in some sample, in the order seen: [samples, first, last].
        self._without: dict[Series, list[int]] = {}
        self._warned = False
        # Outputs made under no_grad inside forwards with grad (see the module), per layer.
        self._lock = threading.Lock()
        self._under_no_grad: dict[str, None] = {}  # an ordered set, in the order seen
        self._grad_samples: deque[int] = deque(maxlen=RECENT)
        self._waiting: dict[int, dict[str, None]] = {}  # sample -> its no_grad layers so far
        # The sample last given an entry in `_waiting`, and that entry: its later outputs join it
        # without the lock (`output_without_grad_mode`).
        self._open: tuple[int, dict[str, None]] = (-1, {})
        self._weighted: set[str] = set()  # layers holding parameters (`weigh`)
        self._warned_no_grad = False
        self._transformed: dict[str, str] = {}  # layer -> transform (`under_transform`)
        self._views_changed: dict[str, None] = {}  # an ordered set (`view_changed`)
        # Per series whose hook was refused: [samples, first, last] and the first error.
        self._refused: dict[Series, tuple[list[int], str]] = {}
        self.latest_with_grad = -1  # the latest sample with an output made with grad enabled

    def weigh(self, layers: Iterable[tuple[nn.Module, LayerInfo]]) -> None:
        """Note which selected layers hold parameters: only those warn under no_grad."""
        self._weighted = {
            info.name for module, info in layers if next(module.parameters(), None) is not None
        }

    def output_without_grad_mode(self, sample_id: int, layer: str) -> None:
        """A sampled output of `layer` made with grad disabled.

        Every output of an evaluation sample comes here, so the lock is taken once per sample:
        its later outputs join the sample's waiting layers without it, then check that those
        are still waiting. Where `sample_with_grad` took them meanwhile (it reads a copy, so a
        layer joining as it reads is not lost) or they were dropped as too old, the output
        goes the locked way, as the sample's first did."""
        opened, waiting = self._open
        if opened == sample_id:
            waiting.setdefault(layer, None)
            if self._waiting.get(sample_id) is waiting:
                return
        with self._lock:
            if sample_id in self._grad_samples:
                self._said_under_no_grad(layer)
            else:
                waiting = self._waiting.setdefault(sample_id, {})
                waiting.setdefault(layer, None)
                self._open = (sample_id, waiting)
                if len(self._waiting) > RECENT:
                    del self._waiting[next(iter(self._waiting))]  # the oldest sample's

    def sample_with_grad(self, sample_id: int) -> None:
        """`sample_id` made an output with grad enabled (callers test `latest_with_grad`)."""
        with self._lock:
            self.latest_with_grad = sample_id
            if sample_id not in self._grad_samples:
                self._grad_samples.append(sample_id)
                for name in list(self._waiting.pop(sample_id, {})):
                    self._said_under_no_grad(name)

    def _said_under_no_grad(self, layer: str) -> None:
        """Remember `layer`; warn the first time a layer with parameters is seen so."""
        self._under_no_grad.setdefault(layer, None)
        if not self._warned_no_grad and layer in self._weighted:
            self._warned_no_grad = True
            warn(
                f"torchinstruments: layer {layer!r} {_UNDER_NO_GRAD} ({_WHY}); index.md names "
                "every such layer at removal"
            )

    def under_transform(self, layer: str, transform: str) -> None:
        """A sampled output of `layer` that a torch.func `transform` hides the grad of (see the
        module); warned the first time any layer is seen so."""
        if layer in self._transformed:
            return
        first = not self._transformed
        self._transformed[layer] = transform
        if first:
            warn(
                f"torchinstruments: layer {layer!r} returned outputs wrapped by torch.func "
                f"{transform}, which report requires_grad=False though the values under them "
                f"require grad: {_TRANSFORMED}; index.md names every such layer at removal"
            )

    def view_changed(self, layer: str) -> None:
        """A sampled view `layer` returned was changed in place later (see the module); warned
        the first time any layer is seen so."""
        if layer in self._views_changed:
            return
        first = not self._views_changed
        self._views_changed[layer] = None
        if first:
            warn(
                f"torchinstruments: layer {layer!r} {_VIEW_CHANGED}: {_VIEW_WHY}; index.md names "
                "every such layer at removal"
            )

    def hook_refused(self, series: Series, sample_id: int, error: str) -> None:
        """The gradient hook of a sampled output of `series` in `sample_id` could not be made
        (`error`, as a warning shows it); warned the first time any series is."""
        seen = self._refused.get(series)
        if seen is None:
            self._refused[series] = ([1, sample_id, sample_id], error)
            if len(self._refused) == 1:
                warn(
                    f"torchinstruments: the gradient hook of {_series(series, warned=True)} could not be made "
                    f"({error}), so {_REFUSED}; index.md names every such tensor at removal"
                )
        elif seen[0][2] != sample_id:
            seen[0][0] += 1
            seen[0][2] = sample_id

    def without_grad(self, series: Series, sample_id: int) -> None:
        """A sampled output of `series` in `sample_id` that requires no grad."""
        seen = self._without.get(series)
        if seen is None:
            self._without[series] = [1, sample_id, sample_id]
        elif seen[2] != sample_id:
            seen[0] += 1
            seen[2] = sample_id
        if series in self.with_grad:
            self._changed()

    def first_with_grad(self, series: Series) -> None:
        """The first sampled output of `series` that requires grad (callers test `with_grad`)."""
        self.with_grad.add(series)
        if series in self._without:
            self._changed()

    def _changed(self) -> None:
        """Warn once per run that a series' outputs changed whether they require grad."""
        if not self._warned:
            self._warned = True
            warn(CHANGED_WARNING)

    def notes(self) -> tuple[str, ...]:
        """index.md's notes: layers whose outputs never required grad, and series that did in
        some samples only."""
        layers_with = {_layer(series) for series in self.with_grad}
        without = (_layer(series) for series in self._without)
        never = list(dict.fromkeys(name for name in without if name not in layers_with))
        with self._lock:
            inside = [name for name in self._under_no_grad if name not in layers_with]
        some = [(s, seen) for s, seen in self._without.items() if s in self.with_grad]
        notes = []
        if never:
            notes.append(
                f"{len(never)} selected layer{'' if len(never) == 1 else 's'} never returned an "
                "output that requires grad, so no gradient can arrive and "
                f"{'it has' if len(never) == 1 else 'they have'} no output_gradient rows: "
                f"{listed([layer_span(name) for name in never], _SHOWN)} (nothing before them requires "
                "grad: e.g. a layer without parameters fed the input data, or a frozen part of "
                "the model)."
            )
        if some:
            shown = [
                f"{_series(series)} ({count} sample{'' if count == 1 else 's'}, from {first} to "
                f"{last})"
                for series, (count, first, last) in some
            ]
            notes.append(
                f"{len(some)} sampled output{'' if len(some) == 1 else 's'} required no grad in "
                "some samples and grad in others (a part of the model frozen or unfrozen with "
                "requires_grad_ mid-run, say), so those samples have no output_gradient rows "
                "for them (a layer's first call unless a call or tensor_path is named; the "
                f"samples without grad, first to last): {listed(shown, _SHOWN)}."
            )
        if inside:
            notes.append(
                f"{len(inside)} selected layer{'' if len(inside) == 1 else 's'} {_UNDER_NO_GRAD}"
                f", so no gradient can arrive and {'it has' if len(inside) == 1 else 'they have'}"
                " no output_gradient rows (their output rows have grad_enabled false): "
                f"{listed([layer_span(name) for name in inside], _SHOWN)} ({_WHY})."
            )
        if self._transformed:
            shown = [f"{layer_span(name)} ({how})" for name, how in self._transformed.items()]
            notes.append(
                f"{plural(len(shown), 'selected layer')} returned outputs wrapped by a torch.func "
                f"transform that report requires_grad=False though the values under them "
                f"require grad: {_TRANSFORMED}: {listed(shown, _SHOWN)}."
            )
        if self._views_changed:
            notes.append(
                f"{plural(len(self._views_changed), 'selected layer')} {_VIEW_CHANGED}: "
                f"{_VIEW_WHY}: {listed([layer_span(name) for name in self._views_changed], _SHOWN)}."
            )
        refused = list(self._refused.items())
        if refused:
            shown = [
                f"{_series(series)} ({count} sample{'' if count == 1 else 's'}, from {first} to "
                f"{last}: {error})"
                for series, ((count, first, last), error) in refused
            ]
            notes.append(
                f"{plural(len(refused), 'sampled output')} could not be given a gradient hook, "
                f"so {_REFUSED} (a layer's first call unless a call or tensor_path is named; the "
                f"samples, first to last, and the first error): {listed(shown, _SHOWN)}."
            )
        return tuple(notes)


_UNDER_NO_GRAD = (
    "ran under torch.no_grad() inside sampled forwards that otherwise ran with grad enabled"
)
_WHY = (
    "reentrant torch.utils.checkpoint (use_reentrant=True) runs its block so in the forward and "
    "again during backward, outside the forward, where it is not observed; a torch.no_grad() "
    "block in forward does the same; non-reentrant checkpointing (use_reentrant=False) is "
    "observed whole"
)


_TRANSFORMED = (
    "a backward outside the transform sends gradients into those values, but the wrapper the "
    "layer returned takes no hook (nor does plain Tensor.register_hook), so no gradient into "
    "its outputs is recorded and it has no output_gradient rows (a vmap ensemble built with "
    "stack_module_state and functional_call, say)"
)


_VIEW_CHANGED = "returned a view that a later in-place op gave a new autograd node"
_VIEW_WHY = (
    "the op was on the view, its base or another view of the base (Flatten then "
    "ReLU(inplace=True), say), and the gradient flows into the new node; the node the layer "
    "returned gets one only through uses of the view before the op (none, as a rule), so no "
    "gradient into its output is recorded and it has no output_gradient rows, as plain "
    "Tensor.register_hook on it sees (an output that is no view keeps its gradient when changed "
    "in place: its node stays in the graph)"
)


_REFUSED = (
    "the gradient into it is not recorded and it has no output_gradient rows in those samples "
    "(a tensor subclass refused register_hook, requires_grad or grad_fn; without a hook nothing "
    "tells whether a backward reached it, so no null rows are written for it)"
)


def series_of(key: TensorKey) -> Series:
    """The series of a sampled output's key (gradients.py builds it inline on its hot path)."""
    call_index, path = key.call_index, key.tensor_path
    return (key.layer.name, call_index, path) if call_index or path else key.layer.name


def _layer(series: Series) -> str:
    """The layer of a series."""
    return series if isinstance(series, str) else series[0]


def _series(series: Series, warned: bool = False) -> str:
    """A series as a note names it: the layer (`layer_span`; `repr` in a warning), then its
    call and path (a code span of its literal in a note) where not the first."""
    named = repr if warned else layer_span
    if isinstance(series, str):
        return named(series)
    layer, call_index, path = series
    shown = path if warned or not path else literal_span(path)
    return (
        named(layer) + (f" call {call_index}" if call_index else "") + (f" {shown}" if path else "")
    )
