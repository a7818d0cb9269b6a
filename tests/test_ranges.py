"""rundir/ranges.py: numbers as `0-2, 5` and back, the one formatter every list of samples,
attempts, parts and ranks goes through."""

from __future__ import annotations

import random

from torchinstruments.rundir.ranges import parse_ranges, ranges


def test_ranges_read_back_as_the_numbers_they_were_made_from() -> None:
    rng = random.Random(5)
    for _ in range(200):
        numbers = [rng.randrange(40) for _ in range(rng.randrange(12))]
        for separator in (", ", ","):
            text = ranges(numbers, separator)
            assert parse_ranges(text) == set(numbers)
            spans = text.split(separator) if text else []
            assert len(spans) == sum(  # one span per run of consecutive numbers
                1 for n in set(numbers) if n - 1 not in set(numbers)
            )


def test_ranges_are_sorted_and_spans_use_a_hyphen() -> None:
    assert ranges([5, 2, 0, 1, 2]) == "0-2, 5"
    assert ranges([7], ",") == "7"
    assert ranges([]) == ""
    assert parse_ranges("") == set()
