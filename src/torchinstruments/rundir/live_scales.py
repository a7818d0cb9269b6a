"""The loss scales a live run has read so far, kept in its state file as they change.

Design decision: a run with a `grad_scaler` keeps each sample's loss scale as spans
(`loss_scale.LossScales`). Kept in memory until removal, they died with a process killed before
it (SIGKILL, a scheduler's kill), and the output_gradient rows that had reached the disk could
no longer be unscaled. The flush thread keeps them in the state file instead
(`RunState.loss_scales`, `sinks.directory`), as it keeps the notes (`rundir.live_notes`): each
round that the rows make anyway reads them and saves them when they changed, so every sample
whose gradient rows a round wrote has its scale in the same round's save (a sample's scale is
read at its forward's end, before its backward makes those rows). The spans end with one
without a scale after the last sample read, so a sample the save did not cover reads as
unknown, never as an earlier sample's scale. The training step pays nothing for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torchinstruments.records import ScaleSpan
from torchinstruments.rundir.attempts import joined_spans

__all__ = ["LiveScales"]


def _none() -> tuple[ScaleSpan, ...]:
    return ()


class LiveScales:
    """The whole run's loss scale spans as they stand, and which of them the state file holds.

    Args:
        earlier: the spans of the run's earlier attempts (resume=True), as its state has them.
    """

    def __init__(self, earlier: tuple[ScaleSpan, ...] = ()) -> None:
        self._earlier = earlier
        self._this: Callable[[], tuple[ScaleSpan, ...]] = _none
        self._read: tuple[ScaleSpan, ...] = ()  # this attempt's, as last read
        self._saved = earlier

    def follow(self, this: Callable[[], tuple[ScaleSpan, ...]]) -> None:
        """Read this attempt's spans with `this()` at each round from now on."""
        self._this = this

    def now(self) -> tuple[ScaleSpan, ...]:
        """The earlier attempts' spans, then this attempt's as they stand (a read that raises
        keeps the last ones read)."""
        with contextlib.suppress(Exception):
            self._read = tuple(self._this())
        return joined_spans(self._earlier, self._read)

    def changed(self, spans: tuple[ScaleSpan, ...]) -> bool:
        """Whether `spans` differ from those the state file holds."""
        return spans != self._saved

    def saved(self, spans: tuple[ScaleSpan, ...]) -> None:
        """The state file holds `spans`."""
        self._saved = spans
