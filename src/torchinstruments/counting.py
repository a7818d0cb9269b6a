"""How much one observer has seen: root forwards, samples, and each layer's sampled forwards.

A call of the model that the autograd engine makes during a backward pass (activation
checkpointing of the whole model recomputing its forward) is no root forward: it is counted
apart (`count_recomputed`), never sampled, and index.md says what that means for gradients.

Every thread that runs the observed model updates these, so they live behind one lock, and the
sampler is asked under it: forward_index and sample_id are each handed out once, in order.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

from torchinstruments.interrupts import NOT_HELD, SIGINT, hold_signal
from torchinstruments.phases import SETUP, TRAIN
from torchinstruments.records import RunCounts

__all__ = ["Counter", "recomputed_note"]


class Counter:
    """The counts of one observer (`RunCounts` once the backward side is added)."""

    def __init__(
        self,
        first_forward_index: int = 0,
        first_sample_id: int = 0,
        first_train_index: int | None = None,
        first_eval_index: int = 0,
    ) -> None:
        self._lock = threading.Lock()
        # This observer's counts; ids are handed out after `first_*` (a continued run's earlier
        # attempts used those before them).
        self.root_forwards = 0
        self.samples = 0
        # Per schedule (phases.TRAIN, phases.EVAL): the root forwards it has seen, which is what
        # its sampler is asked with; and the forwards passed through unobserved: evaluation
        # forwards (phases.UNOBSERVED) and the fit's setup forwards (phases.SETUP).
        self.train_forwards = 0
        self.eval_forwards = 0
        self.unobserved = 0
        self.setup = 0
        self.bypassed_by: str | None = None  # set at removal (bypass.py)
        self._first_forward = first_forward_index
        self._first_sample = first_sample_id
        # Each schedule continues where a continued run's earlier attempts left it
        # (`rundir.attempts.plan_continuation`); by default the training schedule is forward_index.
        self._first_train = first_forward_index if first_train_index is None else first_train_index
        self._first_eval = first_eval_index
        # Per selected layer (root included): the sampled forwards in which it was called.
        self._layer_samples: dict[str, int] = {}
        # Calls of selected layers on a thread without a root forward of its own that no sample
        # could take (observer.py): made while several sampled forwards were in flight, and
        # begun during a sample but returned after it ended.
        self.unattributed_several = 0
        self.unattributed_late = 0
        self.recomputed = 0  # calls of the model made by a backward pass (module docstring)
        # Called with (next sample_id, next forward_index) as each sample is taken, under the
        # lock, so its calls come in the order the ids were handed out: the run's id mark
        # (`rundir.id_mark`). Never per unsampled forward; it must not raise.
        self.taken: Callable[[int, int], None] | None = None

    def next_forward(
        self, should_sample: Callable[[int, str], bool], schedule: str
    ) -> tuple[int, int | None, Any]:
        """Count one root forward on `schedule`: its forward_index, its sample_id if
        `should_sample(index on that schedule, schedule)` says so, and for a sample, SIGINT's
        handler as it was before the sample's start was held (interrupts.py: the caller
        `release`s it), else NOT_HELD."""
        held: Any = NOT_HELD
        with self._lock:
            forward_index = self._first_forward + self.root_forwards
            self.root_forwards += 1
            if schedule == TRAIN:  # two plain counters: no dict work per root forward
                index = self._first_train + self.train_forwards
                self.train_forwards += 1
            else:
                index = self._first_eval + self.eval_forwards
                self.eval_forwards += 1
            sample_id = (
                self._first_sample + self.samples if should_sample(index, schedule) else None
            )
            if sample_id is not None:
                self.samples += 1
                # Held from here (before the lock's release, where an interrupt would land) to
                # the call of the user's forward: the sample's start is never cut.
                try:
                    held = signal.signal(SIGINT, hold_signal)
                except KeyboardInterrupt:  # one pending is raised before the swap: held on now
                    held = signal.signal(SIGINT, hold_signal)
                    hold_signal(SIGINT, None)
                except ValueError:  # not the main thread: no SIGINT arrives here
                    held = NOT_HELD
                if self.taken is not None:
                    self.taken(sample_id + 1, forward_index + 1)
        return forward_index, sample_id, held

    def count_unobserved(self, schedule: str) -> None:
        """One forward on `schedule` passed through unobserved: an evaluation forward, or one of
        the fit's setup (phases.SETUP)."""
        with self._lock:
            if schedule == SETUP:
                self.setup += 1
            else:
                self.unobserved += 1

    def count_recomputed(self) -> None:
        """One call of the model made during a backward pass (`recomputed_note`)."""
        with self._lock:
            self.recomputed += 1

    def count_layers(self, names: Iterable[str]) -> None:
        """One more sampled forward for each of these layers."""
        with self._lock:
            for name in names:
                self._layer_samples[name] = self._layer_samples.get(name, 0) + 1

    def count_unattributed(self, several: bool) -> None:
        """One call of another thread left unmeasured: `several` samples in flight, or late."""
        with self._lock:
            if several:
                self.unattributed_several += 1
            else:
                self.unattributed_late += 1

    def unattributed(self) -> tuple[int, int]:
        """The calls `count_unattributed` counted: (several in flight, late)."""
        with self._lock:
            return self.unattributed_several, self.unattributed_late

    def layer_samples(self) -> dict[str, int]:
        """A copy of the per-layer counts (a layer missing from it never ran in a sample)."""
        with self._lock:
            return dict(self._layer_samples)

    def never_ran(self, names: Iterable[str]) -> list[str]:
        """Those of the selected layers `names` (root included) not called in any sampled
        forward so far."""
        ran = self.layer_samples()
        return [name for name in names if not ran.get(name)]

    def counts(
        self, backward_samples: int, notes: tuple[str, ...], so_far: bool = False
    ) -> RunCounts:
        """The run's counts, with what the backward side and the observer add; `so_far`: for
        the state a live run saves, whose note counts are lower bounds if it is killed."""
        with self._lock:
            if self.recomputed:
                notes = (*notes, recomputed_note(self.recomputed, so_far))
            return RunCounts(
                self.root_forwards,
                self.samples,
                backward_samples,
                dict(self._layer_samples),
                notes,
                train_forwards=self.train_forwards,
                eval_forwards=self.eval_forwards,
                unobserved_eval_forwards=self.unobserved,
                unobserved_setup_forwards=self.setup,
                bypassed_by=self.bypassed_by,
            )


def recomputed_note(calls: int | None = None, so_far: bool = False) -> str:
    """What the run says of the calls of the model made during a backward pass (the warning at
    the first, without a count; index.md, with the count of them all). `so_far`: the count as
    of a live run's last save of its state, which a kill leaves as it was: a lower bound."""
    times = "" if calls is None else " once" if calls == 1 else f" {calls} times"
    if so_far and calls is not None:
        times = f" at least{times} (up to the run's last save of its state while it went on)"
    return (
        f"the model was called during a backward pass{times} (activation checkpointing of the "
        "whole model, `checkpoint(model, ...)`, calls it again there to recompute its "
        "forward): such a call is torch's recomputation, not a root forward, so it is not "
        "counted, sampled or observed. With use_reentrant=False the gradients of the sampled "
        "forwards are recorded as usual; with use_reentrant=True the model's own forward ran "
        "under torch.no_grad() and its gradients flow only through the recomputation, so those "
        "samples have output rows (grad_enabled false) and no output_gradient rows; they are "
        "no evaluation forwards, as a forward under the caller's torch.no_grad() is: their mode "
        "is the layers' own flag, and inside a trainer's training step they are its training "
        "forwards"
    )
