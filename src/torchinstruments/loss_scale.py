"""Loss scaling (`grad_scaler=`): the factor each sample's gradient rows carry.

Design decision: under a `torch.amp.GradScaler` (float16 autocast, Lightning's
`precision="16-mixed"`, the Hugging Face Trainer's `fp16=True` through accelerate) the backward
starts from the loss times the scaler's current scale, so every gradient a plain
`Tensor.register_hook` sees, and so every output_gradient row, is the model's gradient times that
scale: 65536 by default, halved after a step whose gradients overflowed (their rows hold inf or
NaN, and the scaler skips that optimizer step on purpose), grown after `growth_interval` steps
without one. The rows stay what plain hooks see (the contract); the run records the scale beside
them, so a reader can divide by it, and says so loudly (a warning at inject, index.md).

When: once per sampled forward, at its end (`Recording.emit_forward`), after the sample's one
host transfer: `get_scale()` then copies one scalar whose last update the transfer has already
waited for. The scale read there is the one the sample's backward carries: the scaler changes it
only in `update()`, after the backward. Unsampled forwards never read it.

Where: not a history column (the schema's columns are design.md's). The scale is per sample and
changes rarely, so the run's counts keep one `ScaleSpan` per change (`RunCounts.loss_scales`, in
`.state.json`; the flush thread saves them there as they change while the run lives, so a
run killed before removal keeps them: `rundir.live_scales`), and index.md lists them with a ready query that divides gradient statistics by
them (`rundir.page_loss_scale`). Memory: one span per change, at most `MAX_SPANS`; after that the
scale is no longer read and the samples from then on are said to have none.

Without `grad_scaler`, a sampled forward under float16 autocast is said once (a warning and a note):
the loop may scale its loss, and the run cannot know it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from torchinstruments.ambient import apart
from torchinstruments.notices import shown
from torchinstruments.records import RunCounts, ScaleSpan

__all__ = [
    "MAX_SPANS",
    "LossScales",
    "check_grad_scaler",
    "describe_scaler",
    "scaler_notes",
    "trainer_scaler",
]

MAX_SPANS = 10_000
_AUTOCAST_DEVICES = ("cuda", "cpu")
UNSCALED_FP16 = (
    "float16 autocast was on in sampled forwards and no grad_scaler was given: if the loop "
    "scales its loss (torch.amp.GradScaler; Lightning's precision='16-mixed', the Hugging Face "
    "Trainer's fp16=True), every output_gradient row is the model's gradient times the loss "
    "scale (65536 by default, halved at each overflow, when the gradients hold inf/NaN), which "
    "this run does not record; pass grad_scaler=scaler to inject_observer to record it"
)


def check_grad_scaler(value: object) -> Any:
    """`value` if it is a `torch.amp.GradScaler` (or a subclass: torch.cuda.amp's, FSDP's
    `ShardedGradScaler`) or None.

    Raises:
        TypeError: naming `grad_scaler`, the value and what is allowed.
    """
    if value is None or isinstance(value, torch.amp.GradScaler):
        return value
    raise TypeError(
        f"grad_scaler must be a torch.amp.GradScaler (the one the loop calls "
        f"scaler.scale(loss) with) or None, got {type(value).__name__} {value!r}"
    )


def trainer_scaler(owner: object) -> Any:
    """The `GradScaler` a trainer's part holds as `scaler` (Lightning's precision plugin,
    accelerate's Accelerator), or None: bfloat16 and full precision hold none."""
    scaler = getattr(owner, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def describe_scaler(scaler: Any) -> str | None:
    """The scaler as index.md names it, or None without one."""
    if scaler is None:
        return None
    return (
        f"{type(scaler).__name__}(enabled={scaler.is_enabled()}, "
        f"growth_factor={scaler.get_growth_factor():g}, "
        f"backoff_factor={scaler.get_backoff_factor():g}, "
        f"growth_interval={scaler.get_growth_interval()})"
    )


def scaler_notes(described: str | None) -> tuple[str, ...]:
    """What a `grad_scaler` changes in the rows: said at inject (a warning) and in index.md."""
    if described is None:
        return ()
    return (
        f"grad_scaler {described}: output_gradient rows (and gradient histograms) are of the "
        "scaled loss, as plain hooks see them: each is the model's gradient times its sample's "
        "loss scale. Gradient mean, std, min, max and quantiles jump by the scaler's factor "
        "where the scale changes, and a sample whose gradients overflowed (nonfinite_fraction "
        "> 0: the scaler skipped that optimizer step and lowered the scale) shows the scaler's "
        "doing, not the model's. Each sample's scale is in .state.json (counts.loss_scales) "
        "and in index.md's section 'Loss scale', with a query that divides the rows by it",
    )


class LossScales:
    """Each sample's loss scale as spans (a span per change), read at each sampled forward's end.

    Args:
        scaler: the run's `grad_scaler`, or None (`api.start_run` sets a trainer's here).
        failed: `RecordingFailures` (a read that raised: warned once, said in index.md).
        warn_once: the observer's (float16 autocast without a scaler: warned once).
    """

    def __init__(
        self,
        scaler: Any,
        failed: Callable[[str, str], None],
        warn_once: Callable[[str, str], None],
    ) -> None:
        self.scaler = scaler
        self._failed, self._warn_once = failed, warn_once
        self._spans: list[ScaleSpan] = []
        self._end: int | None = None  # the first sample after the last one read
        self._full = False  # MAX_SPANS reached: no more reads
        self._unscaled_fp16 = False
        self._lock = threading.Lock()  # samples of several threads end in any order

    def read(self, sample_id: int) -> None:
        """Keep the scale of sample `sample_id` (its sampled forward has just ended)."""
        if self.scaler is None:
            if not self._unscaled_fp16 and _fp16_autocast():
                self._unscaled_fp16 = True
                self._warn_once("unscaled_fp16", UNSCALED_FP16)
            return
        if self._full:
            return
        try:
            with apart():  # the library's read, not the step's (ambient.py)
                scale: float | None = float(self.scaler.get_scale())
        except Exception as error:
            self._failed(
                "loss_scale",
                f"reading grad_scaler.get_scale() failed: {shown(error)}; the samples from "
                f"{sample_id} on whose read failed have no loss scale in .state.json",
            )
            scale = None
        if scale is not None and not math.isfinite(scale):
            scale = None
        with self._lock:
            if self._end is not None and sample_id < self._end:
                return  # a sample of another thread ended late: the same step's scale
            self._end = sample_id + 1
            if self._spans and self._spans[-1].scale == scale:
                return
            if len(self._spans) >= MAX_SPANS:
                self._full, self._end = True, sample_id
                return
            self._spans.append(ScaleSpan(sample_id, scale))

    def so_far(self) -> tuple[tuple[ScaleSpan, ...], int | None, bool]:
        """The spans read so far, closed by one without a scale after the last sample read (so
        samples after it, never read or of a later attempt that was killed, get none); with
        that first unread sample and whether `MAX_SPANS` was reached. Any thread may call it
        (the flush thread saves them while the run lives: `rundir.live_scales`)."""
        with self._lock:
            spans, end, full = tuple(self._spans), self._end, self._full
        if spans and end is not None:
            spans += (ScaleSpan(end, None),)
        return spans, end, full

    def spans(self) -> tuple[ScaleSpan, ...]:
        """`so_far`'s spans alone."""
        return self.so_far()[0]

    def add_to(self, counts: RunCounts) -> RunCounts:
        """`counts` with the spans (`so_far`) and the notes."""
        spans, end, full = self.so_far()
        notes = (UNSCALED_FP16,) if self._unscaled_fp16 else ()
        if full:
            notes += (
                f"the loss scale changed more than {MAX_SPANS:,} times; it was no longer read "
                f"from sample {end} on, whose loss scale is not recorded",
            )
        if not spans and not notes:
            return counts
        return dataclasses.replace(counts, loss_scales=spans, notes=(*counts.notes, *notes))


def _fp16_autocast() -> bool:
    """Whether float16 autocast is on for a device the loop likely scales (cheap flag reads)."""
    return any(
        torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16
        for device in _AUTOCAST_DEVICES
    )
