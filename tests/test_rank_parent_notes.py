"""Every reader of a parent says the ranks' notes, as `show` of one rank does: each note once
with the ranks whose index.md holds it, its beginning, and at most `NOTES_SHOWN` of them (in
the text of `show PARENT` and `compare PARENT`, on stderr beside `plot PARENT` and `heatmap
PARENT`'s pictures; real observers, the launcher's RANK and WORLD_SIZE; notes added as a trainer
callback adds them). So does every reader of one run (one rank's directory): `compare DIR_A
DIR_B` in its text under each run's tag, `plot DIR` and `heatmap DIR` on stderr."""

from __future__ import annotations

import gc
from pathlib import Path

from test_rank_parent_readers import observe_rank

from torchinstruments import remove_observer
from torchinstruments.cli.text import NOTE_CHARS, NOTES_SHOWN
from torchinstruments.registry import add_run_note
from torchinstruments.rundir.index_page import page_notes
from torchinstruments.rundir.recovery import load_state

from conftest import cli_in_process

SHARED = "the fit raised RuntimeError: CUDA out of memory (every rank)"
LONG = "rank 2 alone: " + "a long note " * 30


def noted(parent: Path, rank: int, *notes: str) -> None:
    model = observe_rank(parent, rank, world_size=3, remove=False)
    for note in notes:
        assert add_run_note(model, note)
    remove_observer(model)


def test_every_reader_says_the_notes_of_a_parents_ranks_once_per_note_and_of_one_run_as_show(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stats"
    noted(parent, 0, SHARED)
    noted(parent, 1, SHARED)
    noted(parent, 2, SHARED, LONG, *(f"extra note {i}" for i in range(NOTES_SHOWN)))
    state = load_state(parent / "rank-001")
    assert state is not None
    assert SHARED in page_notes(state)
    said = [
        f"notes: {NOTES_SHOWN + 2} notes on rank 0-2, in full at the top of each rank's index.md:",
        f"- rank 0-2: {SHARED}",
        f"- rank 2: {LONG[: NOTE_CHARS - 3].rstrip()}...",
        *(f"- rank 2: extra note {i}" for i in range(NOTES_SHOWN - 2)),
        "- ... (2 more, on rank 2)",
    ]
    for command in ("show", "compare"):
        done = cli_in_process(command, parent, "--width", "1000")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        start = lines.index(said[0])
        assert lines[start : start + NOTES_SHOWN + 2] == said
    pictures = (
        ("plot", "--output", tmp_path / "trends.png"),
        ("heatmap", "--output-dir", tmp_path),
    )
    for command, option, output in pictures:
        done = cli_in_process(command, parent, "--metrics", "mean", option, output)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("wrote ")  # stdout names the pictures only
        lines = done.stderr.splitlines()
        prefix = f"torchinstruments {command}: "
        start = lines.index(prefix + said[0])
        assert lines[start : start + NOTES_SHOWN + 2] == [prefix + line for line in said]
    one = parent / "rank-002"
    own = [
        f"notes: {NOTES_SHOWN + 2}, in full at the top of index.md:",
        f"- {SHARED}",
        f"- {LONG[: NOTE_CHARS - 3].rstrip()}...",
        *(f"- extra note {i}" for i in range(NOTES_SHOWN - 2)),
        "- ... (2 more)",
    ]
    shown = cli_in_process("show", one, "--width", "1000").stdout.splitlines()
    assert shown[shown.index(own[0]) :][: len(own)] == own
    for command, option, output in pictures:
        done = cli_in_process(command, one, "--metrics", "mean", option, output)
        assert done.returncode == 0, done.stderr
        prefix = f"torchinstruments {command}: "
        lines = done.stderr.splitlines()
        assert lines[lines.index(prefix + own[0]) :][: len(own)] == [prefix + x for x in own]
    done = cli_in_process("compare", parent / "rank-001", one, "--width", "1000")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[lines.index("A notes: 1, in full at the top of index.md:") + 1] == f"- {SHARED}"
    assert lines[lines.index("B " + own[0]) :][: len(own)] == ["B " + own[0], *own[1:]]


def test_the_parents_page_says_a_rank_finished_without_remove_observer(tmp_path: Path) -> None:
    """A rank whose run was finished without remove_observer (its step raised and the run was
    finished at its exit, or here its model was collected) is complete, as its own index.md
    says, and the parent's page says how it was finished: "complete" alone read as a rank
    that ran to its end, with nothing on the page to tell it from one."""
    parent = tmp_path / "stats"
    observe_rank(parent, 0)
    model = observe_rank(parent, 1, remove=False)
    del model
    gc.collect()  # the finalizer finishes rank 1's run, with its note
    assert "the run was finished when the observed model was" in (
        parent / "rank-001" / "index.md"
    ).read_text(encoding="utf-8")
    page = (parent / "index.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith(("| 0 ", "| 1 "))]
    assert rows == [
        "| 0 | `rank-000/` | complete | 3 | 3 |",
        "| 1 | `rank-001/` | complete; finished without remove_observer (see its note) | 3 | 3 |",
    ]
