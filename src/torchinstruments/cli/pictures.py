"""What `plot` and `heatmap` share: the optional matplotlib's error, the step axis.

Both draw with matplotlib, which is optional; both can put `step` on the x axis (tensors are
named as in every command, `text.tensor_label`). Kept here so neither imports the other.
"""

from __future__ import annotations

__all__ = ["MISSING_MATPLOTLIB", "NO_STEP", "MatplotlibMissingError"]

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
