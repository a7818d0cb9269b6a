"""Order statistics by selection: exact k-th smallest entries in linear time, never a full sort.

A full sort is O(n log n) and its speed depends on whether the CPU and the NumPy build have a
SIMD sort (an order of magnitude apart between CPUs); exact quartiles, min and max need only
selection, which is linear and does not. One selection per kind of device, exact for every input:

* `HostSelection` (NumPy): a strided sample of `SAMPLE` entries is sorted; each group of nearby
  ranks gets two sample values that bracket it with a wide margin (3 standard deviations of the
  sample's rank error), the entries between them are extracted while the moments' first pass
  reads each chunk, and the ranks are selected among those few (recursively; `np.partition`
  below `SMALL` entries or where ties keep a bracket from halving). A bracket that misses its
  ranks (only for adversarial orders) selects from the whole array by `np.partition`, still
  linear.
* `on_device` (torch, no host synchronisation): a radix select over order-preserving integer
  keys, 16 bits a pass (two passes for float32, four for float64); each pass counts, in one
  `index_add_` for all ranks, the digits of the entries sharing each rank's prefix so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["SAMPLE", "SMALL", "HostSelection", "on_device", "on_host", "sortable_keys"]

# Entries of the strided sample that brackets the wanted ranks.
SAMPLE = 1 << 13
# At most this many entries are selected by `np.partition` directly.
SMALL = 1 << 15
_DIGIT_BITS = 16
_DIGITS = 1 << _DIGIT_BITS


class HostSelection:
    """The entries of 1-D finite `values` at 0-based sorted positions: `want` them, let `visit`
    see every chunk once, in order, then read them from `selected`. Nearby ranks (within 1/64
    of the size) share a bracket; min and max come from each chunk's own."""

    def __init__(self, values: np.ndarray) -> None:
        self._values, self._ranks, self._groups = values, [], []
        self._bounds: list[tuple[float, float]] = []  # per group; none: partition it all
        self._below: list[int] = []
        self._pieces: list[list[np.ndarray]] = []
        self._extremes: list[tuple[float, float]] | None = None

    def want(self, ranks: Sequence[int]) -> None:
        """Which sorted positions `selected` returns, in this order."""
        values, size = self._values, self._values.size
        self._ranks = [int(rank) for rank in ranks]
        wanted = sorted(set(self._ranks))
        self._extremes = [] if wanted[0] == 0 or wanted[-1] == size - 1 else None
        for rank in (rank for rank in wanted if 0 < rank < size - 1):  # one group when small
            if self._groups and (size <= SMALL or rank - self._groups[-1][-1] <= size // 64):
                self._groups[-1].append(rank)
            else:
                self._groups.append([rank])
        if size <= SMALL or not self._groups:
            return
        sample = np.sort(values[:: max(size // SAMPLE, 1)])
        count, margin = sample.size, 3 * math.isqrt(sample.size) + 2
        for group in self._groups:
            first = group[0] * count // size - margin
            last = group[-1] * count // size + margin
            low = float(sample[first]) if first > 0 else -math.inf
            self._bounds.append((low, float(sample[last]) if last < count - 1 else math.inf))
        self._below = [0] * len(self._groups)
        self._pieces = [[] for _ in self._groups]

    def visit(self, piece: np.ndarray) -> None:
        """Reads one chunk: its extremes, and each bracket's entries and count below it."""
        if self._extremes is not None:
            self._extremes.append((float(piece.min()), float(piece.max())))
        for index, (low, high) in enumerate(self._bounds):
            mask = piece >= low
            self._below[index] += piece.size - int(np.count_nonzero(mask))
            mask &= piece <= high
            self._pieces[index].append(piece[mask])

    def selected(self) -> list[float]:
        """The entries at the wanted positions (after every chunk was visited)."""
        values, size = self._values, self._values.size
        found: dict[int, float] = {}
        if self._extremes is not None:
            found[0] = min(low for low, _ in self._extremes)
            found[size - 1] = max(high for _, high in self._extremes)
        for index, group in enumerate(self._groups):
            picked = None
            if self._bounds:
                candidates = np.concatenate(self._pieces[index])
                local = [rank - self._below[index] for rank in group]
                if local[0] < 0 or local[-1] >= candidates.size:
                    pass  # the bracket missed: selected from all entries below
                elif 2 * candidates.size > size:  # ties: the bracket barely shrinks
                    picked = np.partition(candidates, local)[local].tolist()
                else:
                    picked = on_host(candidates, local)
            if picked is None:
                picked = np.partition(values, group)[group].tolist()
            found.update(zip(group, picked, strict=True))
        return [found[rank] for rank in self._ranks]


def on_host(values: np.ndarray, ranks: Sequence[int], chunk: int = 1 << 16) -> list[float]:
    """The entries of 1-D finite `values` at 0-based sorted positions `ranks` (each below
    `values.size`), as Python floats, reading `values` in chunks of `chunk` entries."""
    selection = HostSelection(values)
    selection.want(ranks)
    for start in range(0, values.size, chunk):
        selection.visit(values[start : start + chunk])
    return selection.selected()


def sortable_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is the float order of float32/float64 `values` (-0.0 just below
    0.0); NaN must have been replaced beforehand."""
    if values.dtype == torch.float32:
        bits = values.view(torch.int32).to(torch.int64)  # sign-extended
        return bits ^ ((bits >> 63) & 0x7FFFFFFF)
    bits = values.view(torch.int64)
    return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)


def _from_keys(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The floats of `sortable_keys` (the map is its own inverse)."""
    if dtype == torch.float32:
        return (keys ^ ((keys >> 63) & 0x7FFFFFFF)).to(torch.int32).view(torch.float32)
    return (keys ^ ((keys >> 63) & 0x7FFFFFFFFFFFFFFF)).view(torch.float64)


def on_device(values: torch.Tensor, finite: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """The entries at sorted positions `ranks` (int64, each below the finite count) among the
    finite entries of 1-D float32/float64 `values` (`finite`: the mask), with no sync."""
    width = 32 if values.dtype == torch.float32 else 64
    inf = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
    keys = sortable_keys(torch.where(finite, values, inf))
    order = torch.argsort(ranks)  # a handful of ranks, never the tensor
    remaining = ranks[order]
    slots = remaining.numel()
    prefix = torch.zeros_like(remaining)
    for shift in range(width - _DIGIT_BITS, -1, -_DIGIT_BITS):
        if shift == width - _DIGIT_BITS:  # the top digit: one histogram for every rank
            digits = (keys >> shift) + _DIGITS // 2
            counts = torch.zeros(_DIGITS, dtype=torch.int64, device=keys.device)
            counts.index_add_(0, digits, torch.ones_like(digits))
            rows = counts.expand(slots, _DIGITS)
        else:  # entries sharing a rank's prefix, counted in that rank's slot
            higher = keys >> (shift + _DIGIT_BITS)
            slot = torch.searchsorted(prefix, higher).clamp(max=slots - 1)
            hit = prefix[slot] == higher
            bins = torch.where(hit, slot * _DIGITS + ((keys >> shift) & (_DIGITS - 1)), -1)
            counts = torch.zeros(slots * _DIGITS + 1, dtype=torch.int64, device=keys.device)
            counts.index_add_(0, bins + 1, torch.ones_like(bins))
            rows = counts[1:].view(slots, _DIGITS)[torch.searchsorted(prefix, prefix)]
        cumulative = rows.cumsum(1)
        digit = torch.searchsorted(cumulative, remaining.unsqueeze(1), right=True)
        before = cumulative.gather(1, (digit - 1).clamp(min=0))
        remaining = remaining - torch.where(digit > 0, before, 0).squeeze(1)
        digit = digit.squeeze(1)
        if shift == width - _DIGIT_BITS:
            prefix = digit - _DIGITS // 2
        else:
            prefix = (prefix << _DIGIT_BITS) | digit
    selected = torch.empty_like(prefix)
    selected[order] = prefix
    return _from_keys(selected, values.dtype)
