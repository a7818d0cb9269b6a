"""What `plot` and `heatmap` share: the optional matplotlib's error, the step axis, tensor labels.

Both draw with matplotlib, which is optional; both can put `step` on the x axis; both name a
tensor the same way in legends and row labels. Kept here so neither imports the other.
"""

from __future__ import annotations

__all__ = ["MISSING_MATPLOTLIB", "NO_STEP", "MatplotlibMissingError", "tensor_label"]

NO_STEP = (
    "no sample of {directory} that matches the selection has a step (history's step column is "
    "null: a trainer callback or torchinstruments.set_step(model, step) gives it); use --x "
    "sample_id or --x forward_index"
)
MISSING_MATPLOTLIB = (
    "torchinstruments plot needs matplotlib, which is an optional dependency: install it with "
    '`pip install "torchinstruments[plot]"` (from a checkout: `uv sync --extra plot`), or '
    "`pip install matplotlib`."
)


class MatplotlibMissingError(ImportError):
    """matplotlib is not installed."""


def tensor_label(
    layer: str, call_index: int, tensor_path: str, mode: str = "train", *, calls: bool
) -> str:
    """`layer`, `layer#call` for layers called several times, the tensor path, then ` [eval]`
    for an eval series (a series of its own)."""
    name = (layer or "<root>") + (f"#{call_index}" if calls else "") + tensor_path
    return name + ("" if mode == "train" else f" [{mode}]")
