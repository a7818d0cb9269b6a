"""Sampled root forwards handed an encoder's outputs: the encoder ran outside them, unobserved.

An encoder-decoder's `generate()` (Hugging Face T5, BART, Whisper) runs its encoder once, through
`model.get_encoder()(...)`, before the first token, and then calls the model once per token with
`encoder_outputs=` and the decoder's inputs. That encoder call is no root forward (the observed
model was not called), so, like any selected layer called outside a root forward (observer.py),
it runs untouched and has no rows; the tokens' samples have rows for the decoder and the head
only. Design decision: say it rather than observe it. Observing it would need a proxy on the
encoder for the whole run, so that every call of it, sampled or not, paid for one (design: an
unsampled forward costs nothing per layer), and a sample of its own that is no call of the
model. So a sampled root forward called with a non-None `encoder_outputs` keyword is counted,
warned about once, and named in index.md (count and sample range). A forward that computes its
encoder itself (training, a plain `model(input_ids=..., labels=...)`) is not this case.

Cost: one dict lookup per sampled root forward; nothing on unsampled ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

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

    def see(self, sample_id: int, kwargs: dict) -> None:
        """Count sample `sample_id` if its root forward was called with `encoder_outputs`."""
        if kwargs.get("encoder_outputs") is None:
            return
        with self._lock:
            self.samples += 1
            self.first = sample_id if self.first is None else min(self.first, sample_id)
            self.last = sample_id if self.last is None else max(self.last, sample_id)
        self._warn_once("encoder_outputs", WARNING)

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
