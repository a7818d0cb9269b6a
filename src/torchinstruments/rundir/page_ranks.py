"""index.md of a parent of rank runs (`rank_policy="all"`): the ranks as one run.

Design decisions:

- Rendered from state, like each rank's page (a rank's counts as its own page gives them:
  exact, or, rebuilt after a kill, "at least N" and "unknown", by `ranges.bound_count`): from the `.state.json` of every `rank-NNN/`
  directory (read with `rundir.recovery.load_state`), never from the data, in constant time per
  rank. The parent has no state file of its own: its state is its ranks' states.
- Who writes it: every rank, at the end of its own finish (`remove_observer` or `finalize` of
  that rank's directory) and at the start of its run where the page is already written (a job
  restarted into the directory: else the page would call a rank that runs again finished until
  it finishes), and `torchinstruments finalize PARENT`, as `rundir.parent_rewrite`
  has it: no rank waits for the others (that would be a collective, and a rank that died would
  hang the rest), and the page written last has seen the state of every rank that finished
  before it; the last rank to finish has a page written that calls every rank finished. A rank not finished (no final counts, or killed in removal,
  whose state holds the counts removal began with) is told by its run lock at that moment, as
  `finalize` tells a live run from a dead one: "in progress" while its process holds the lock,
  else its process ended without closing the run (killed or crashed), never "in progress"
  for a job that ended; the page gives the time it was written. A rank its world size expects
  but that has no directory is listed as missing; ranks whose directories hold different numbers
  of attempts are said to (`sample_id` then is not one job's step on all of them); a finished
  rank's history part a merge left in place, unreadable (`rundir.left_parts`), is named with
  its rank, and its rebuilt counts called partial.
- Its ready queries (printed by `page_rank_queries`) read all ranks at once (every history
  row carries its `rank`; a rank not finished told by its run lock, as the table tells it), including
  the first sample at which one rank departs from the others by more than X, as a plain query:
  a rank departs when its nearest other rank's value is farther than X (for two ranks,
  `|a - b| > X`; a NaN or an infinity is infinitely far from any value but an equal one), or
  when the ranks' rows differ in what they hold (a null against a value, nulls for different
  reasons, no row on a rank that has the sample and selects the layer, from its state file's
  run info as `compare PARENT` reads it (a rank without one is named),
  but a gradient at the open latest sample of a rank in progress, from its state file), the
  rule `torchinstruments compare PARENT` applies. Every query keys a series
  on its mode too, as each rank's own queries do: a train and an eval sample of one tensor are
  never one series; and on its module type, as `compare PARENT` and `show PARENT` do: a layer
  name that is another module on some rank (a pipeline split) is a series of its own there.
- Its setup block reads each rank with the functions of a rank's own page (`page_history`), so
  a live rank, a continued rank's live attempt or one whose removal is merging its parts is
  read as its own page reads it; a rank with no part yet is named as left out, a rank the world
  size expects but no directory holds as missing, and the per-rank query lists both (0 rows
  read while its process lives, or once finished without a row; counts unknown once its process
  ended before a row reached the disk, and without a directory): a live reader is never shown
  fewer ranks than there are, silently, nor 0 samples of a rank killed before its first part.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from torchinstruments.rundir.attempt_ends import attempts_said, last_finished
from torchinstruments.rundir.attempt_starts import first_attempt_apart
from torchinstruments.rundir.attempts import attempt_total
from torchinstruments.rundir.cut_finish import finisher
from torchinstruments.rundir.layout import STATE_FILE
from torchinstruments.rundir.left_parts import left_out_parts, left_out_said
from torchinstruments.rundir.lock import writer_ended
from torchinstruments.rundir.page_rank_queries import parent_blocks, parent_setup
from torchinstruments.rundir.ranges import bound_count, plural, ranges
from torchinstruments.rundir.recovery import load_state
from torchinstruments.rundir.shell import error_said, tool_span
from torchinstruments.rundir.state import RunState, Status, removal_doing

# The table has a row per rank up to this many ranks; above, runs of like ranks share a row.
ROW_PER_RANK_UP_TO = 64
_RANK_DIR = re.compile(r"^rank-(\d+)$")


def rank_dirs(parent: Path) -> list[tuple[int, Path]]:
    """`(rank, directory)` of the parent's `rank-NNN/` subdirectories, in rank order."""
    found = []
    for path in parent.iterdir() if parent.is_dir() else ():
        match = _RANK_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def is_rank_run(directory: Path, state: RunState) -> bool:
    """Whether `directory` is one rank's run of a `rank_policy="all"` run (its parent gets a page)."""
    run = state.run
    return bool(
        _RANK_DIR.match(directory.name) and run.rank is not None and run.rank_policy == "all"
    )


def _read(directory: Path) -> tuple[RunState | None, str | None]:
    try:
        return load_state(directory), None
    except (OSError, ValueError) as error:
        return None, f"state unreadable ({error_said(error)})"


class StateCache:
    """Rank states, read again only where the state file changed (`rundir.parent_rewrite`
    renders once per wave of finishing ranks, and a 3,000-layer model's state file is about
    200 KB of JSON, about 0.1 s to read). A state file is replaced whole (a rename: a new
    inode), so its inode, size and mtime tell a new one; without one, `_read` says why."""

    def __init__(self) -> None:
        self._read: dict[Path, tuple[tuple[int, int, int], RunState | None, str | None]] = {}

    def read(self, directory: Path) -> tuple[RunState | None, str | None]:
        """`directory`'s state, or None and what is wrong with it."""
        try:
            stat = (directory / STATE_FILE).stat()
        except OSError:
            return _read(directory)
        key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        seen = self._read.get(directory)
        if seen is not None and seen[0] == key:
            return seen[1], seen[2]
        state, problem = _read(directory)
        self._read[directory] = (key, state, problem)
        return state, problem


def _rank_lines(parent: Path, cache: StateCache) -> tuple[list[str], list[int]]:
    """The State section's lines, and the ranks present."""
    ranks = rank_dirs(parent)
    rows: list[tuple[int, str, tuple[str, str, str]]] = []  # rank, directory, cells
    finished, recovered, open_ranks = 0, False, 0
    left_out: list[str] = []
    world_sizes: dict[int, list[int]] = {}  # world size -> the ranks whose latest attempt had it
    attempts: dict[int, list[int]] = {}  # attempts in the rank's directory -> those ranks
    read: list[tuple[str, RunState | None]] = []  # each rank's state, labelled by its rank
    for rank, directory in ranks:
        state, problem = cache.read(directory)
        if state is None:
            open_ranks += 1
            rows.append((rank, directory.name, (problem or "no state file", "-", "-")))
            continue
        read.append((str(rank), state))
        if state.run.world_size is not None:
            world_sizes.setdefault(state.run.world_size, []).append(rank)
        attempts.setdefault(max(attempt_total(state.attempts), 1), []).append(rank)
        # final counts once finished: removal writes them into the state as it begins, so a rank
        # being removed (or killed there) has counts but is not finished
        counts = None if state.status is Status.IN_PROGRESS else state.counts
        finished += counts is not None
        recovered = recovered or state.counts_recovered
        parts = left_out_parts(directory) if counts is not None else ()
        if parts:
            said = left_out_said(parts, state.counts_recovered)
            left_out.append(f"**Rank {rank} ({directory.name}/):** {said}.")
        if counts is None:
            open_ranks += 1
        partial = " (partial)" if parts and state.counts_recovered else ""
        rows.append(
            (
                rank,
                directory.name,
                (
                    _state_cell(state, directory, parts),
                    "-" if counts is None else _count(state, counts.samples) + partial,
                    "-" if counts is None else _count(state, counts.root_forwards) + partial,
                ),
            )
        )
    present = [r for r, _ in ranks]
    expected = max(world_sizes) if world_sizes else None
    missing = [r for r in range(expected)] if expected else []
    missing = [r for r in missing if r not in present]
    written = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    head = (
        f"**Ranks: {len(ranks)} rank director{'y' if len(ranks) == 1 else 'ies'}, "
        f"{finished} finished (removed or finalized)"
        + (f", world size {expected}" if len(world_sizes) == 1 else "")
        + ".**"
    )
    lines = [
        head,
        "",
        f"Each rank's state below is as it was when this page was written, at {written}. "
        "This page is rewritten whenever a rank finishes, when a rank's run opens where this "
        "page is already written (a job restarted into this directory, resume=True), and by "
        "finalize: a rank whose rewrite died with the rank writing this page (killed, or its "
        "write given up or failed, which that rank's warning says) may be further on than said "
        "here; its own index.md, and `show` of this directory, tell it as it is now, and "
        "finalize rewrites this page.",
        "",
    ]
    if len(world_sizes) > 1:
        lines += [_world_sizes_line(world_sizes), ""]
    if len(attempts) > 1:
        lines += [attempts_line(attempts), ""]
    apart = first_attempt_apart(read, "sample_id")
    if apart is not None:
        lines += [_starts_line(*apart), ""]
    if missing:
        lines += [
            f"Missing: no directory for rank {ranges(missing)} (it never attached, "
            "or wrote elsewhere): what it saw is unknown.",
            "",
        ]
    if open_ranks:
        lines += [
            "A rank not finished has no final counts. Its state is what its run lock told as "
            "this page was written, as finalize tells it: held, its process is in progress; "
            "free, its process ended without closing the run (killed or crashed) and "
            + tool_span("finalize", parent)
            + " completes it.",
            "",
        ]
    lines += [
        "| rank | directory | state | samples | root forwards |",
        "| --- | --- | --- | --- | --- |",
        *_table_rows(rows),
        "",
    ]
    if len(rows) > ROW_PER_RANK_UP_TO:
        lines += [
            f"Above {ROW_PER_RANK_UP_TO} ranks, consecutive ranks whose state and counts are "
            "the same share a row; each rank's own index.md (and the per-rank query below) "
            "gives its own.",
            "",
        ]
    for line in left_out:
        lines += [line, ""]
    if recovered:
        lines += [
            "at least N, unknown: that rank's counts were rebuilt from its history after it was "
            "interrupted (what reached the disk: lower bounds; unknown where nothing did), as "
            "its own index.md says.",
            "",
        ]
    return lines, present


def _table_rows(rows: list[tuple[int, str, tuple[str, str, str]]]) -> list[str]:
    """The table's rows: one per rank up to `ROW_PER_RANK_UP_TO` ranks; above, one per run of
    consecutive ranks whose cells are the same, so that a job of thousands of ranks reads (and
    stays within index.md's size) as the few states its ranks are in."""
    runs: list[list[tuple[int, str, tuple[str, str, str]]]] = []
    grouped = len(rows) > ROW_PER_RANK_UP_TO
    for row in rows:
        last = runs[-1][-1] if runs else None
        if grouped and last is not None and last[0] + 1 == row[0] and last[2] == row[2]:
            runs[-1].append(row)
        else:
            runs.append([row])
    out = []
    for run in runs:
        (first, name, cells), (last, last_name, _) = run[0], run[-1]
        ranks, where = (
            (str(first), f"`{name}/`")
            if first == last
            else (
                f"{first}-{last}",
                f"`{name}/` to `{last_name}/`",
            )
        )
        out.append(f"| {ranks} | {where} | {' | '.join(cells)} |")
    return out


def _world_sizes_line(world_sizes: dict[int, list[int]]) -> str:
    """What the page says where the ranks' runs give different world sizes: a job continued
    with `resume=True` on another number of ranks (an elastic restart), so a rank directory
    may hold only an earlier job's samples. One world size for all would hide that."""
    sizes = "; ".join(
        f"{size} (rank {ranges(ranks)})" for size, ranks in sorted(world_sizes.items())
    )
    return (
        f"World sizes differ: {sizes}, as each rank's latest attempt ran. The run was "
        "continued (resume=True) by a job of another size, so some ranks' directories end "
        "with an earlier job's samples; each rank's index.md lists its attempts."
    )


def attempts_line(attempts: dict[int, list[int]]) -> str:
    """What the page says where the ranks' directories hold different numbers of attempts: the
    run was continued by jobs of other sizes (grown or shrunk), and as `sample_id` continues in
    each rank's own directory, one id can be another job's step on another rank."""
    said = "; ".join(f"{n} (rank {ranges(ranks)})" for n, ranks in sorted(attempts.items()))
    return (
        f"Attempts differ across ranks: {said}. The run was continued (resume=True) by jobs "
        "of other sizes, so a rank with fewer attempts lacks the samples of the jobs it had no "
        "part in; `sample_id` and `forward_index` continue in each rank's own directory, so "
        "one sample_id (and one `attempt` number) can be another job's on another rank: match "
        "ranks by `step` where the loop gives one, or by each attempt's start, which each "
        "rank's index.md lists."
    )


def _starts_line(at: int, by_attempt: dict[int, list[str]]) -> str:
    """What the page says where the ranks' attempts begin at different samples
    (`attempt_starts`): the queries match ranks on sample_id, which is then another job's step
    on some rank."""
    each = "; ".join(
        f"attempt {a} on rank {ranges(int(r) for r in ranks)}" for a, ranks in by_attempt.items()
    )
    return (
        f"Attempts begin at different samples across ranks: sample_id {at} is {each}. Each "
        "rank's directory continues `sample_id` from the rows it holds when a job is restarted "
        "into it (a rank that sampled less, or whose last rows a kill lost, begins lower), so "
        "from there on one sample_id can be another job's step on another rank, in the queries "
        "below as in `compare`: match ranks by `step` where the loop gives one."
    )


def _state_cell(state: RunState, directory: Path, parts: tuple[Path, ...] = ()) -> str:
    """A rank's state as its own index.md's state line gives it, with its marked samples and
    parts left out: a rank with partial samples never reads as plainly complete here. A rank
    not finished is told by its run lock, as `finalize` tells it (`lock.writer_ended`). A rank
    restarted into its directory says how each attempt ended, as `show` does (`attempts_said`):
    its state alone names only how the earlier ones did. A rank of one attempt finished without
    remove_observer (its step raised, and the run was finished at its process's exit) says so,
    as its own index.md's note does: "complete" alone read as a job that ran to its end."""
    attempts = attempts_said(state, directory)
    attempts = f"; attempts: {attempts}" if attempts else ""
    if state.status is Status.IN_PROGRESS:  # its finish, cut, is said as such: never finished
        return _open_cell(writer_ended(directory), state) + attempts
    if len(state.attempts) == 1 and last_finished(state) != "removed":
        attempts = f"; {last_finished(state)}"
    cell = state.status.value + attempts
    if parts:
        cell += f", {plural(len(parts), 'part')} left out (see below)"
    if state.removed_in_flight:
        cell += f", removed while a sample was in flight (sample {ranges(state.removed_in_flight)})"
    if state.marks_total:
        cell += f"; {state.marks_total} marked sample{'s' * (state.marks_total > 1)}"
    return cell


# An unfinished rank whose process held its run lock as the page was written. Said in the past:
# the page is rewritten when a rank finishes, never when one is killed, so after the last
# rewrite a rank SIGKILLed would read "in progress" for good (`show` of the parent tells it now).
IN_PROGRESS_CELL = (
    "in progress when this page was written (its process held its lock; a kill since is not "
    "said here)"
)


def _open_cell(ended: bool | None, state: RunState) -> str:
    """An unfinished rank's state: whether a process held its run lock as the page was written,
    and, for one that ended in a finish (`removal_step`), who was finishing it
    (`cut_finish.finisher`: remove_observer, or the finish at its exit without it) and where."""
    if ended is False:  # as of the page's time only: a rank killed later cannot rewrite it
        return IN_PROGRESS_CELL
    if ended and state.removal_step is not None:
        return (
            f"not finished: its process ended during {finisher(state)}, while "
            f"{removal_doing(state.removal_step)} (killed or crashed)"
        )
    if ended:
        return "not finished: its process ended without closing the run (killed or crashed)"
    return "in progress, or its process died (its lock cannot be read here)"


def _count(state: RunState, count: int) -> str:
    """A count as the rank's own index.md gives it: exact, or rebuilt (`bound_count`)."""
    return bound_count(count) if state.counts_recovered else str(count)


def render_parent_index(parent: Path, cache: StateCache | None = None) -> str:
    """The text of the parent's index.md, from its ranks' states (read through `cache`)."""
    parent = Path(parent)
    cache = StateCache() if cache is None else cache
    state_lines, present = _rank_lines(parent, cache)
    layer = ""
    for _, directory in rank_dirs(parent)[:1]:
        state, _ = cache.read(directory)
        if state is not None and state.run.layers:
            layer = state.run.layers[0].name
    root = parent.as_posix()
    lines = [
        "# TorchInstruments multi-rank run",
        "",
        *state_lines,
        "Each rank wrote its own run into `rank-NNN/` (rank_policy='all'): its history, "
        "result.json, index.md and tensorboard/, complete on its own; every history row "
        "carries its `rank`. Its `population` column says which tensor a row describes: null for "
        "this rank's own tensor (a DTensor's local shard), `global:ranks=0,1,...` for the whole "
        "tensor over those ranks (inject_observer's `global_statistics=`: exact, the same rows on "
        "every rank of the group that ran the tensor; one that only some ranks ran in a sample "
        "is null there, with the reason). A series has one population for the whole run; filter on "
        "`population` before comparing ranks, and never average rows of the two kinds.",
        "",
        "## Reading the ranks together",
        "",
        "- " + tool_span("show", parent) + ": per series, the spread "
        "across ranks of each rank's latest value and recent-window mean (min, max, the rank "
        "farthest from the cross-rank median and by how much).",
        "- " + tool_span("compare", parent) + " --tolerance X: per "
        "series, the first sample where one rank departs from the others by more than X.",
        "- " + tool_span("heatmap", parent) + " --layers REGEX: per "
        "metric, a rank x sample image of one tensor; "
        + tool_span("plot", parent)
        + ": its trends, one line per rank.",
        "- `--rank N` reads rank N alone (as its own directory); `--rank 0,3` or `0-7` a few.",
        "",
        "## Ready Polars queries over all ranks",
        "",
        "Run the setup block first, then any other block in the same Python session.",
        "",
        "```python",
        parent_setup(root),
        "```",
        "",
    ]
    for title, code in parent_blocks(layer):
        lines += [title, "", "```python", code, "```", ""]
    if not present:
        lines.append("(no rank directory yet)")
    return "\n".join(lines)


__all__ = [
    "StateCache",
    "attempts_line",
    "is_rank_run",
    "rank_dirs",
    "render_parent_index",
]
