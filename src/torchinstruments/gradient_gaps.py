"""Sampled outputs that required no grad: which series have no output_gradient rows, and why.

A sampled output (with grad enabled) that does not require grad gets no hook, since no gradient
can arrive, exactly as plain `Tensor.register_hook` users skip it; its output_gradient rows are
absent, not null. The run says why, per tensor series (layer, call_index, tensor_path), in two
cases: a layer none of whose outputs ever required grad (nothing before it does: a layer without
parameters fed the input data, a frozen stem), and a series that required grad in some samples
and not in others (a part of the model frozen or unfrozen with `requires_grad_` mid-run, as
fine-tuning does): its gradient rows stop, or start late, and a reader must not take that for a
layer that stopped running. The second is warned once, when first seen, and both are in
index.md. Kept per series, not per layer: a layer that returns a tensor with grad beside a
detached one in every sample changed nothing. Bounded: one entry per series.
"""

from __future__ import annotations

from torchinstruments.notices import warn

__all__ = ["GradientGaps"]

# (layer, call_index, tensor_path); the layer's name alone for call 0's bare tensor (`""`), which
# is most outputs: a string's hash is cached, a tuple's is computed at every lookup.
Series = str | tuple[str, int, str]

_SHOWN = 20  # names listed per note (index.md stays bounded on any model)

CHANGED_WARNING = (
    "torchinstruments: a sampled output requires no grad where its series required grad in "
    "another sample (or the reverse): a part of the model frozen or unfrozen with "
    "requires_grad_ mid-run, say; those samples have no output_gradient rows for it, and "
    "index.md names every such series at removal"
)


class GradientGaps:
    """Which sampled series' outputs (with grad enabled) did or did not require grad."""

    def __init__(self) -> None:
        self.with_grad: set[Series] = set()
        # Per series without grad in some sample, in the order seen: [samples, first, last].
        self._without: dict[Series, list[int]] = {}
        self._warned = False

    def without_grad(self, series: Series, sample_id: int) -> None:
        """A sampled output of `series` in `sample_id` that requires no grad."""
        seen = self._without.get(series)
        if seen is None:
            self._without[series] = [1, sample_id, sample_id]
        elif seen[2] != sample_id:
            seen[0] += 1
            seen[2] = sample_id
        if series in self.with_grad:
            self._changed()

    def first_with_grad(self, series: Series) -> None:
        """The first sampled output of `series` that requires grad (callers test `with_grad`)."""
        self.with_grad.add(series)
        if series in self._without:
            self._changed()

    def _changed(self) -> None:
        """Warn once per run that a series' outputs changed whether they require grad."""
        if not self._warned:
            self._warned = True
            warn(CHANGED_WARNING)

    def notes(self) -> tuple[str, ...]:
        """index.md's notes: layers whose outputs never required grad, and series that did in
        some samples only."""
        layers_with = {_layer(series) for series in self.with_grad}
        without = (_layer(series) for series in self._without)
        never = list(dict.fromkeys(name for name in without if name not in layers_with))
        some = [(s, seen) for s, seen in self._without.items() if s in self.with_grad]
        notes = []
        if never:
            notes.append(
                f"{len(never)} selected layer{'' if len(never) == 1 else 's'} never returned an "
                "output that requires grad, so no gradient can arrive and "
                f"{'it has' if len(never) == 1 else 'they have'} no output_gradient rows: "
                f"{_listed([repr(name) for name in never])} (nothing before them requires "
                "grad: e.g. a layer without parameters fed the input data, or a frozen part of "
                "the model)."
            )
        if some:
            shown = [
                f"{_series(series)} ({count} sample{'' if count == 1 else 's'}, from {first} to "
                f"{last})"
                for series, (count, first, last) in some
            ]
            notes.append(
                f"{len(some)} sampled output{'' if len(some) == 1 else 's'} required no grad in "
                "some samples and grad in others (a part of the model frozen or unfrozen with "
                "requires_grad_ mid-run, say), so those samples have no output_gradient rows "
                "for them (a layer's first call unless a call or tensor_path is named; the "
                f"samples without grad, first to last): {_listed(shown)}."
            )
        return tuple(notes)


def _layer(series: Series) -> str:
    """The layer of a series."""
    return series if isinstance(series, str) else series[0]


def _series(series: Series) -> str:
    """A series as a note names it: the layer, then its call and path where not the first."""
    if isinstance(series, str):
        return repr(series)
    layer, call_index, path = series
    return (
        repr(layer) + (f" call {call_index}" if call_index else "") + (f" {path}" if path else "")
    )


def _listed(names: list[str]) -> str:
    """The first `_SHOWN` names, then how many more."""
    more = f" ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
