"""Numbers as ranges of text, and back: `[0, 1, 2, 5]` <-> `"0-2, 5"`.

One formatter for every list of sample ids, attempts, part numbers and ranks the library prints
or stores (index.md, history.parquet's merged-parts metadata, the command line's rank lists).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["parse_ranges", "ranges"]


def ranges(numbers: Iterable[int], separator: str = ", ") -> str:
    """`[0, 1, 2, 5]` -> `"0-2, 5"`: the distinct numbers, sorted, consecutive ones as a span."""
    ordered = sorted(set(numbers))
    spans: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        spans.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return separator.join(spans)


def parse_ranges(text: str) -> set[int]:
    """`"0-2,5"` (or `"0-2, 5"`) -> `{0, 1, 2, 5}`."""
    numbers: set[int] = set()
    for item in filter(None, (i.strip() for i in text.split(","))):
        lo, _, hi = item.partition("-")
        numbers.update(range(int(lo), int(hi or lo) + 1))
    return numbers
