"""index.md stays within its bound however many times a run is continued: the notes, the loss
ledger and the Attempts table grow with each attempt, and the page shows their first and last
entries and counts the rest."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from test_index_page import run_info

from torchinstruments.records import RunCounts
from torchinstruments.rundir.attempts import KILLED, REMOVED, AttemptCounts, attempt_notes
from torchinstruments.rundir.index_page import render_index
from torchinstruments.rundir.ledger import MAX_ENTRIES, LostRows
from torchinstruments.rundir.page_bounds import SHOWN_ATTEMPTS, SHOWN_LOSSES
from torchinstruments.rundir.state import RunState

PAGE_BOUND = 64 * 1024
SAMPLES = 100  # per attempt


def continued(directory: Path, attempts: int) -> RunState:
    """A run continued `attempts - 1` times, each attempt saying three long notes (as a NaN
    histogram, a raising layer and an evaluation forward do) and losing rows in a full ledger."""
    notes: tuple[str, ...] = ()
    losses: tuple[LostRows, ...] = ()
    for a in range(attempts):
        said = [f"note {k} of attempt {a}: " + "words " * 70 for k in range(3)]
        notes += attempt_notes(a, said)
        first = a * SAMPLES
        losses += tuple(
            LostRows(7, first + e, first + e, f"writing a part failed (OSError: {a}/{e})")
            for e in range(MAX_ENTRIES)
        )
    counts = tuple(
        AttemptCounts(a, "2026-01-01T00:00:00+00:00", a * SAMPLES, a * SAMPLES, 100, 100, 100)
        for a in range(attempts)
    )
    total = attempts * SAMPLES
    return RunState(
        run_info(directory),
        RunCounts(total, total, total),
        losses=losses,
        notes=notes,
        attempts=tuple(ended(c) for c in counts),
    )


def ended(attempt: AttemptCounts) -> AttemptCounts:
    return AttemptCounts(
        attempt.attempt,
        attempt.started_at,
        attempt.first_sample_id,
        attempt.first_forward_index,
        attempt.root_forwards,
        attempt.samples,
        attempt.backward_samples,
        ended=REMOVED,
        sampler=f"EveryNForwardsSampler(every={1 + attempt.attempt % 2})",  # a change each time
    )


def test_a_run_continued_twice_as_often_has_a_page_of_the_same_size(tmp_path: Path) -> None:
    """30 and 60 attempts (each with notes, a full loss ledger and another sampler than the
    last) make pages with as many notes, ledger lines, table rows and samplers, within the
    bound; 80 attempts of a small model with a
    few notes each made an 89 KB page before."""
    pages = [render_index(continued(tmp_path, n)) for n in (30, 60)]
    shapes = [
        (
            sum(line.startswith("**Note:**") for line in page.splitlines()),
            sum("recorded but not written" in line for line in page.splitlines()),
            page.split("## Attempts", 1)[1].split("\n## ", 1)[0].count("\n| "),
            next(line for line in page.splitlines() if "sampler, per attempt" in line).count(";"),
        )
        for page in pages
    ]
    assert shapes[0] == shapes[1]
    assert all(len(page.encode("utf-8")) <= PAGE_BOUND for page in pages)


def test_the_first_and_last_entries_are_listed_and_the_rest_counted(tmp_path: Path) -> None:
    """The page keeps each list's ends and counts the middle exactly, naming where every entry
    is; the rows lost in the entries not listed are summed, so the total stays on the page."""
    attempts = 40
    page = render_index(continued(tmp_path, attempts))
    assert "note 0 of attempt 0: " in page
    assert "note 2 of attempt 39: " in page
    assert "note 0 of attempt 20: " not in page
    notes = [line for line in page.splitlines() if line.startswith("**Note:**")]
    counted = [line for line in notes if "more notes" in line]
    assert len(counted) == 1
    hidden = int(counted[0].split()[1])
    assert len(notes) - 1 + hidden == attempts * 3
    assert "`.state.json` (`notes`) holds every one" in counted[0]

    losses = [line for line in page.splitlines() if "recorded but not written" in line]
    assert len(losses) == SHOWN_LOSSES + 1
    entries = attempts * MAX_ENTRIES - SHOWN_LOSSES
    rows = 7 * entries
    last_hidden = (attempts - 1) * SAMPLES + MAX_ENTRIES - 1 - SHOWN_LOSSES // 2
    assert losses[SHOWN_LOSSES // 2] == (
        f"- {rows:,} rows of samples {SHOWN_LOSSES // 2}-{last_hidden} (within) were recorded "
        f"but not written, in {entries} more entries of the ledger not listed here (this page's "
        "size bound): `.state.json` (`losses`) lists each with its reason."
    )

    table = page.split("## Attempts", 1)[1].split("\n## ", 1)[0]
    rows_shown = [
        line for line in table.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert rows_shown[1].startswith("| 0 |")
    assert rows_shown[-1].startswith("| 39 |")
    middle = (
        f"| ... | {attempts - SHOWN_ATTEMPTS} more attempts, counted in `.state.json` (`attempts`)"
    )
    assert sum(line.startswith(middle) for line in rows_shown) == 1
    assert len(rows_shown) == 1 + SHOWN_ATTEMPTS + 1  # the header, the ends, the count


def test_a_short_run_lists_every_note_loss_and_attempt(tmp_path: Path) -> None:
    """Under the budgets nothing is left out and no count line is added."""
    state = continued(tmp_path, 2)
    state = RunState(
        state.run,
        state.counts,
        losses=state.losses[:3],
        notes=state.notes[:4],
        attempts=state.attempts,
    )
    page = render_index(state)
    assert "more notes" not in page
    assert "more entries of the ledger" not in page
    assert "more attempts" not in page
    assert sum(line.startswith("**Note:** attempt ") for line in page.splitlines()) == 4
    assert sum("recorded but not written: writing" in line for line in page.splitlines()) == 3


def killed(state: RunState) -> RunState:
    """`state` with every attempt but the last killed, each losing its last 3 sample ids (so
    sample_id skips after it), with its own flush interval (one of 7), and a sample in flight
    at each removal."""
    last = len(state.attempts) - 1
    attempts = tuple(
        a
        if a.attempt == last
        else dataclasses.replace(
            a, ended=KILLED, samples=a.samples - 3, flush_seconds=float(a.attempt % 7 + 1)
        )
        for a in state.attempts
    )
    in_flight = tuple(a.first_sample_id for a in state.attempts)
    return dataclasses.replace(
        state, attempts=attempts, interrupted=True, removed_in_flight=in_flight
    )


def test_a_job_killed_at_every_restart_has_lines_of_the_same_length(tmp_path: Path) -> None:
    """100 and 200 preempted attempts: the lines that named each killed attempt (its flush
    interval, its sample_id skip, its sample in flight) name the first and last few and count
    the rest, so the longest line grows by digits only (it was 23 KB at 1,000 attempts)."""
    longest = []
    for attempts in (100, 200):
        page = render_index(killed(continued(tmp_path, attempts)))
        assert len(page.encode("utf-8")) <= PAGE_BOUND
        longest.append(max(len(line) for line in page.splitlines()))
    assert longest[1] - longest[0] <= 16


def test_a_run_of_one_attempt_shows_every_note(tmp_path: Path) -> None:
    """Only earlier attempts' notes are cut: a note of the run's own attempt may say what it
    could not observe, so 12 long ones are all on the page."""
    notes = tuple(f"note {k}: " + "words " * 70 for k in range(12))
    page = render_index(RunState(run_info(tmp_path), RunCounts(1, 1, 1), notes=notes))
    assert sum(line.startswith("**Note:** note ") for line in page.splitlines()) == 12
    assert "more note" not in page
