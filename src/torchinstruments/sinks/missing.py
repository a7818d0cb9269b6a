"""Focus tensors the run's own event file has no histogram for: counted, warned at the first,
and said in index.md.

A focus tensor with no finite entry to count (empty, all NaN or Inf), or one that could not be
measured (e.g. complex), gets a text note in TensorBoard at its step instead of a histogram;
its history rows are written as usual. The run says so once while it goes on (a warning at the
first), and index.md counts them all, naming the first.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchinstruments.events import MissingHistogram, no_histogram_tag
from torchinstruments.notices import warn
from torchinstruments.rundir.layout import TENSORBOARD_DIR
from torchinstruments.rundir.shell import code_span, literal_if_unclear, literal_span

__all__ = ["MissingCount"]


class MissingCount:
    """The run's focus tensors without a histogram, in the order their samples came."""

    def __init__(self) -> None:
        self._first: tuple[str, int, str] | None = None  # tag, forward_index, reason
        self._count = 0

    def add(self, missing: Sequence[MissingHistogram], forward_index: int) -> None:
        """Count `missing` (one sample's); warn at the run's first."""
        if self._first is None:
            first = missing[0]
            self._first = (first.tag, forward_index, first.reason)
            warn(
                f"torchinstruments: focus tensor {literal_if_unclear(first.tag)} has no "
                f"histogram at forward_index {forward_index}: {first.reason} (histograms count "
                "finite entries only). TensorBoard shows a text note "
                f"{no_histogram_tag(first.tag)!r} at each such step, "
                "and index.md counts them; the history rows are written as usual"
            )
        self._count += len(missing)

    def note(self) -> tuple[str, ...]:
        """index.md's note on them (none when every focus tensor had its histogram)."""
        if self._first is None:
            return ()
        tag, step, reason = self._first
        count = self._count
        return (
            f"{count} focus-tensor histogram{' is' if count == 1 else 's are'} missing from "
            f"{TENSORBOARD_DIR}/ "
            "because the tensor had no finite entry to count or could not be measured (first: "
            f"{literal_span(tag)} at forward_index {step}: "
            f"{literal_span(reason)}"
            f"); TensorBoard shows a text note {code_span(no_histogram_tag('<tag>'))} at each "
            "such step, and the history holds those samples' "
            "rows.",
        )
