"""Order statistics by selection: exact k-th smallest entries in linear time, never a full sort.

A full sort is O(n log n) and its speed depends on whether the CPU and the NumPy build have a
SIMD sort (an order of magnitude apart between CPUs); exact quartiles, min and max need only
selection, which is linear and does not. One selection per kind of device, exact for every input:

* `HostSelection` (NumPy): at most `SMALL` entries are sorted (a SIMD sort of an array in the cache
  costs less than one selection call). Above, a random sample (`sample_positions`) is sorted; each
  group of nearby ranks gets two sample values that bracket it with a wide margin (4 standard
  deviations of the sample's rank error at worst). While the moments' pass reads each chunk, the
  entries at or below each lower bound are counted and those strictly inside any bracket kept, in
  one copy (ties at a bound, such as a ReLU's zeros, are counted, never copied); each bracket then
  selects its ranks among the kept entries inside it. A bracket that misses its ranks (only for
  adversarial orders) selects them from the whole array by `np.partition`, still linear.
* `on_device` (torch, no host synchronisation): a radix select over order-preserving integer
  keys, 16 bits a pass (two passes for float32, four for float64); each pass counts, in one
  `index_add_` for all ranks, the digits of the entries sharing each rank's prefix so far.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "SMALL",
    "HostSelection",
    "on_device",
    "on_host",
    "sample_positions",
    "sortable_keys",
]

# At most this many entries are sorted instead of selected.
SMALL = 1 << 15
# The brackets' kept entries are sorted up to this many (a mask would branch at random).
_KEPT_SORTED = 4 * SMALL
_DIGIT_BITS = 16
_DIGITS = 1 << _DIGIT_BITS


class HostSelection:
    """The entries of 1-D finite `values` at 0-based sorted positions: `want` them, let `visit`
    see every chunk once, in order, then read them from `selected` (over `SMALL` entries:
    fewer are sorted instead, `on_host`). Nearby ranks (within 1/64 of the size) share a
    bracket; min and max come from each chunk's own."""

    def __init__(self, values: np.ndarray) -> None:
        self._values = values
        self._ranks: Sequence[int] = []
        self._brackets: list[_Bracket] = []
        self._extremes: list[tuple[float, float]] | None = None
        self._kept: list[np.ndarray] = []
        self._zeros = 0  # counted as chunks are visited

    def pivot(self) -> float:
        """An entry near the median: the moments' shift, the sorted sample's middle."""
        return float(self._sample[self._sample.size // 2])

    def want(self, ranks: Sequence[int]) -> None:
        """Which sorted positions `selected` returns, in this order."""
        self._ranks, size = ranks, self._values.size
        wanted = sorted(set(self._ranks))
        self._extremes = [] if wanted[0] == 0 or wanted[-1] == size - 1 else None
        groups: list[list[int]] = []
        for rank in (rank for rank in wanted if 0 < rank < size - 1):
            if groups and rank - groups[-1][-1] <= size // 64:
                groups[-1].append(rank)
            else:
                groups.append([rank])
        if not groups:
            return
        sample = self._sample
        count, margin = sample.size, 2 * math.isqrt(sample.size) + 2
        for group in groups:
            at = group[0] * count // size, group[-1] * count // size  # where the sample has them
            low = float(sample[at[0] - margin]) if at[0] > margin else -math.inf
            high = float(sample[at[1] + margin]) if at[1] + margin < count - 1 else math.inf
            # A bound the sample shows tied with the ranks' own estimate is counted as it is read.
            tied = low == sample[at[0]], high == sample[at[1]]
            self._brackets.append(_Bracket(group, low, high, *tied))

    def visit(self, piece: np.ndarray) -> None:
        """Reads one chunk: its extremes, each bracket's counts, and (one copy for all
        brackets) the entries inside any of them."""
        self._zeros += int(np.count_nonzero(piece == 0))
        if self._extremes is not None:
            self._extremes.append((float(piece.min()), float(piece.max())))
        kept = None
        for bracket in self._brackets:
            inside = bracket.visit(piece)
            if inside is not None:
                kept = inside if kept is None else np.logical_or(kept, inside, out=kept)
        if kept is not None:
            # Padded to over 10% True, NumPy's nonzero is branch-free: 0.4 ns an entry, not 1 to 1.5.
            tail = kept.size // 8 + 1
            positions = np.flatnonzero(np.concatenate([kept, np.ones(tail, dtype=bool)]))
            self._kept.append(piece.take(positions[: positions.size - tail]))

    def zeros(self) -> int:
        """How many entries are zero (-0.0 too), as visited."""
        return self._zeros

    def selected(self) -> list[float]:
        """The entries at the wanted positions (after every chunk was visited)."""
        values, size = self._values, self._values.size
        found: dict[int, float] = {}
        if self._extremes is not None:
            found[0] = min(low for low, _ in self._extremes)
            found[size - 1] = max(high for _, high in self._extremes)
        kept = np.concatenate(self._kept) if self._kept else values[:0]
        ascending = kept.size <= _KEPT_SORTED
        if ascending:  # then each bracket's inner entries are a slice of it, already in order
            kept.sort()
        for bracket in self._brackets:
            found.update(bracket.selected(values, kept, ascending))
        return [found[rank] for rank in self._ranks]

    @functools.cached_property
    def _sample(self) -> np.ndarray:
        """The entries at `sample_positions`, sorted (taken when first needed)."""
        return np.sort(self._values.take(sample_positions(self._values.size)))


@functools.lru_cache(maxsize=32)
def sample_positions(size: int) -> np.ndarray:
    """About (6 `size`)**(2/3) positions below `size` (a power of two, 2**12 to 2**17), uniform at
    random but fixed per size (a stride would see one column of a convolution's output),
    ascending so that they are read in order. The cap sets the brackets' width (about 4 /
    sqrt(sample) of the tensor each): 2**17 rather than 2**15 measures 1e7 entries a quarter
    faster (docs/benchmarks.md)."""
    exponent = min(17, max(12, round(math.log2(6 * size) * 2 / 3)))
    dtype = np.int32 if size < 2**31 else np.int64
    positions = np.sort(np.random.default_rng(size).integers(0, size, 1 << exponent, dtype))
    positions.flags.writeable = False
    return positions


class _Bracket:
    """Ranks bracketed by two sample values: the entries counted at or below `low`, and those
    strictly between the two found among the kept ones (ties are counted, never copied)."""

    def __init__(
        self, ranks: list[int], low: float, high: float, tied_low: bool, tied_high: bool
    ) -> None:
        self.ranks, self.low, self.high = ranks, low, high
        self.at_most_low = 0  # entries <= low
        self.below_low: int | None = 0 if tied_low and low > -math.inf else None
        self.at_most_high: int | None = 0 if tied_high and high < math.inf else None

    def visit(self, piece: np.ndarray) -> np.ndarray | None:
        """Counts what one chunk holds of the bracket; the mask of its entries inside."""
        low, high = self.low, self.high
        inside = None
        if low > -math.inf:
            at_most = piece <= low
            self.at_most_low += int(np.count_nonzero(at_most))
            if high > low:
                inside = np.less(piece, high) ^ at_most if high < math.inf else ~at_most
        elif high < math.inf:
            inside = piece < high
        if self.below_low is not None:
            self.below_low += int(np.count_nonzero(piece < low))
        if self.at_most_high is not None:
            self.at_most_high += int(np.count_nonzero(piece <= high))
        return inside

    def selected(self, values: np.ndarray, kept: np.ndarray, ascending: bool) -> dict[int, float]:
        """The bracket's ranks and their entries (from all `values` where the bracket missed),
        from the `kept` entries (`ascending`: sorted)."""
        low, high = self.low, self.high
        if high <= low:
            inner = kept[:0]
        elif ascending:
            bound = kept.dtype.type  # a Python float would make searchsorted cast all of `kept`
            first = kept.searchsorted(bound(low), "right")
            inner = kept[first : kept.searchsorted(bound(high), "left")]
        else:
            inner = kept[(kept > low) & (kept < high)]
        start, end = self.at_most_low, self.at_most_low + inner.size
        if self.low == self.high:
            self.at_most_high = start
        found: dict[int, float] = {}
        local = [rank - start for rank in self.ranks if start <= rank < end]
        if local:
            if ascending:
                picked = inner.take(local).tolist()
            elif 2 * inner.size > values.size:  # the bracket barely shrank: one partition
                picked = np.partition(inner, local)[local].tolist()
            else:
                picked = on_host(inner, local)
            found.update((start + rank, value) for rank, value in zip(local, picked, strict=True))
        missed = []
        for rank in (rank for rank in self.ranks if not start <= rank < end):
            if rank < start:  # ties at low, or a miss
                if self.below_low is None:
                    self.below_low = int(np.count_nonzero(values < self.low))
                if rank >= self.below_low:
                    found[rank] = self.low
                    continue
            else:
                if self.at_most_high is None:
                    self.at_most_high = int(np.count_nonzero(values <= self.high))
                if rank < self.at_most_high:
                    found[rank] = self.high
                    continue
            missed.append(rank)
        if missed:  # a sample this far off is a chance in millions: exact, still linear
            found.update(zip(missed, np.partition(values, missed)[missed].tolist(), strict=True))
        return found


def on_host(values: np.ndarray, ranks: Sequence[int], chunk: int = 1 << 16) -> list[float]:
    """The entries of 1-D finite `values` at 0-based sorted positions `ranks` (each below
    `values.size`), as Python floats, reading `values` in chunks of `chunk` entries (at most
    `SMALL` of them sorted instead)."""
    if values.size <= SMALL:
        return np.sort(values).take(ranks).tolist()
    selection = HostSelection(values)
    selection.want(ranks)
    for start in range(0, values.size, chunk):
        selection.visit(values[start : start + chunk])
    return selection.selected()


def sortable_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is the float order of float32/float64 `values` (-0.0 just below
    0.0); NaN must have been replaced beforehand."""
    if values.dtype == torch.float32:
        return _flip_negatives(values.view(torch.int32).to(torch.int64), 32)  # sign-extended
    return _flip_negatives(values.view(torch.int64), 64)


def _flip_negatives(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Negative floats' bits (`width` of them, as int64) with all but the sign flipped: its own
    inverse, from floats' bits to `sortable_keys` and back."""
    return bits ^ ((bits >> 63) & ((1 << (width - 1)) - 1))


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
        top = shift == width - _DIGIT_BITS
        if top:  # the top digit: one histogram for every rank
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
        prefix = digit - _DIGITS // 2 if top else (prefix << _DIGIT_BITS) | digit
    selected = torch.empty_like(prefix)
    selected[order] = prefix
    floats = _flip_negatives(selected, width)
    return floats.to(torch.int32).view(torch.float32) if width == 32 else floats.view(torch.float64)
