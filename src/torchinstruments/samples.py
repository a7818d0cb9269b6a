"""A sampled root forward in progress, and the ones in flight: where a call of another thread goes.

The open sample and the root depth are per thread (observer.py keeps them in a thread-local), so
a model run from several threads keeps each thread's forwards apart. A model may also run
branches of its own forward on other threads (a `ThreadPoolExecutor` or `threading.Thread`
inside `forward`: multi-tower and ensemble models); those threads have no root forward of their
own. Design decision: a selected layer called on such a thread while exactly one sampled root
forward of the observer is in flight (on any thread) belongs to that sample, as plain hooks see
it: it is measured there, its call_index from the layer's count in that sample, its gradient
hooked. With several sampled forwards in flight the call cannot be attributed to one of them: it
runs unmeasured. A call that began during a sample but returned after the sampled forward had
ended is not measured either (its sample is emitted already). Both are counted (under the
observer's one counting lock), warned once, and said in index.md, with how many calls and why:
never silent. A thread in an unsampled root forward of its own keeps its calls to itself, and a
call made when no sampled forward is in flight is outside any sample.

Cost: the sampling thread finds its sample in its thread-local and pays nothing for this but one
lock at each sampled forward's start and end; only a thread without a sample reads the list of
samples in flight (one copy of a list of about one item).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from torchinstruments import reasons
from torchinstruments.capture import WarnOnce
from torchinstruments.counting import Counter
from torchinstruments.records import (
    INTERRUPTED,
    OUTPUT,
    OUTPUT_GRADIENT,
    LayerInfo,
    Measurement,
    MetricValue,
    SampleFacts,
)

if TYPE_CHECKING:
    from torchinstruments.global_statistics import GlobalTensor
    from torchinstruments.measurement.transfer import Launched

__all__ = [
    "InFlight",
    "Sample",
    "backward_marker",
    "cut_note",
    "marker",
    "no_backward_before_removal_note",
    "removed_in_flight_note",
]


class Sample:
    """A sampled root forward in progress, and the row that marks it when it raised."""

    __slots__ = (
        "call_counts",
        "call_lock",
        "emitted",
        "forward_index",
        "global_pending",
        "held",
        "interrupted",
        "kind",
        "mode",
        "pending",
        "raised",
        "returned",
        "sample_id",
        "step",
    )

    def __init__(
        self, sample_id: int, forward_index: int, step: int | None, mode: str | None = None
    ) -> None:
        self.sample_id = sample_id
        self.forward_index = forward_index
        self.step = step
        # The mode of all its rows, or None for each layer's own training flag (phases.py: a
        # trainer's evaluation forward is "eval" even when another callback runs it in train mode,
        # and its training forward "train" even through a part frozen in eval mode).
        self.mode = mode
        # The kind of forward the root's call is: its mode (`mode`, else the root's own training
        # flag) and grad mode, as it began; set by the observer (global_statistics: ranks whose
        # samples are different kinds of forward are apart, global_agreement.py).
        self.kind: tuple[str, bool] | None = None
        # Per layer, how many of its calls began, counted under one lock per sample, so a call on
        # another thread never shares a call_index with one of the sample's own thread. Plain
        # ints, not a counter object per layer: every object made per layer lives until the
        # sample is written, and the garbage collector scans it until then (tests/test_lane.py).
        self.call_counts: dict[str, int] = {}
        self.call_lock = threading.Lock()
        self.pending: list[Launched] = []  # in launch order
        self.global_pending: list[GlobalTensor] = []  # global_statistics: measured at the end
        self.returned: set[str] = set()  # layers with at least one call that returned
        # The innermost selected layer whose call raised: (layer, call_index, mode, id(error)).
        self.raised: tuple[LayerInfo, int, str, int] | None = None
        self.interrupted: Measurement | None = None  # the marker row, once the forward raised
        self.emitted = False  # handed to the sinks (once: a cut emission is never repeated)
        self.held: object = None  # SIGINT's handler before its start was held (interrupts.py)

    def layer_raised(
        self, layer: LayerInfo, mode: Callable[[], str], call_index: int, error: BaseException
    ) -> None:
        """Remember where `error` started (the innermost layer it passes through first)."""
        if self.raised is None or self.raised[3] != id(error):
            self.raised = (layer, call_index, self.mode or mode(), id(error))

    def marker_row(
        self, error: BaseException, root: LayerInfo, root_mode: Callable[[], str], rank: int | None
    ) -> Measurement:
        """The row that marks this sample as interrupted by `error` (metric INTERRUPTED, value
        null, the reason naming the exception and the layer where it was raised, else `root`)."""
        raised = self.raised
        if raised is not None and raised[3] == id(error):
            info, call_index, mode = raised[0], raised[1], raised[2]
            reason = reasons.interrupted(error, info.name, call_index)
        else:
            info, call_index, mode = root, 0, self.mode or root_mode()
            reason = reasons.interrupted(error, None, 0)
        return marker(self.sample_id, self.forward_index, self.step, info, call_index, mode, rank)(
            OUTPUT, reason
        )

    def mark(
        self,
        error: BaseException,
        root: LayerInfo,
        root_mode: Callable[[], str],
        rank: int | None,
        failed_once: Callable[[str, str], None],
    ) -> None:
        """Mark this sample as interrupted by `error`, the exception its root forward raised
        (`marker_row`); a failure to make the row is said, never raised over the user's error."""
        try:
            self.interrupted = self.marker_row(error, root, root_mode, rank)
        except Exception as failure:  # the user's exception is what must propagate
            failed_once(
                "marker",
                f"marking an interrupted sample failed: {failure!r}; sample {self.sample_id}'s "
                "rows are written without their `interrupted` marker",
            )

    def root_marker(self, root: LayerInfo, mode: str, rank: int | None, reason: str) -> Measurement:
        """The row that marks this sample for `reason`, naming `root` (cut inside the library's
        own bookkeeping, or in flight at the run's removal)."""
        row = marker(self.sample_id, self.forward_index, self.step, root, 0, mode, rank)
        return row(OUTPUT, reason)

    def next_call_index(self, layer: str) -> int:
        """The call_index of this layer's next invocation inside this root forward."""
        with self.call_lock:
            index = self.call_counts.get(layer, 0)
            self.call_counts[layer] = index + 1
        return index


def marker(
    sample_id: int,
    forward_index: int,
    step: int | None,
    info: LayerInfo,
    call_index: int,
    mode: str,
    rank: int | None,
) -> Callable[[str, str], Measurement]:
    """`(signal, reason) -> ` the sample's marker row (metric INTERRUPTED, value null) naming
    `info`'s layer and call."""

    def row(signal: str, reason: str) -> Measurement:
        return Measurement(
            sample_id=sample_id,
            forward_index=forward_index,
            timestamp_us=time.time_ns() // 1000,
            rank=rank,
            layer=info.name,
            module_type=info.module_type,
            call_index=call_index,
            signal=signal,
            tensor_path="",
            shape=None,
            dtype="",
            mode=mode,
            grad_enabled=torch.is_grad_enabled(),
            metrics=(INTERRUPTED,),
            values=(MetricValue(None, reason),),
            step=step,
        )

    return row


def backward_marker(
    sample: SampleFacts, root: LayerInfo, rank: int | None, reason: str
) -> Measurement:
    """The marker row (signal output_gradient) of a sample whose backward was cut, for
    `reason`; `sample` is one of the gradients that arrived, or, when none did, the sample's
    awaited gradients."""
    row = marker(sample.sample_id, sample.forward_index, sample.step, root, 0, sample.mode, rank)
    return row(OUTPUT_GRADIENT, reason)


def cut_note(sample_ids: list[int]) -> str:
    """index.md's note (and the warning) on samples whose end a KeyboardInterrupt cut inside
    the library's own bookkeeping (see `reasons.CUT_IN_BOOKKEEPING`)."""
    return (
        f"a KeyboardInterrupt (Ctrl-C) cut the end of {_listed(sample_ids, 'sampled forward')} "
        "inside the library's own bookkeeping, and the loop went on; the thread's next "
        "root forward restored the layers' forwards and ended the sample, marked with a row of "
        "metric `interrupted` (what it measured was kept; later samples are unaffected)"
    )


# How many sample ids a note lists; beyond them it gives the count of the rest.
MAX_LISTED_IDS = 20


def _listed(sample_ids: list[int], word: str) -> str:
    """`sampled forward 3`, `sampled forwards 3, 5`; past `MAX_LISTED_IDS` ids, the count and
    the first ones: `25 sampled forwards (0, 1, ..., 19 and 5 more)`, so a note never hides how
    many there were."""
    if len(sample_ids) == 1:
        return f"{word} {sample_ids[0]}"
    if len(sample_ids) <= MAX_LISTED_IDS:
        return f"{word}s {', '.join(map(str, sample_ids))}"
    shown = ", ".join(map(str, sample_ids[:MAX_LISTED_IDS]))
    return f"{len(sample_ids)} {word}s ({shown} and {len(sample_ids) - MAX_LISTED_IDS} more)"


def no_backward_before_removal_note(
    sample_ids: list[int], exception: str | None = None, *, removed: bool = True
) -> str:
    """index.md's note on the samples whose backward had not reached any output at removal,
    while their outputs could still get one (`GradientRecorder.unreached`); `exception`: the
    run is removed because a trainer's fit raised it (the traceback keeps such outputs alive,
    but the backward will never come: the exception cut the step between forward and backward).
    A run finished without remove_observer (`removed` False: at an exit an exception caused, a
    rank whose step raised between its forward and its backward) was never removed, so the note
    neither says it was nor advises removing later."""
    their = "its" if len(sample_ids) == 1 else "their"
    listed = _listed(sample_ids, "sample")
    if exception is not None:
        return (
            f"{listed}: no gradient had reached {their} outputs when the fit ended with "
            f"{exception}: the exception came after {their} forward and before {their} "
            f"backward (the training step raised in its loss or its backward), so "
            f"{'it has' if len(sample_ids) == 1 else 'they have'} output rows and no "
            "output_gradient rows: a step that did not complete"
        )
    if not removed:
        it, them = ("it has", "it") if len(sample_ids) == 1 else ("they have", "them")
        return (
            f"{listed}: no gradient had reached {their} outputs when "
            "the run was finished without remove_observer, and they could still receive one "
            f"(their autograd graph was alive): {it} output rows and no output_gradient rows, "
            f"with nothing else to mark {them} (a forward whose outputs are kept but never "
            "backpropagated reads the same)"
        )
    return (
        f"{listed}: no gradient had reached {their} outputs when "
        "remove_observer was called, "
        "and they could still receive one (their autograd graph was alive). A backward pass "
        "run after the removal is not observed: such a sample has output rows and no "
        "output_gradient rows, with nothing else to mark it (a forward whose outputs are "
        "kept but never backpropagated reads the same). Remove the observer after the last "
        "backward to record it"
    )


def removed_in_flight_note(forwards: list[int], backwards: list[int]) -> str:
    """index.md's note on the samples in flight at removal (see `removed_during`)."""
    parts = [
        f"during the {phase} of sample {', '.join(map(str, ids))}"
        for phase, ids in (("forward", forwards), ("backward", backwards))
        if ids
    ]
    return (
        f"{reasons.REMOVED_IN_FLIGHT}: {'; '.join(parts)}. Such a sample is partial (what was measured "
        "before the removal), marked by a row with metric `interrupted`; the rest of its "
        "forward or backward ran unobserved."
    )


class InFlight:
    """The sampled root forwards of one observer now running, one per thread running one.

    Args:
        counter: the observer's counts, where calls no sample took are counted.
        warn_once: says once per reason that such calls were not measured.
    """

    def __init__(self, counter: Counter, warn_once: WarnOnce) -> None:
        # Non-empty exactly while a sampled root forward runs; its bound __len__ is every layer
        # proxy's `enabled` test, evaluated in wrapt's C code.
        self.samples: list[Sample] = []
        # Held while a call of another thread is recorded into a sample and while a sample
        # ends: such a call lands before its sample is emitted, or is counted as late.
        self._lock = threading.Lock()
        self._counter = counter
        self._warn_once = warn_once

    def begin(self, sample: Sample) -> None:
        """`sample`'s root forward has started."""
        with self._lock:
            self.samples.append(sample)

    def end(self, sample: Sample) -> None:
        """`sample`'s root forward has returned (or raised): no call is recorded into it now."""
        with self._lock:
            if sample in self.samples:  # else taken by `take_all` at the run's removal
                self.samples.remove(sample)

    def take_all(
        self, root: LayerInfo, root_mode: Callable[[], str], rank: int | None
    ) -> list[Sample]:
        """Every sample in flight, ended now (the run is being removed during their forwards),
        each with its marker row naming `root`; their layer proxies are inert from here on."""
        with self._lock:
            taken, self.samples[:] = self.samples[:], []
        for sample in taken:
            mode = sample.mode or root_mode()
            sample.interrupted = sample.root_marker(
                root, mode, rank, reasons.removed_during("forward")
            )
        return taken

    def only(self, count: bool) -> Sample | None:
        """The sample a call of a thread without a root forward of its own belongs to: the one
        in flight; None with none, or with several (with `count`, the call is counted and
        said: it is left unmeasured)."""
        in_flight = self.samples[:]  # one step: another thread may end its sample meanwhile
        if len(in_flight) == 1:
            return in_flight[0]
        if in_flight and count:
            self._counter.count_unattributed(several=True)
            self._warn_once("unattributed", _SEVERAL)
        return None

    def record(self, sample: Sample, record: Callable[[], None]) -> None:
        """Run `record` (a call of another thread, measured into `sample`) unless `sample` has
        ended since the call began; then the call is counted and said as late."""
        with self._lock:
            if any(item is sample for item in self.samples):
                record()
                return
        self._counter.count_unattributed(several=False)
        self._warn_once("unattributed-late", _LATE)

    def note(self) -> str | None:
        """index.md's sentence on the calls of other threads that no sample took, or None."""
        several, late = self._counter.unattributed()
        parts = []
        if several:
            parts.append(
                f"{several} call{'s' if several > 1 else ''} made while several sampled forwards "
                "were in flight (the call cannot be attributed to one of them)"
            )
        if late:
            parts.append(
                f"{late} call{'s' if late > 1 else ''} that began during a sampled forward and "
                "returned after it had ended"
            )
        if not parts:
            return None
        return (
            "Calls of selected layers on threads without a root forward of their own (a thread "
            "pool inside the model's forward) are measured in the sampled forward in flight; "
            f"these ran unmeasured and have no rows: {'; '.join(parts)}."
        )


_SEVERAL = (
    "a selected layer was called on a thread without a root forward of its own while several "
    "sampled forwards were in flight, so the call could not be attributed to one of them and was "
    "not measured (index.md counts such calls)"
)
_LATE = (
    "a selected layer called on another thread during a sampled forward returned after that "
    "forward had ended, so the call was not measured (index.md counts such calls)"
)
