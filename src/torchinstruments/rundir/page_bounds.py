"""What index.md shows of the lists that grow with a run's life: notes, losses, attempts.

The sampler line of the Run section (`attempts.sampler_line`) keeps its ends the same way.

Design decision: each attempt of a continued run (`resume=True`) adds its own notes (labelled
`attempt N:`, so the same sentence said by two attempts is two notes), its loss-ledger entries
(up to `ledger.MAX_ENTRIES` each) and a row of the Attempts table. A job restarted often
(preemptible machines, a nightly restart) made index.md grow with the number of restarts, past
its bound (`page_layers.PAGE_BYTES`): 80 attempts of a small model with a few notes each made an
89 KB page. Here each list keeps its first and its last entries within a fixed budget, and one
line in their place counts the others and says where every one is (`.state.json`, which keeps
them all). The cost: a middle attempt's note, loss or counts are one file away, not on the page.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchinstruments.notices import printable
from torchinstruments.rundir.layout import STATE_FILE
from torchinstruments.rundir.ledger import LostRows, sample_range
from torchinstruments.rundir.ranges import ends, was_were
from torchinstruments.rundir.shell import unlinked

__all__ = [
    "NOTES_BYTES",
    "SHOWN_ATTEMPTS",
    "SHOWN_LOSSES",
    "SHOWN_SAMPLER_RUNS",
    "attempt_rows",
    "loss_lines",
    "notes_shown",
]

NOTES_BYTES = 4 * 1024  # the notes at the top of the page, at most (one long note aside)
SHOWN_LOSSES = 8  # loss-ledger entries listed: the first half and the last half
SHOWN_ATTEMPTS = 12  # rows of the Attempts table: the first half and the last half
SHOWN_SAMPLER_RUNS = 6  # runs of attempts of one sampler in the Run section's sampler line


def notes_shown(notes: Sequence[str], last_attempt: int | None) -> tuple[str, ...]:
    """`notes` as the page shows them. The notes of attempts before `last_attempt` (labelled
    `attempt N: `) keep the first ones within half of `NOTES_BYTES` (the first always) and the
    last ones within the other half, with a note counting the others where they were; every
    other note (the configuration's, the last attempt's, a run of one attempt's: None) is shown
    as it is, since each may say what the run could not observe."""
    if last_attempt is None:
        return tuple(notes)
    earlier = [
        i
        for i, note in enumerate(notes)
        if note.startswith("attempt ") and not note.startswith(f"attempt {last_attempt}: ")
    ]
    sizes = [len(notes[i].encode("utf-8")) for i in earlier]
    first, used = 0, 0
    while first < len(earlier) and (first == 0 or used + sizes[first] <= NOTES_BYTES // 2):
        used += sizes[first]
        first += 1
    last, used = len(earlier), 0
    while last > first and used + sizes[last - 1] <= NOTES_BYTES // 2:
        last -= 1
        used += sizes[last]
    if last == first:
        return tuple(notes)
    hidden = last - first
    counted = (
        f"{hidden} more note{'s' if hidden > 1 else ''} of earlier attempts (said between the "
        f"one above and the one below) {'are' if hidden > 1 else 'is'} not shown, so that this "
        f"page stays within its size bound: `{STATE_FILE}` (`notes`) holds every one, in order."
    )
    left_out = set(earlier[first:last])
    shown = [note for i, note in enumerate(notes) if i not in left_out]
    shown.insert(earlier[first], counted)
    return tuple(shown)


def loss_lines(losses: Sequence[LostRows]) -> list[str]:
    """The loss ledger as list items: the first and last entries (`SHOWN_LOSSES` in all), and
    one item between them with the others' rows and samples, so the total stays on the page.
    A reason quotes a write error, which may quote a path raw: `notices.printable`."""
    head, hidden, tail = ends(losses, SHOWN_LOSSES)
    lines = [f"- {unlinked(printable(loss.describe()))}" for loss in head]
    if hidden:
        middle = losses[len(head) : len(losses) - len(tail)]
        rows = sum(loss.rows for loss in middle)
        firsts = [loss.first_sample_id for loss in middle if loss.first_sample_id is not None]
        lasts = [loss.last_sample_id for loss in middle if loss.last_sample_id is not None]
        where = sample_range(min(firsts, default=None), max(lasts, default=None))
        lines.append(
            f"- {rows:,} row{'' if rows == 1 else 's'} of {where} (within) {was_were(rows)} "
            f"recorded but not written, in {hidden} more entries of the ledger not listed here "
            f"(this page's size bound): `{STATE_FILE}` (`losses`) lists each with its reason."
        )
    return [*lines, *(f"- {unlinked(printable(loss.describe()))}" for loss in tail)]


def attempt_rows(rows: Sequence[str], columns: int, spans: Sequence[int] = ()) -> list[str]:
    """The Attempts table's rows (one per entry of the state's attempts, in order), the first
    and last `SHOWN_ATTEMPTS` in all, with one row between them counting the attempts of the
    others (`spans`: how many attempts each row stands for, 1 each where not given: a folded
    entry stands for several, `rundir.attempt_folds`)."""
    head, hidden, tail = ends(rows, SHOWN_ATTEMPTS)
    if not hidden:
        return list(rows)
    if spans:
        hidden = sum(spans[len(head) : len(rows) - len(tail)])
    counted = f"{hidden} more attempts, counted in `{STATE_FILE}` (`attempts`)"
    middle = "| ... | " + " | ".join([counted, *("..." for _ in range(columns - 2))]) + " |"
    return [*head, middle, *tail]
