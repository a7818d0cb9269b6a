"""Order statistics by selection: exact k-th smallest entries in linear time, never a full sort.

A full sort is O(n log n) and its speed depends on whether the CPU and the NumPy build have a
SIMD sort (an order of magnitude apart between CPUs); exact quartiles, min and max need only
selection, which is linear and does not. One selection per kind of device, exact for every input:

* `HostSelection` (NumPy): at most `SMALL` entries are sorted (a SIMD sort of an array in the
  cache costs less than one selection call). Above, a sorted random sample gives each group of
  nearby ranks a bracket with a wide margin; the moments' pass counts the entries at or below
  each lower bound and copies those strictly inside (ties are counted, never copied); the ranks
  are then read from that copy. A bracket that misses its ranks selects them from the whole
  array (`select`), still linear.
* `on_device` (torch, no host synchronisation): a radix select over order-preserving integer
  keys, 16 bits a pass (8 for a small CPU tensor, `_digit_bits`), each pass counting the digits
  of every rank's prefix in one `index_add_`.
* `select` (NumPy, where this CPU's sort is slow, `selection_is_quicker`, instead of every sort
  above): a radix select by counting, which no SIMD sort speeds up or slows down.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "SMALL",
    "SORTED_UP_TO",
    "HostSelection",
    "on_device",
    "sample_positions",
    "select",
    "selection_is_quicker",
    "sortable_keys",
]

# At most this many entries are sorted instead of selected.
SMALL = 1 << 15
# The brackets' kept entries are sorted up to this many (a mask would branch at random).
_KEPT_SORTED = 4 * SMALL
_Bits = Any  # a float's bits as signed integers: a NumPy array or a torch tensor
# `on_device`'s digits: 16 bits (few passes: few kernels where each is a launch), 8 for a CPU
# tensor of at most `_NARROW_UP_TO` entries, where counting and summing 2**16 buckets per rank
# costs more than the entries (a 1,000-entry float32 tensor: 3.6 ms with 16 bits, 0.4 with 8).
_DIGIT_BITS, _NARROW_BITS, _NARROW_UP_TO = 16, 8, 1 << 14
# `select` sorts at most this many entries at a time (where this CPU sorts slowly, arrays of
# at most this many are sorted, longer ones selected), and counts this many bits of a key a pass.
SORTED_UP_TO = 1 << 10
_SELECT_BITS = 12


class HostSelection:
    """The entries of 1-D finite `values` at 0-based sorted positions: `want` them, let `visit`
    see every chunk once, in order, then read them from `selected` (over `SMALL` entries:
    fewer are sorted instead). Nearby ranks (within 1/64 of the size) share a
    bracket; min and max come from each chunk's own."""

    def __init__(self, values: np.ndarray, select: bool = False) -> None:
        self._values, self._select = values, select  # `select`: where this CPU sorts slowly
        self.pivot = math.nan  # an entry near the median (the moments' shift), set by `want`
        self._ranks: Sequence[int] = []
        self._brackets: list[_Bracket] = []
        self._extremes: list[tuple[float, float]] | None = None
        self._kept: list[np.ndarray] = []
        self.zeros = 0  # how many entries are zero (-0.0 too), counted as chunks are visited

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
        count = sample_positions(size).size
        margin = 2 * math.isqrt(count) + 2
        places = [(group[0] * count // size, group[-1] * count // size) for group in groups]
        spots = [count // 2]  # where the sorted sample has the pivot, then each group's bounds
        for first, last in places:
            spots += [max(first - margin, 0), first, last, min(last + margin, count - 1)]
        self.pivot, *bounds = self._sampled(spots)
        for index, (group, (first, last)) in enumerate(zip(groups, places, strict=True)):
            low, at_first, at_last, high = bounds[4 * index : 4 * index + 4]
            low = low if first > margin else -math.inf
            high = high if last + margin < count - 1 else math.inf
            # A bound the sample shows tied with the ranks' own estimate is counted as it is read.
            self._brackets.append(_Bracket(group, low, high, low == at_first, high == at_last))

    def visit(self, piece: np.ndarray) -> None:
        """Reads one chunk: its extremes, each bracket's counts, and (one copy for all
        brackets) the entries inside any of them."""
        self.zeros += int(np.count_nonzero(piece == 0))
        if self._extremes is not None:
            self._extremes.append((float(piece.min()), float(piece.max())))
        kept = None
        for bracket in self._brackets:
            inside = bracket.visit(piece)
            if inside is not None:
                kept = inside if kept is None else np.logical_or(kept, inside, out=kept)
        if kept is not None:
            self._kept.append(_where_true(piece, kept))

    def selected(self) -> list[float]:
        """The entries at the wanted positions (after every chunk was visited)."""
        values, size = self._values, self._values.size
        found: dict[int, float] = {}
        if self._extremes is not None:
            found[0] = min(low for low, _ in self._extremes)
            found[size - 1] = max(high for _, high in self._extremes)
        kept = np.concatenate(self._kept) if self._kept else values[:0]
        ascending = not self._select and kept.size <= _KEPT_SORTED
        if ascending:
            kept.sort()
        at: dict[int, int] = {}  # a rank's position among the kept entries, sorted
        for bracket in self._brackets:
            found.update(bracket.selected(values, kept, at))
        if at:  # every bracket's ranks read at once: taken, or one selection
            positions = np.array(list(at.values()))
            picked = kept.take(positions) if ascending else select(kept, positions)
            found.update(zip(at, picked.tolist(), strict=True))
        return [found[rank] for rank in self._ranks]

    def _sampled(self, spots: list[int]) -> list[float]:
        """The entries at `spots` of the sorted sample (`sample_positions`)."""
        sample = self._values.take(sample_positions(self._values.size))
        return (
            select(sample, np.array(spots)) if self._select else np.sort(sample)[spots]
        ).tolist()


@functools.lru_cache(maxsize=32)
def sample_positions(size: int) -> np.ndarray:
    """About (6 `size`)**(2/3) positions below `size` (a power of two, 2**12 to 2**17), uniform at
    random but fixed per size (a stride would see one column of a convolution's output),
    ascending so that they are read in order; the cap sets the brackets' width."""
    exponent = min(17, max(12, round(math.log2(6 * size) * 2 / 3)))
    dtype = np.int32 if size < 2**31 else np.int64
    positions = np.sort(np.random.default_rng(size).integers(0, size, 1 << exponent, dtype))
    positions.flags.writeable = False
    return positions


class _Bracket:
    """Ranks between two sample values: entries counted up to `low`, kept up to `high`."""

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

    def selected(
        self, values: np.ndarray, kept: np.ndarray, at: dict[int, int]
    ) -> dict[int, float]:
        """The bracket's ranks: positions among the sorted `kept` (into `at`), or entries."""
        low, high = self.low, self.high
        below = int(np.count_nonzero(kept <= low))  # kept entries at most low, and below high
        under = int(np.count_nonzero(kept < high)) if high > low else below
        start, end = self.at_most_low, self.at_most_low + under - below
        if self.low == self.high:
            self.at_most_high = start
        found: dict[int, float] = {}
        at.update((rank, below + rank - start) for rank in self.ranks if start <= rank < end)
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
            found.update(zip(missed, select(values, np.array(missed)).tolist(), strict=True))
        return found


def _where_true(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`values[mask]`; a mask NumPy's nonzero branches on (1/16 to 1/10 True) padded first."""
    count = int(np.count_nonzero(mask))
    tail = (mask.size - 9 * count) // 8 + 1  # True entries that make a ninth of the padded mask
    if 16 * count < mask.size or tail <= 0:
        return values.take(np.flatnonzero(mask))
    positions = np.flatnonzero(np.concatenate([mask, np.ones(tail, dtype=bool)]))
    return values.take(positions[:count])


def select(values: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The entries of 1-D finite float32/float64 `values` at 0-based sorted positions `ranks`
    (int64, any order), as float64, sorting at most `SORTED_UP_TO` entries at a time: a radix
    select over order-preserving keys (-0.0 taken as 0.0), `_SELECT_BITS` bits a pass between the
    extremes, read on only in buckets that hold a wanted rank (a bucket of zeros alone ends)."""
    width = values.itemsize * 8
    zeros_alike = values + values.dtype.type(0)  # -0.0 is 0.0: a ReLU gradient's zeros one key
    keys = _flip_negatives(zeros_alike.view(np.int32 if width == 32 else np.int64), width)
    picked = _flip_negatives(_select_keys(keys, np.asarray(ranks)), width)
    return picked.view(values.dtype).astype(np.float64)


def _select_keys(keys: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """`select` of int32/int64 `keys` (at least one), as keys: the wanted ranks' buckets of
    `_SELECT_BITS` bits between the extremes counted, the smallest ones' entries sorted together
    in one copy of at most `SORTED_UP_TO`, each other one read further alone (a bucket of zeros
    alone ends)."""
    if keys.size <= SORTED_UP_TO:
        return np.sort(keys).take(ranks)
    low, high = keys.min(), keys.max()
    out = np.where(ranks == 0, low, high)  # the extremes, read
    last = keys.size - 1
    inner = [(index, rank) for index, rank in enumerate(ranks.tolist()) if 0 < rank < last]
    if low == high or not inner:
        return out
    unsigned = np.uint32 if keys.itemsize == 4 else np.uint64
    shift = max((int(high) - int(low)).bit_length() - _SELECT_BITS, 0)
    digits = ((keys - low).view(unsigned) >> unsigned(shift)).astype(np.intp)  # wrapped, unsigned
    ends = np.bincount(digits).cumsum()
    buckets = ends.searchsorted([rank for _, rank in inner], side="right").tolist()
    starts = {digit: int(ends[digit - 1]) if digit else 0 for digit in buckets}
    sizes = {digit: int(ends[digit]) - start for digit, start in starts.items()}
    zero = -int(low) >> shift if low <= 0 <= high else -1  # the bucket of 0.0's key
    if zero in sizes and sizes[zero] > SORTED_UP_TO and np.count_nonzero(keys == 0) == sizes[zero]:
        zeros = [index for (index, _), digit in zip(inner, buckets, strict=True) if digit == zero]
        out[zeros] = 0  # a bucket of zeros alone (a ReLU's): read no more
        del sizes[zero]
    together, kept_size = [], 0  # buckets sorted in one copy, at most `SORTED_UP_TO` entries
    for digit in sorted(sizes, key=sizes.__getitem__):
        if kept_size + sizes[digit] <= SORTED_UP_TO:
            together.append(digit)
            kept_size += sizes[digit]
    together.sort()
    if together:
        table = np.zeros(ends.size, dtype=bool)
        table[together] = True
        kept = np.sort(keys[table.take(digits)])
        offsets, below = {}, 0
        for digit in together:  # where each bucket's entries begin among the kept ones
            offsets[digit], below = below - starts[digit], below + sizes[digit]
        mine = [
            (i, r + offsets[d]) for (i, r), d in zip(inner, buckets, strict=True) if d in offsets
        ]
        out[[index for index, _ in mine]] = kept.take([position for _, position in mine])
    for digit in (digit for digit in sizes if digit not in together):  # each read further
        mine = [(i, r - starts[d]) for (i, r), d in zip(inner, buckets, strict=True) if d == digit]
        local = np.array([rank for _, rank in mine])
        out[[index for index, _ in mine]] = _select_keys(_where_true(keys, digits == digit), local)
    return out


@functools.cache
def selection_is_quicker(size: int = 1 << 14, tries: int = 3) -> bool:
    """Whether `select` finds quartiles and extremes quicker than `np.sort` sorts on this CPU
    (best of `tries` on `size` float32 values, once per process, about 7 ms): a SIMD sort can be
    ten times a scalar one, or slower than counting (numpy/numpy#32690)."""
    values = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    ranks = np.array([0, size - 1, size // 4, size // 2, 3 * size // 4])
    sort = count = math.inf
    for _ in range(tries):
        start = time.perf_counter()
        np.sort(values)
        middle = time.perf_counter()
        select(values, ranks)
        sort, count = min(sort, middle - start), min(count, time.perf_counter() - middle)
    return count < sort


def sortable_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is the float order of float32/float64 `values` (-0.0 just below
    0.0); NaN must have been replaced beforehand."""
    if values.dtype == torch.float32:
        return _flip_negatives(values.view(torch.int32).to(torch.int64), 32)  # sign-extended
    return _flip_negatives(values.view(torch.int64), 64)


def _flip_negatives(bits: _Bits, width: int) -> _Bits:
    """Float bits <-> sortable keys: negatives' bits but the sign flipped (its own inverse)."""
    return bits ^ ((bits >> (width - 1)) & ((1 << (width - 1)) - 1))


def on_device(values: torch.Tensor, finite: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """The entries at sorted positions `ranks` (int64, each below the finite count) among the
    finite entries of 1-D float32/float64 `values` (`finite`: the mask), with no sync."""
    width = 32 if values.dtype == torch.float32 else 64
    inf = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
    keys = sortable_keys(torch.where(finite, values, inf))
    bits = _digit_bits(keys)
    buckets = 1 << bits
    order = torch.argsort(ranks)  # a handful of ranks, never the tensor
    remaining = ranks[order]
    slots = remaining.numel()
    prefix = torch.zeros_like(remaining)
    for shift in range(width - bits, -1, -bits):
        top = shift == width - bits
        if top:  # the top digit: one histogram for every rank
            digits = (keys >> shift) + buckets // 2
            counts = keys.new_zeros(buckets, dtype=torch.int64)
            counts.index_add_(0, digits, torch.ones_like(digits))
            rows = counts.expand(slots, buckets)
        else:  # entries sharing a rank's prefix, counted in that rank's slot
            higher = keys >> (shift + bits)
            slot = torch.searchsorted(prefix, higher).clamp(max=slots - 1)
            hit = prefix[slot] == higher
            bins = torch.where(hit, slot * buckets + ((keys >> shift) & (buckets - 1)), -1)
            counts = keys.new_zeros(slots * buckets + 1, dtype=torch.int64)
            counts.index_add_(0, bins + 1, torch.ones_like(bins))
            rows = counts[1:].view(slots, buckets)[torch.searchsorted(prefix, prefix)]
        cumulative = rows.cumsum(1)
        digit = torch.searchsorted(cumulative, remaining.unsqueeze(1), right=True)
        before = cumulative.gather(1, (digit - 1).clamp(min=0))
        remaining = remaining - torch.where(digit > 0, before, 0).squeeze(1)
        digit = digit.squeeze(1)
        prefix = digit - buckets // 2 if top else (prefix << bits) | digit
    selected = torch.empty_like(prefix)
    selected[order] = prefix
    floats = _flip_negatives(selected, width)
    return floats.to(torch.int32).view(torch.float32) if width == 32 else floats.view(torch.float64)


def _digit_bits(keys: torch.Tensor) -> int:
    """Bits per pass of `on_device` over `keys`: both widths divide 32 and 64."""
    narrow = keys.device.type == "cpu" and keys.numel() <= _NARROW_UP_TO
    return _NARROW_BITS if narrow else _DIGIT_BITS
