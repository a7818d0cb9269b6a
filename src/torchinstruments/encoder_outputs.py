"""Sampled root forwards handed an encoder's outputs: the encoder ran outside them, unobserved.

An encoder-decoder's `generate()` (Hugging Face T5, BART, Whisper) runs its encoder once, through
`model.get_encoder()(...)`, before the first token, and then calls the model once per token with
`encoder_outputs=` and the decoder's inputs. That encoder call is no root forward (the observed
model was not called), so, like any selected layer called outside a root forward (observer.py),
it runs untouched and has no rows; the tokens' samples have rows for the decoder and the head
only. Design decision: say it rather than observe it. Observing it would need a proxy on the
encoder for the whole run, so that every call of it, sampled or not, paid for one (design: an
unsampled forward costs nothing per layer), and a sample of its own that is no call of the
model. So a sampled root forward called with a non-None `encoder_outputs`, as a keyword or as
the positional argument the forward's signature puts it at, is counted, warned about once, and
named in index.md (count and sample range). A forward that computes its encoder itself
(training, a plain `model(input_ids=..., labels=...)`) is not this case.

Cost: a dict lookup or two per sampled root forward (the signature is read once per forward
function); nothing on unsampled ones.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from torchinstruments.rundir.ranges import plural, was_were

__all__ = ["EncoderOutputs"]

WARNING = (
    "a sampled root forward was called with `encoder_outputs` (an encoder-decoder's generate() "
    "runs its encoder once through model.get_encoder(), outside any root forward): that "
    "encoder call is not observed, so the encoder's layers have no rows in such samples "
    "(index.md counts them)"
)


class EncoderOutputs:
    """The sampled root forwards handed an encoder's outputs, for a warning and index.md."""

    def __init__(self, warn_once: Callable[[str, str], None]) -> None:
        self._warn_once = warn_once
        self._lock = threading.Lock()
        self.samples = 0
        self.first: int | None = None
        self.last: int | None = None
        self._positions: dict[object, int | None] = {}  # forward function -> its position

    def see(self, sample_id: int, forward: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Count sample `sample_id` if its root forward (`forward`, called with `args` and
        `kwargs`) was handed `encoder_outputs`, by keyword or by position."""
        handed = kwargs.get("encoder_outputs")
        if handed is None and args:
            at = self._position(forward)
            handed = args[at] if at is not None and at < len(args) else None
        if handed is None:
            return
        with self._lock:
            self.samples += 1
            self.first = sample_id if self.first is None else min(self.first, sample_id)
            self.last = sample_id if self.last is None else max(self.last, sample_id)
        self._warn_once("encoder_outputs", WARNING)

    def _position(self, forward: Callable[..., Any]) -> int | None:
        """Where `forward` (a bound method: self excluded) takes `encoder_outputs` positionally,
        read once per function; None where it takes no such argument by position."""
        key = getattr(forward, "__func__", forward)
        try:
            if key not in self._positions:
                self._positions[key] = _positional_index(forward, "encoder_outputs")
            return self._positions[key]
        except TypeError:  # an unhashable callable as forward: read each time, never cached
            return _positional_index(forward, "encoder_outputs")

    def note(self) -> str | None:
        """index.md's note, or None where no sampled forward was handed encoder outputs."""
        if not self.samples:
            return None
        return (
            f"{plural(self.samples, 'sampled root forward')} (sample_id {self.first} .. "
            f"{self.last}) {was_were(self.samples)} called with `encoder_outputs`: the encoder "
            "had run before them, outside any root forward (an encoder-decoder's generate() "
            "runs its encoder once through model.get_encoder(), then the model once per "
            "token), so the encoder's layers have no rows in those samples and that encoder "
            "call is not recorded. Samples whose forward ran the encoder (training, a call "
            "with input_ids) have its rows"
        )


def _positional_index(forward: Callable[..., Any], name: str) -> int | None:
    """The index in a call's positional arguments that binds parameter `name` of `forward`, or
    None: no such parameter, keyword-only, after a `*args`, or a signature that cannot be read
    (a C function, a callable object that hides it)."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except Exception:  # a signature that cannot be read never fails the forward
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for index, parameter in enumerate(parameters):
        if parameter.kind not in positional:
            return None  # `*args` or keyword-only from here on: no fixed position
        if parameter.name == name:
            return index
    return None
