"""Trainer callbacks: observe a Lightning or Hugging Face Trainer fit with one line.

    trainer = lightning.Trainer(..., callbacks=[LightningObserver()])
    trainer = transformers.Trainer(..., callbacks=[HuggingFaceObserver()])

Each callback injects at the start of fitting and removes at its end, and on an exception (the
Hugging Face one: an exception in a training step, since transformers has no exception event);
writes a run directory under the trainer's own log or output directory unless `output_dir=` is
given; puts the focus layers' histograms into the trainer's TensorBoard logger, on the trainer's
global step, when one is configured; follows the trainer's ranks; and accepts every option of
`inject_observer`, validated when the callback is built.

Design decision: neither Lightning nor transformers is a dependency. Each name below is imported
on first use (PEP 562), and only its own module imports its trainer, so `import
torchinstruments.integrations` costs nothing and the Hugging Face callback never imports
Lightning (nor the other way round).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchinstruments._lazy import lazy_namespace

if TYPE_CHECKING:
    from torchinstruments.integrations.huggingface import HuggingFaceObserver
    from torchinstruments.integrations.lightning import LightningObserver

_EXPORTS = {
    "HuggingFaceObserver": "torchinstruments.integrations.huggingface",
    "LightningObserver": "torchinstruments.integrations.lightning",
}

__all__ = ["HuggingFaceObserver", "LightningObserver"]


__getattr__, __dir__ = lazy_namespace(__name__, globals(), _EXPORTS)
