"""Numbers as text: ranges and back (`[0, 1, 2, 5]` <-> `"0-2, 5"`), counts with their noun, and
names listed up to a limit.

One formatter for every list of sample ids, attempts, part numbers and ranks the library prints
or stores (index.md, history.parquet's merged-parts metadata, the command line's rank lists),
and one for every count it prints (`1 sample`, `2 samples`: index.md, the trainer notes, the
command line), so a count of 1 never reads "1 samples", or rebuilt after a kill (`at least 2
samples`, `unknown samples`). A list of names in a message (an error, a warning, a note in
index.md) shows the first 20 and counts the rest (`listed`), so it stays bounded on any model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

__all__ = [
    "bound_count",
    "ends",
    "ends_said",
    "few_ranges",
    "listed",
    "parse_ranges",
    "plural",
    "ranges",
    "was_were",
]

T = TypeVar("T")


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


def few_ranges(numbers: Iterable[int], spans: int = 10) -> str:
    """`ranges` for a page (never read back): the first and last `spans` spans in all, the
    others counted between them (`"0-2, 5, ... (40 more), 97, 99"`), so a list that grows with
    a run's attempts or samples stays bounded."""
    return ends_said(ranges(numbers).split(", "), spans)


def ends(items: Sequence[T], shown: int) -> tuple[Sequence[T], int, Sequence[T]]:
    """The first `shown // 2` items, how many are left out, and the last ones (all, when they
    are at most `shown`)."""
    if len(items) <= shown:
        return items, 0, ()
    head = shown // 2
    tail = shown - head
    return items[:head], len(items) - shown, items[len(items) - tail :]


def ends_said(items: Sequence[str], shown: int = 10) -> str:
    """`items` joined with commas, the first and last `shown` in all, the others counted."""
    head, hidden, tail = ends(items, shown)
    return ", ".join([*head, *([f"... ({hidden} more)"] if hidden else []), *tail])


def parse_ranges(text: str) -> set[int]:
    """`"0-2,5"` (or `"0-2, 5"`) -> `{0, 1, 2, 5}`."""
    numbers: set[int] = set()
    for item in filter(None, (i.strip() for i in text.split(","))):
        lo, _, hi = item.partition("-")
        numbers.update(range(int(lo), int(hi or lo) + 1))
    return numbers


def plural(count: int, word: str, many: str | None = None) -> str:
    """`1 sample`, `2 samples` (`many` for an irregular plural)."""
    return f"{count} {word if count == 1 else (many or word + 's')}"


def was_were(count: int) -> str:
    """The verb that agrees with `count` things: `was` for 1, else `were`."""
    return "was" if count == 1 else "were"


def bound_count(n: int, word: str = "") -> str:
    """A count rebuilt from history: `at least N <word>s`, or `unknown` for 0 (no row says
    anything: a count nobody wrote is unknown, never 0)."""
    if not word:
        return f"at least {n}" if n else "unknown"
    return f"at least {plural(n, word)}" if n else f"unknown {word}s"


def listed(names: Sequence[str], limit: int = 20, *, quote: bool = False) -> str:
    """`a, b ... (3 more)`: the first `limit` names (each `repr`-quoted with `quote`), then how
    many more."""
    shown = [repr(name) for name in names[:limit]] if quote else names[:limit]
    more = f" ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(shown) + more
