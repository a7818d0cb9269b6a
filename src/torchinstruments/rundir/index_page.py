"""index.md: what a run directory holds and how to read it, for a person and for an LLM.

Design decision: the page is rendered from a `RunState` (`rundir.state`) only, never from the
data, so it can be written at injection, before any sample exists, and rewritten at removal and
at `finalize` in constant time. It is never read back: the state file is the machine-readable
record, and this page is written right after it, from the same object. This module holds the
sections that depend on how far the run got (state, gaps, run) and assembles the page; why a
run holds no sample is said in `rundir.unsampled`'s words (shared with removal's warning), the
lists of layers, bounded whatever the model size, are in `rundir.page_layers`, the sections
that follow from `RunInfo` alone in `rundir.page_sections`, and the ready Polars queries in
`rundir.page_queries`. The cost: the page must be kept in step with the schema and
the summary by hand; the tests execute every query in it against a real history.parquet.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torchinstruments import reasons
from torchinstruments.notices import printable
from torchinstruments.records import RunCounts
from torchinstruments.rundir.attempt_ends import (
    attempt_end,
    killed_before_last,
    killed_flush,
    last_finished,
    unremoved_said,
)
from torchinstruments.rundir.attempts import (
    TWO_SCHEDULES,
    AttemptCounts,
    attempt_total,
    sampler_line,
)
from torchinstruments.rundir.cut_finish import finisher
from torchinstruments.rundir.gradient_counts import gradient_count, gradient_zero_known
from torchinstruments.rundir.layout import (
    INDEX_FILE,
    LOCK_FILE,
    STATE_FILE,
    TENSORBOARD_DIR,
    write_text_atomic,
)
from torchinstruments.rundir.page_bounds import attempt_rows, loss_lines, notes_shown
from torchinstruments.rundir.page_layers import (
    NEVER_RAN_CHARS,
    PAGE_BYTES,
    focus_line,
    layers_line,
    section_layers,
)
from torchinstruments.rundir.page_loss_scale import loss_scale_query, section_loss_scale
from torchinstruments.rundir.page_queries import section_queries
from torchinstruments.rundir.page_sections import (
    section_files,
    section_meanings,
    section_result,
    section_schema,
)
from torchinstruments.rundir.ranges import bound_count, ends_said, few_ranges, plural, ranges
from torchinstruments.rundir.recovery import recovered_layers
from torchinstruments.rundir.shell import literal_span, unlinked
from torchinstruments.rundir.state import RunState, Status, removal_doing
from torchinstruments.rundir.unsampled import passed_through, unsampled_sentence

# What "samples with output gradients" counts: narrower than "samples a backward ran over".
GRADIENT_COUNT_MEANING = (
    "samples with output gradients: samples whose backward reached the output of at least one "
    "selected layer (they have output_gradient rows). A backward that ran but reached no "
    "selected layer's output is not counted: layers run under torch.no_grad() inside the "
    "forward (reentrant torch.utils.checkpoint, use_reentrant=True, around them), a backward "
    "that raised before reaching one, or torch.autograd.grad whose inputs= were computed after "
    "their outputs (the gradient stops before it reaches them)"
)


def counts_sentence(state: RunState) -> str:
    """The page's counts line (also printed by `torchinstruments show`), without the "- "."""
    counts = state.counts
    if counts is None:
        return (
            "counts: the run is in progress (history.parquet and the summaries in "
            "result.json appear at removal; read history.parts/ meanwhile)"
        )
    killed = [a.attempt for a in state.attempts[:-1] if a.counts_recovered]
    if state.counts_recovered and killed and not state.attempts[-1].counts_recovered:
        return (
            f"counts (lower bounds: in this run, {unremoved_said(state)}, and their counts were "
            "rebuilt from what reached the disk): "
            f"{bound_count(counts.root_forwards, 'root forward')}, "
            f"{bound_count(counts.samples, 'sample')}, "
            f"{gradient_count(counts.backward_samples, gradient_zero_known_of(state))} with "
            "output gradients"
        )
    if state.counts_recovered:
        return (
            "counts (rebuilt from history after an interrupted run: what reached the disk, "
            "so lower bounds; unknown where nothing did): "
            f"{bound_count(counts.root_forwards, 'root forward')}, "
            f"{bound_count(counts.samples, 'sample')}, "
            f"{gradient_count(counts.backward_samples, gradient_zero_known_of(state))} with "
            "output gradients" + _schedules_unknown(state)
        )
    passed = passed_through(counts)
    return (
        f"counts: {plural(counts.root_forwards, 'root forward')}, "
        f"{plural(counts.samples, 'sample')}, "
        f"{plural(counts.backward_samples, 'sample')} with output gradients"
        + ("" if passed is None else f"; {passed}")
    )


def gradient_zero_known_of(state: RunState) -> bool:
    """Whether the rebuilt counts of `state` know their 0 samples with output gradients (the
    counts line's rule, which `finalize`'s summary follows)."""
    if state.counts is None:
        return False
    killed = [a.attempt for a in state.attempts[:-1] if a.counts_recovered]
    if state.counts_recovered and killed and not state.attempts[-1].counts_recovered:
        return _killed_zero_known(state)  # the counts line's first case: the last's are exact
    return _zero_known(state.counts)


def _zero_known(counts: RunCounts | AttemptCounts) -> bool:
    """Whether rebuilt counts (the run's, or a killed attempt's) know their 0 samples with
    output gradients: every sample they count ran with grad disabled (`rundir.gradient_counts`)."""
    return gradient_zero_known(counts.backward_samples, counts.samples, counts.no_grad_samples)


def _killed_zero_known(state: RunState) -> bool:
    """The same for a continued run whose earlier attempts were killed and whose last was
    finished: the finished attempts' counts are exact, so the run's 0 is known when each
    killed attempt's is."""
    recovered = [a for a in state.attempts if a.counts_recovered]
    return bool(recovered) and all(_zero_known(a) for a in recovered)


def _schedules_unknown(state: RunState) -> str:
    """What the counts line adds for a killed run that kept training and evaluation forwards
    apart (a trainer callback's record_eval): the process died before it wrote how many of
    each, which history cannot tell (an unsampled forward leaves no row), so they are unknown,
    never left unsaid; the notes keep the evaluation forwards seen by its last save."""
    counts = state.counts
    if counts is None or counts.eval_forwards is not None or TWO_SCHEDULES not in state.run.sampler:
        return ""
    return "; training and evaluation forwards (record_eval, counted apart): unknown"


def _lost_bound(flush: str) -> str:
    """What a process that ended without removal may have lost, with its flush interval `flush`."""
    return (
        "Rows recorded after the last part that reached the disk may be missing: those of the "
        f"last {flush} when the process was killed or crashed while parts could be written (a "
        "SIGTERM writes them first), every later row when part writes were failing (a full "
        "disk) until it ended; the loss ledger lists what the run counted."
    )


# A live run's State line holds while its process lives; a killed process leaves it as it was,
# so the line says how a reader tells (the run lock, as show, compare and a parent's page do).
_WHILE_LIVE = (
    f"As this page was written, its process held the run's lock (`{LOCK_FILE}`); a process "
    "that ended without remove_observer (killed, crashed) leaves this line as it was: "
    "`torchinstruments show` and the status query below tell from the lock whether it still "
    "runs, and `torchinstruments finalize` completes a run whose process ended."
)


def _being_finished(state: RunState) -> str:
    """The State line of a page written as the run's finish began (its last flush's save):
    who was finishing it (`cut_finish.finisher`: remove_observer, or the finish at the
    process's exit without it) and what it was doing, so a kill there never leaves a page
    saying only "in progress", nor naming remove_observer where it never ran."""
    doing = removal_doing(state.removal_step or "")
    return (
        f"**State: in progress.** Being finished: as this page was written, {finisher(state)} "
        f"was {doing}, and its process held the run's lock (`{LOCK_FILE}`); a process killed "
        "in that finish leaves this line as it was: `torchinstruments show` and the status "
        "query below tell from the lock whether it still runs, and `torchinstruments finalize` "
        "completes a run whose process ended."
    )


def _section_state(state: RunState) -> list[str]:
    """The visible state: in progress, complete, interrupted, incomplete (and why).

    "complete" is said only when history.parquet holds every row the run recorded (and nothing
    else is missing); after a crash the number of rows the run held in memory is unknown, so a
    finalized crashed run is "interrupted", with the bound on what it may have lost.
    """
    status = state.status
    if status is Status.IN_PROGRESS and state.removal_step is not None:
        lost = [*loss_lines(state.losses), ""] if state.losses else []
        return [_being_finished(state), "", *lost]
    if status is Status.IN_PROGRESS:
        if not state.losses:
            return [f"**State: in progress.** {_WHILE_LIVE}", ""]
        lines = [f"**State: in progress**, with rows lost so far (the loss ledger). {_WHILE_LIVE}"]
        return [*lines, "", *loss_lines(state.losses), ""]
    lost_bound = _lost_bound(killed_flush(state))
    said = _in_flight(state)
    in_flight = None if said is None else f"{said} (see the note below)"
    if status is Status.INCOMPLETE:
        lines = ["**State: INCOMPLETE.** What is missing and why:", ""]
        lines += [f"- {unlinked(printable(problem))}" for problem in state.problems]
        lines += loss_lines(state.losses)
        if state.interrupted:
            lines.append(f"- {unremoved_said(state)}. {lost_bound}")
        if in_flight:
            lines.append(f"- {in_flight}")
        return [*lines, ""]
    also = "" if in_flight is None else f" Also, {in_flight}."
    if status is Status.INTERRUPTED and killed_before_last(state):
        usual = " as usual" if in_flight is None and last_finished(state) == "removed" else ""
        said = unremoved_said(state, " (killed, crashed or preempted)")
        return [
            f"**State: interrupted** in an earlier attempt: {said} and were finalized when the "
            "run was continued; every row they had written is in history.parquet, and the last "
            f"attempt was {last_finished(state)}{usual}. {lost_bound} Counts are lower "
            f"bounds.{also}",
            "",
        ]
    if status is Status.INTERRUPTED:
        said = unremoved_said(state, " (killed, crashed or preempted)")
        return [
            f"**State: interrupted.** {said[0].upper()}{said[1:]}; `finalize` merged every row it had written into history.parquet. "
            f"{lost_bound} Counts are lower bounds.{also}",
            "",
        ]
    recorded = "" if state.rows_recorded is None else f" ({plural(state.rows_recorded, 'row')})"
    if state.removed_in_flight:
        return [
            "**State: complete, removed while a sample was in flight.** history.parquet holds "
            f"every row the run recorded{recorded}, but remove_observer was called during a "
            f"sampled forward or backward: {partial_in_flight(state.removed_in_flight)} and marked "
            "`interrupted` (see the note below and Interrupted samples).",
            "",
        ]
    return [
        f"**State: complete.** history.parquet holds every row the run recorded{recorded}.",
        "",
    ]


def partial_in_flight(sample_ids: tuple[int, ...]) -> str:
    """`sample 3 is partial`, `samples 3-4 are partial`: the samples in flight at a removal
    (index.md's state line, and `show`'s)."""
    several = len(sample_ids) > 1
    return f"sample{'s' * several} {few_ranges(sample_ids)} {'are' if several else 'is'} partial"


def _in_flight(state: RunState) -> str | None:
    """The samples in flight at the last removal, as the state line and `show` say them."""
    if not state.removed_in_flight:
        return None
    partial = partial_in_flight(state.removed_in_flight)
    return f"{reasons.REMOVED_IN_FLIGHT}: {partial}"


def interrupted_sentence(state: RunState) -> str:
    """`show`'s state of an interrupted run, in the words of index.md's state line: which
    attempts ended without remove_observer, and a sample in flight at the last removal."""
    in_flight = _in_flight(state)
    also = "" if in_flight is None else f"; {in_flight}"
    if killed_before_last(state):
        return (
            f"interrupted in an earlier attempt ({unremoved_said(state)} and were finalized when the run was continued: rows of their last "
            f"flush interval may be missing; the last attempt was {last_finished(state)}{also}; see index.md)"
        )
    return (
        f"interrupted (finalized after {unremoved_said(state)}: rows of its last flush "
        f"interval may be missing{also}; see index.md)"
    )


def _dtype_note(state: RunState) -> list[str]:
    """The layers whose tensors had more than one dtype (`rundir.dtype_spans`), if any."""
    total = state.dtype_changes_total
    if not total:
        return []
    listed = len(state.dtype_changes)
    more = "" if listed == total else f"; ... ({total - listed} more)"
    return [
        f"dtype changed during the run: {plural(total, 'layer')} recorded "
        "tensors of more than one dtype (a model cast mid-run, e.g. `model.half()`, or "
        "autocast on some samples only). Each row's `dtype` says its own; result.json's "
        "`dtype` is a tensor's latest and its `dtypes` lists each with its first and last "
        "sample_id; a window mean may average samples of different dtypes. Each layer's dtypes "
        f"and their samples: {'; '.join(state.dtype_changes)}{more}"
    ]


def page_notes(state: RunState) -> tuple[str, ...]:
    """The notes at the top of the page (each a "**Note:**"), which `show` counts and begins:
    the configuration's, those the run said after injection, a dtype that changed."""
    return (*state.run.notes, *state.notes, *_dtype_note(state))


def _section_gaps(state: RunState) -> list[str]:
    """What the run does not hold although layers were selected: said before anything else."""
    run, counts = state.run, state.counts
    last = state.attempts[-1].attempt if len(state.attempts) > 1 else None
    lines = [
        f"**Note:** {unlinked(printable(note))}" for note in notes_shown(page_notes(state), last)
    ]
    lines += [f"**Disk space:** {unlinked(printable(line))}" for line in state.left_behind]
    if state.run_info_recovered:
        lines.append(
            f"**Note:** the run's {STATE_FILE} was missing or unreadable: the layers were "
            f"{recovered_layers(run)}, and settings this page cannot know are `unknown`."
        )
    if counts is not None and run.layers and counts.samples == 0 and state.counts_recovered:
        lines.append(
            "**No row reached the disk:** the process ended before any part was written, so "
            "history.parquet has no rows and result.json no measurements. Whether the model was "
            "called, and how many samples were taken, is unknown (the live run's counts died "
            "with it)."
        )
    elif counts is not None and run.layers and counts.samples == 0:
        lines.append(
            f"**No sample was recorded:** {unlinked(unsampled_sentence(counts, page_notes(state)))}, so "
            "history.parquet has no rows and result.json no measurements."
        )
    return [line for pair in zip(lines, [""] * len(lines), strict=True) for line in pair]


def _events_line(state: RunState) -> list[str]:
    """After a kill: the samples TensorBoard holds whose history rows were lost, and those
    only the run's id mark knows (`rundir.mark_counts`)."""
    total = state.events_without_rows_total
    if not total:
        return _mark_line(state)
    shown = ranges(list(state.events_without_rows))
    listed = len(state.events_without_rows)
    more = "" if total == listed else f" (the first {listed} of {total})"
    return [
        f"**Lost in the kill:** {TENSORBOARD_DIR}/ holds histograms of {total} sampled "
        f"forward(s) that have no row in history.parquet: forward_index {shown}{more}. Their "
        "rows were still in memory when the process died; the counts of root forwards and "
        "samples include them, those read from rows only (samples with output gradients, each "
        "layer's sampled forwards) do not.",
        "",
        *_mark_line(state),
    ]


def _mark_line(state: RunState) -> list[str]:
    """After a kill: the samples begun of which nothing reached the disk, which the counts
    include from the run's id mark in `.lock`."""
    if not state.mark_samples or not state.attempts:
        return []
    last = state.attempts[-1].first_sample_id + state.attempts[-1].samples - 1
    return [
        f"**Begun, nothing on disk:** the run's id mark ({LOCK_FILE}) shows "
        f"{plural(state.mark_samples, 'sample')} begun (up to sample_id {last}) of which no "
        "row and no TensorBoard event reached the disk: the process died first. The counts of "
        "root forwards and samples include them, those read from rows only (samples with "
        "output gradients, each layer's sampled forwards) do not.",
        "",
    ]


def _section_attempts(state: RunState) -> list[str]:
    """One line per attempt of a continued run (`resume=True`): a process of a restarted job,
    or a fit resumed in the same process (a trainer and callback built anew)."""
    if len(state.attempts) < 2:
        return []
    lines = [
        "## Attempts",
        "",
        f"This run was written in {attempt_total(state.attempts)} attempts: the first started it, each "
        "later one continued it: `inject_observer(..., resume=True)` (a restarted job), or a "
        "trainer callback's fit resumed from a checkpoint, which passes it for the user (in a "
        "new process or the same one), or the Hugging Face Trainer's retry of its training "
        "loop inside one train() call (auto_find_batch_size, after running out of memory); "
        f"each attempt's `continued_by` in {STATE_FILE} says which. "
        "Each row's `attempt` column says which; sample_id and forward_index continue across "
        "them, and result.json summarizes the whole run. A killed attempt's counts are read "
        f"from its rows, its {TENSORBOARD_DIR}/ events and the run's id mark in {LOCK_FILE} "
        "(lower bounds, unknown where it left none). tensorboard/ here holds "
        "every attempt's histograms on steps of their own (forward_index continues), so none "
        "hides another's; a trainer's logger that writes where an earlier attempt's did gets "
        "steps again (a note says which).",
        "",
        "| attempt | started at | ended | first sample_id | first forward_index | root forwards "
        "| samples | samples with output gradients |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    split = any(a.eval_forwards for a in state.attempts)
    if split:
        lines[-2] = lines[-2][:-1] + "| training forwards | evaluation forwards |"
        lines[-1] += " --- | --- |"
        lines[2] += (
            " Under a trainer callback's `record_eval`, training forwards (on the training "
            "sampler's schedule) and evaluation forwards (on their own) are counted apart; an "
            "attempt killed before its removal never wrote them: unknown."
        )
    skips = [
        f"{a.first_sample_id + a.samples}-{b.first_sample_id - 1}"
        for a, b in zip(state.attempts, state.attempts[1:], strict=False)
        if a.counts_recovered and b.first_sample_id > a.first_sample_id + a.samples
    ]
    if skips:
        lines[2] += (
            f" Between attempts sample_id may skip ({ends_said(skips)} at most): after a killed "
            "attempt the next one starts after every sample it left anywhere (rows, "
            f"{TENSORBOARD_DIR}/ events, the loss ledger) and after every sample it began (the "
            f"id mark in {LOCK_FILE}), so the ids of samples whose rows died with it are never "
            "used twice."
        )
    if any(not a.samples for a in state.attempts):
        lines[2] += (
            " A `-`: the attempt has no sample (first sample_id) or no root forward (first "
            "forward_index); of a killed attempt, none that its rows or events show."
        )
    lines[2] += _restart_sample_sentence(state)
    rows: list[str] = []
    for a in state.attempts:

        def count(n: int, a: AttemptCounts = a) -> str:
            return bound_count(n) if a.counts_recovered else str(n)

        backward = str(a.backward_samples)
        if a.counts_recovered:  # 0 is known where each of its samples ran with grad disabled
            backward = gradient_count(a.backward_samples, _zero_known(a), word=False)
        rows.append(
            f"| {_numbers_said(a)} | {a.started_at} | {attempt_end(state, a)} | "
            f"{a.first_sample_id if a.samples else '-'} | "
            f"{a.first_forward_index if a.root_forwards or a.samples else '-'} | "
            f"{count(a.root_forwards)} | {count(a.samples)} | "
            f"{backward} |" + (_schedule_cells(a) if split else "")
        )
    spans = [len(a.numbers) for a in state.attempts]
    return [*lines, *attempt_rows(rows, 10 if split else 8, spans), ""]


def _numbers_said(entry: AttemptCounts) -> str:
    """An Attempts table row's attempt: `3`, or `3-9 (folded: counts summed)` for a run of
    attempts that ended alike, which the state keeps as one entry (`rundir.attempt_folds`)."""
    first, last = entry.numbers[0], entry.numbers[-1]
    return str(first) if first == last else f"{first}-{last} (folded: counts summed)"


def _restart_sample_sentence(state: RunState) -> str:
    """Where an attempt ran a TimeIntervalSampler: that it samples each attempt's first root
    forward, which its description (compared as text across runs, so left as it is) says of one
    process only; "" otherwise."""
    said = [a.sampler or "" for a in state.attempts]
    said[-1] = said[-1] or state.run.sampler  # a state from before they were kept: the last's
    if not any("TimeIntervalSampler(" in s for s in said):  # record_eval's line names two
        return ""
    return (
        " TimeIntervalSampler (the default) starts anew in each attempt: it samples the "
        "attempt's first root forward too, then the first one once its interval has passed "
        "since that attempt's last sample, so a restart adds a sample at its start however soon "
        "after the earlier attempt's last one (one instance passed again to an attempt in the "
        "same process keeps its own clock instead)."
    )


def _schedule_cells(a: AttemptCounts) -> str:
    """An attempt's training and evaluation forwards, `unknown` where its process died before
    removal (its counters died with it: no row says how many forwards went unsampled)."""
    train, evaluation = (
        "unknown" if n is None else str(n) for n in (a.train_forwards, a.eval_forwards)
    )
    return f" {train} | {evaluation} |"


def _section_run(state: RunState, too_long: bool = False) -> list[str]:
    run = state.run
    rank = "not distributed" if run.rank is None else f"rank {run.rank} of {run.world_size}"
    history, cap = run.history, run.history.max_buffered_rows
    lines = [
        "## Run",
        "",
        f"- output_dir: {literal_span(Path(run.output_dir).as_posix())}; "
        f"started at {run.started_at}",
        f"- torchinstruments {run.library_version}, torch {run.torch_version}",
        f"- model class: {literal_span(run.model_class)}",
        f"- {layers_line(run, too_long)}",
        f"- {focus_line(run)}",
        f"- {unlinked(sampler_line(run.sampler, state.attempts))}",  # a user's describe()
        f"- metrics: {', '.join(run.metrics)}",
        f"- {rank}; rank_policy={run.rank_policy!r}",
        f"- capture_direct_forwards={run.capture_direct_forwards}, "
        f"buffer_rows={history.buffer_rows}, flush_seconds={history.flush_seconds}, "
        f"window={history.window}" + ("" if cap is None else f", max_buffered_rows={cap}"),
    ]
    lines.append(f"- {counts_sentence(state)}")
    if state.counts is not None:
        lines.append(f"- {GRADIENT_COUNT_MEANING}")
    return [*lines, ""]


def _section_marks(state: RunState) -> list[str]:
    """The marked samples: root forwards that raised, samples only partly written."""
    if not state.marks_total:
        return []
    shown = len({mark.sample_id for mark in state.marks})
    more = "" if shown == state.marks_total else f" (the marks of the first {shown} are listed)"
    lines = [
        "## Interrupted samples",
        "",
        f"{state.marks_total} sample(s) are marked{more}: a history row with metric "
        "`interrupted` (value null) whose reason says why. Their other rows are real "
        "measurements of the layers that returned before the exception or the removal (or of the "
        "rows that reached the disk), so the sample is partial: compare it with care. List them with "
        '`history.filter(pl.col("metric") == "interrupted")`.',
        "",
    ]
    # A reason quotes the user's exception and the layer (`'<root>'`, a tag outside code).
    lines += [f"- sample {m.sample_id}: {literal_span(m.reason)}" for m in state.marks]
    return [*lines, ""]


def render_index(state: RunState) -> str:
    """The text of index.md for `state`, at most `PAGE_BYTES` for any catalog: where the
    page would be longer, the list of layers that never ran names fewer of them (the others
    counted), and where that is not enough (up to LISTED_LAYERS layers with long names), the
    layers are grouped by module type as beyond LISTED_LAYERS (every layer by name stays in
    `.state.json`).

    Args:
        state: the run's state (what it is, how far it got, what is missing).

    Returns:
        Markdown; it holds no machine-readable block (that is the state file).
    """
    for too_long in (False, True):  # then every name too long for the page: grouped by type
        page = _page(state, NEVER_RAN_CHARS, too_long)
        excess = len(page.encode("utf-8")) - PAGE_BYTES
        if excess > 0:  # the list of layers that never ran gives up what the rest took beyond
            page = _page(state, max(0, NEVER_RAN_CHARS - excess - _MARGIN), too_long)
        if len(page.encode("utf-8")) <= PAGE_BYTES:
            break
    return page


# Characters the list of layers that never ran gives up beyond the page's excess: its runs are
# cut whole, and the count of the ones left out takes a few characters more.
_MARGIN = 256


def _page(state: RunState, never_ran_chars: int, too_long: bool = False) -> str:
    """`render_index`'s text with the list of layers that never ran cut at `never_ran_chars`,
    and the layers grouped by module type where `too_long` (`page_layers.grouped`)."""
    run = state.run
    lines = [
        "# TorchInstruments run",
        "",
        *_section_state(state),
        *_section_gaps(state),
        *_events_line(state),
        *_section_marks(state),
        *section_loss_scale(state),
        "Descriptive statistics of the outputs of selected PyTorch modules, and of the "
        "gradients flowing into those outputs, for sampled root forwards (calls of the observed "
        "model). No scores or verdicts: only measurements.",
        "",
        *_section_run(state, too_long),
        *_section_attempts(state),
        *section_layers(state, never_ran_chars, too_long),
        *section_files(run),
        *section_schema(),
        *section_meanings(),
        *section_result(run),
        *section_queries(run),
        *loss_scale_query(run),
    ]
    return "\n".join(lines)


def write_index(
    directory: Path,
    state: RunState,
    rename: Callable[[Path, Path], None] = os.replace,
    tag: str = "",
) -> None:
    """Write `directory/index.md`, rendered from `state`, atomically (`replace_atomically`, with
    its `rename` and temporary-name `tag`)."""
    write_text_atomic(directory / INDEX_FILE, render_index(state), rename, tag)


__all__ = [
    "counts_sentence",
    "gradient_zero_known_of",
    "interrupted_sentence",
    "page_notes",
    "partial_in_flight",
    "render_index",
    "write_index",
]
