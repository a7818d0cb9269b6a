"""Layer names, tensor paths and module types that hold a line break, a tab, a carriage return,
an escape, a `|` or a leading quote, in every output format of `show` and `compare`.

Why: modules can be named anything (`add_module("a\\nb", ...)`), a tensor path holds a dict key,
a class any name. csv and json must give the exact texts back to a script; the text view and
markdown must keep each tensor on one row and write such a name so that it reads as one name
only: index.md's rule (`rundir.shell.literal_if_unclear`), its Python string literal where it
holds a character that is not printable or begins with a quote, so that a name holding a line
break (`'a\\nb'`) never reads as one holding a backslash and an `n` (`a\\nb`). The same rule
writes the other texts the commands print from the model or the run's files: the model's class
name, the run's directory (in the header, an error, a state line on stderr, finalize's lines),
the sampler's description (show's sampler line, compare's "sampled differently" warning), each
note's beginning and a module type in a rank picture's label, so that an escape (`\\x1b[2J`
clears the screen) or a carriage return never reaches the terminal.
The expected texts are written out here, not computed by the library.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import re
import shutil
import unicodedata
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
from test_markdown_names import outside_code
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.__main__ import main
from torchinstruments.cli.heatmap import heatmap
from torchinstruments.cli.plot import plot
from torchinstruments.cli.ranks_draw import RankLines
from torchinstruments.cli.selection import Selection
from torchinstruments.cli.text import error_lines
from torchinstruments.rundir.lock import RunLock, RunLockedError
from torchinstruments.rundir.shell import error_said, table_cell

from conftest import cli_in_process

# Layer name -> how the text views write it (markdown: the same, markup behind backslashes).
SHOWN = {
    "new\nline": r"'new\nline'",
    "back\\nslash": r"back\nslash",  # a backslash and an n: the name as it is
    "tab\tx": r"'tab\tx'",
    "cr\rx": r"'cr\rx'",
    "esc\x1b[2J": r"'esc\x1b[2J'",
    "bar|x": "bar|x",
    "'quoted": '"\'quoted"',
    "plain": "plain",
    "<b>*x*_y_`z`": "<b>*x*_y_`z`",  # printable: as it is, but Markdown in a markdown table
    "http://x": "http://x",  # a bare URL GitHub links (GFM's extended autolinks)
    "層一": "層一",  # two wide characters: four terminal columns
    "e\u0301x": "e\u0301x",  # a combining accent: two columns
    "ls\u2028x": r"'ls\u2028x'",  # line breaks to str.splitlines, not to JSON
    "nel\x85x": r"'nel\x85x'",
}
# How `--format markdown` writes that name: each character of markup behind a backslash.
MARKDOWN_CELL = {"<b>*x*_y_`z`": r"\<b\>\*x\*\_y\_\`z\`", "http://x": r"http\://x"}
GONE = "only\nA"  # a layer run A has and run B lacks
# The dict-output layer's tensors: a string key is written by its repr in the tensor path
# (`['k\\nx']`), and the tensor's name, holding the layer's line break, as its literal.
DICT_SHOWN = [r'''"dict\nout['k\\nx']"''', r'''"dict\nout['k|y']"''']
ODD_TYPE = type("Odd\nType", (nn.Linear,), {})  # a class can be named anything too
RUN_A = "a\x1b[2J"  # run A's directory: a directory can be named anything too
WARNED: list[str] = []  # the warnings run A gave


class DictOut(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"k\nx": x * 2, "k|y": x + 1}


class OddNames(nn.Module):
    """A layer per name of SHOWN (and GONE), chained, one of type ODD_TYPE, then DictOut."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names
        for name in names:
            self.add_module(name, ODD_TYPE(2, 2) if name == "plain" else nn.Linear(2, 2))
        self.add_module("dict\nout", DictOut())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.names:
            x = self._modules[name](x)  # type: ignore[misc]
        return sum(v.sum() for v in self._modules["dict\nout"](x).values())  # type: ignore[misc]


OddModel = type("Odd\x1b[2JNet", (OddNames,), {})  # the model's class name, in show's header


class FailingSink:
    """A sink whose start raises with an escape in its message: run A's note quotes it."""

    def start(self, run: object) -> None:
        raise ValueError("boom\x1b[2J")

    def write_forward(self, record: object) -> None: ...

    def write_backward(self, record: object) -> None: ...

    def close(self, counts: object) -> None: ...


class OddSampler(EveryNForwardsSampler):
    """Run A's sampler: every forward, as run B's, described with an escape (a user's
    describe()): show's sampler line and compare's "sampled differently" warning quote it."""

    def describe(self) -> str:
        return "every\x1b[2Jforward"


def boom(tensor: torch.Tensor) -> float:
    """A reducer that fails with an escape in its message: run A's nulls give it as reason."""
    raise ValueError("bad\x1b[2J")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Run A (every name and GONE, a sink that fails, OddSampler) and run B (every name),
    two samples each, of a model class named with an escape."""
    made = []
    for tag, names in ((RUN_A, [*SHOWN, GONE]), ("b", list(SHOWN))):
        torch.manual_seed(0)
        model = OddModel(names)
        directory = tmp_path_factory.mktemp("odd") / tag
        sinks, reducers = ([FailingSink()], [boom]) if tag == RUN_A else ([], [])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inject_observer(
                model,
                output_dir=directory,
                sampler=OddSampler(1) if sinks else EveryNForwardsSampler(1),
                sinks=sinks,
                reducers=reducers,
            )
            for _ in range(2):
                model(torch.randn(1, 2)).backward()
            remove_observer(model)
        if tag == RUN_A:
            WARNED.extend(str(w.message) for w in caught)
        made.append(directory)
    return made[0], made[1]


def command(name: str, runs: tuple[Path, Path], *options: str) -> str:
    """`show A` or `compare A B` with the mean of outputs, its stdout."""
    dirs = runs[:1] if name == "show" else runs
    done = cli_in_process(name, *dirs, "--metrics", "mean", "--signal", "output", *options)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stderr  # csv and markdown say the notes there
    return done.stdout


def tensors(run: Path) -> set[tuple[str, str, str]]:
    """(layer, tensor_path, module_type) of every output mean in `run`'s history."""
    history = pl.read_parquet(run / "history.parquet", glob=False).filter(
        pl.col("metric") == "mean", pl.col("signal") == "output"
    )
    return set(history.select("layer", "tensor_path", "module_type").iter_rows())


@pytest.mark.parametrize("name", ["show", "compare"])
def test_csv_and_json_give_back_every_name_exactly(name: str, runs: tuple[Path, Path]) -> None:
    want = tensors(runs[0])  # compare: B's, and GONE's, absent in B
    text = command(name, runs, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    got = {(r["layer"], r["tensor_path"], r["module_type"]) for r in rows}
    assert got == want
    assert len(rows) == len(got)
    rows = json.loads(command(name, runs, "--format", "json"))["rows"]
    got = {(r["layer"], r["tensor_path"], r["module_type"]) for r in rows}
    assert got == want
    assert len(rows) == len(got)


def unescaped(cell: str) -> str:
    """A markdown cell's text: CommonMark's backslash escapes (before ASCII punctuation) read."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", cell)


def test_each_file_and_json_row_keeps_a_name_on_its_line_for_splitlines(
    runs: tuple[Path, Path],
) -> None:
    """result.json holds one layer per line and `show --format json` one row per line: a
    reader splitting them with `str.splitlines` (which splits at U+2028 and U+0085, as JSON
    does not) gets one line per layer or row; index.md and the state file hold none raw."""
    layers = len(SHOWN) + 2  # GONE and the dict output's layer
    lines = (runs[0] / "result.json").read_text(encoding="utf-8").splitlines()
    assert len(lines) == layers + 2  # `[` and `]`
    assert {json.loads(line.rstrip(","))["layer"] for line in lines[1:-1]} >= set(SHOWN)
    rows = json.loads(command("show", runs, "--format", "json"))["rows"]
    shown = command("show", runs, "--format", "json").splitlines()
    assert len(shown) == len(rows) + 2  # `{"run":...,"rows":[` and `]}`
    for name in ("index.md", ".state.json"):
        text = (runs[0] / name).read_text(encoding="utf-8")
        assert [c for c in ("\u2028", "\x85") if c in text] == [], name


def read_cell(cell: str) -> str:
    """A markdown cell read back: its escapes read, then a text that begins with a quote is a
    Python string literal."""
    text = unescaped(cell)
    return ast.literal_eval(text) if text.startswith(("'", '"')) else text


@pytest.mark.parametrize("name", ["show", "compare"])
def test_markdown_keeps_a_row_per_tensor_and_its_names_read_back(
    name: str, runs: tuple[Path, Path]
) -> None:
    lines = command(name, runs, "--format", "markdown").splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c[1:-1] for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]
    assert all(len(cells) == len(header) for cells in rows), lines
    got = [
        tuple(read_cell(cells[header.index(c)]) for c in ("layer", "tensor_path", "module_type"))
        for cells in rows
    ]
    assert len(set(got)) == len(got)
    assert set(got) == tensors(runs[0])
    for layer, shown in SHOWN.items():
        assert sum(unescaped(cells[0]) == shown for cells in rows) == 1, layer
    for layer, cell in MARKDOWN_CELL.items():  # renders as itself: no tag, emphasis or code
        assert sum(cells[0] == cell for cells in rows) == 1, layer


def test_a_markdown_cell_leaves_github_no_bare_url_to_link() -> None:
    """GFM links `www.` and a domain (a nested module's name) and a scheme's `://` (a
    `ModuleDict` key) outside code: the `.` and the `:` that start them are escaped, so the
    cell renders as the name, read back by CommonMark's escapes. An e-mail address, which
    GitHub links whatever is escaped in it, is a code span of itself (never linked)."""
    for name, cell in (
        ("www.example.com", r"www\.example.com"),
        ("layers.https://x.y", r"layers.https\://x.y"),
        ("(WWW.a.b", r"(WWW\.a.b"),
        ("a@b.c", "`a@b.c`"),
        ("<ops@ex.org>|x_", r"\<`ops@ex.org`\>\|x\_"),
        ("x\\a@b.c`", r"x\\`a@b.c`\`"),
        ("a@b", "a@b"),  # no domain with a dot: GitHub links none
        ("wwwx.y:z/", "wwwx.y:z/"),
    ):
        assert table_cell(name) == cell, name
        assert cell_text(cell) == name
        assert "@" not in outside_code(cell) or "." not in name.partition("@")[2]


def cell_text(cell: str) -> str:
    """A markdown cell read as CommonMark reads it: a backslash before ASCII punctuation
    escapes it, an unescaped backtick is a code span's fence."""
    text, i = [], 0
    while i < len(cell):
        if cell[i] == "\\" and i + 1 < len(cell) and re.match(r"[!-/:-@\[-`{-~]", cell[i + 1]):
            text.append(cell[i + 1])
            i += 2
            continue
        if cell[i] != "`":
            text.append(cell[i])
        i += 1
    return "".join(text)


def first_cells(text: str) -> list[str]:
    """The first cell of each row of the text view's tables: the lines under a `---` line, up
    to a blank one, whose cells are two spaces apart (not the notes below a table)."""
    cells, inside = [], False
    for line in text.splitlines():
        if line.startswith("---"):
            inside = True
        elif not line.strip():
            inside = False
        elif inside and len(row := re.split(r"\s{2,}", line)) > 2:
            cells.append(row[0])
    return cells


@pytest.mark.parametrize("name", ["show", "compare"])
def test_the_text_view_writes_each_name_on_its_row_as_index_md_does(
    name: str, runs: tuple[Path, Path]
) -> None:
    text = command(name, runs, "--width", "200")
    assert not re.search(r"[\t\r\x1b]", text)
    want = [*SHOWN.values(), *DICT_SHOWN, r"'only\nA'"]  # compare: A's series, B absent
    assert sorted(first_cells(text)) == sorted(want)
    lines = text.splitlines()
    note = "- sink <test_cli_odd_names.FailingSink object at "
    (said,) = [line for line in lines if line.startswith(note)]
    assert r"raised 'ValueError: boom\x1b[2J' in start() at the start of the run" in said
    if name == "show":  # each row ends in the same terminal column (its numbers right-aligned)
        table = lines[lines.index(next(li for li in lines if li.startswith("---"))) - 1 :]
        table = table[: table.index("")] if "" in table else table
        widths = {
            sum(
                0
                if unicodedata.combining(c)
                else 2
                if unicodedata.east_asian_width(c) == "W"
                else 1
                for c in line
            )
            for line in table
        }
        assert len(widths) == 1, table
    if name == "show":  # the module type's column, on plain's row
        (row,) = [line for line in lines if line.startswith("plain ")]
        assert row.split()[1] == r"'Odd\nType'"
        assert lines[0] == f"run: '{runs[0]}'".replace("\x1b", r"\x1b")
        assert lines[2].startswith(r"model: 'Odd\x1b[2JNet'; torchinstruments ")
        assert lines[3] == r"sampler: 'every\x1b[2Jforward'"
        nulls = command(name, runs, "--metrics", "boom", "--width", "200")
        assert not re.search(r"[\t\r\x1b]", nulls)
        assert r"unavailable: 'reducer error: ValueError: bad\x1b[2J'" in nulls
    else:  # the layer only one run has
        assert r"only in A (1 layer, no row in the other run): 'only\nA'." in text
        assert f"A: '{runs[0]}' (complete)".replace("\x1b", r"\x1b") in lines
        assert f"B: {runs[1]} (complete)" in lines
        (warning,) = [line for line in lines if line.startswith("warning: the runs were sampled")]
        assert warning.startswith(
            r"warning: the runs were sampled differently (A: 'every\x1b[2Jforward'; B: Every"
        )


def test_a_directory_above_a_run_names_it_by_the_same_rule(runs: tuple[Path, Path]) -> None:
    done = cli_in_process("show", runs[0].parent)
    assert done.returncode != 0
    assert "\x1b" not in done.stderr.split(", e.g. ")[0]  # the example is a shell word
    assert r"holds no run itself but 1 below it ('a\x1b[2J'): pass" in done.stderr


def shown(path: Path) -> str:
    """How the commands write a path holding an escape (and no quote): its string literal."""
    return f"'{path}'".replace("\x1b", r"\x1b")


def test_a_path_in_an_error_is_written_by_the_same_rule(runs: tuple[Path, Path]) -> None:
    gone = runs[0].parent / "gone\x1b[2J"
    done = cli_in_process("show", gone)
    assert (
        done.stderr
        == f"torchinstruments show: {shown(gone)} does not exist: pass a run's output directory\n"
    )
    done = cli_in_process("finalize", gone)
    assert done.stderr.startswith(f"torchinstruments finalize: {shown(gone)} holds no run: ")
    for name in ("plot", "heatmap"):  # refused before matplotlib is needed
        done = cli_in_process(name, runs[0], "--x", "step")
        assert done.returncode == 1
        last = done.stderr.splitlines()[-1]  # after run A's notes
        assert last.startswith(f"torchinstruments {name}: no sample of {shown(runs[0])} ")
    nothing = Selection(layers="nothing")  # the command refuses it first (check_selection)
    for draw in (
        lambda: plot(runs[0], runs[0].parent / "x.png", nothing),
        lambda: heatmap(runs[0], runs[0].parent, nothing),
    ):
        with pytest.raises(ValueError, match=re.escape(f"no history rows in {shown(runs[0])} ")):
            draw()


def test_index_md_names_the_run_directory_and_model_class_by_the_same_rule(
    runs: tuple[Path, Path],
) -> None:
    index = (runs[0] / "index.md").read_text(encoding="utf-8")
    assert f"- output_dir: `{shown(runs[0])}`; started at " in index
    assert "- model class: `'Odd\\x1b[2JNet'`\n" in index
    # The user's errors a note quotes (a sink's, a reducer's), and so their warnings.
    assert r"raised 'ValueError: boom\x1b[2J' in start() at the start of the run" in index
    assert r"first as `'reducer error: ValueError: bad\x1b[2J'`) in 16 layers" in index
    assert "\x1b" not in index
    assert [w for w in WARNED if "boom" in w or "bad" in w]
    assert not [w for w in WARNED if "\x1b" in w]


def test_a_run_directory_whose_path_is_not_utf8_is_refused_and_read_through_a_link(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Polars reads only UTF-8 paths: each command raised a bare TypeError with a traceback."""
    run = tmp_path / "b\udcff"  # the byte 0xff, as os.fsdecode gives it
    shutil.copytree(runs[1], run)
    for name in ("show", "finalize"):
        with pytest.raises(SystemExit) as refused:
            main([name, str(run)])
        assert refused.value.code == 2
        said = f"argument DIR: '{run}' is not UTF-8".replace("\udcff", r"\udcff")
        assert said in capsys.readouterr().err
    (tmp_path / "link").symlink_to(run)
    assert cli_in_process("show", tmp_path / "link").returncode == 0


def test_heatmap_names_the_files_it_wrote_by_the_same_rule(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "o\x1b[2J"
    done = cli_in_process("heatmap", runs[1], "-o", out)
    assert done.stderr == (
        f"torchinstruments heatmap: -o/--output-dir {shown(out)} is not an existing folder; "
        "create it, or choose an existing one\n"
    )
    out.mkdir()
    done = cli_in_process("heatmap", runs[1], "--metrics", "mean", "--signal", "output", "-o", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {shown(out / 'heatmap-mean.png')} (")
    assert "\x1b" not in done.stdout


def test_finalize_and_the_state_lines_write_the_directory_by_the_same_rule(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """A copy of run A made to read as interrupted (its process ended without removal),
    finalized (with a temporary to remove), then emptied of rows, then with a state file that
    cannot be read."""
    run = tmp_path / "c\x1b[2J"
    shutil.copytree(runs[0], run)
    state = json.loads((run / ".state.json").read_text())
    (run / ".state.json").write_text(json.dumps({**state, "interrupted": True}))
    done = cli_in_process("show", run, "--format", "csv")
    assert f"torchinstruments show: {shown(run)}: state: interrupted (" in done.stderr
    (run / "x.torchinstruments-tmp").write_bytes(b"")  # an atomic write cut short
    done = cli_in_process("finalize", run)
    assert done.returncode == 0, done.stderr
    assert f"removed incomplete temporary {shown(run / 'x.torchinstruments-tmp')}" in done.stdout
    assert done.stdout.startswith(f"finalized {shown(run)}: ")
    assert f" in {shown(run / 'history.parquet')} (0 parts merged)" in done.stdout
    state = json.loads((run / ".state.json").read_text())  # a loss whose reason quotes a path
    loss = {"rows": 9, "first_sample_id": 0, "last_sample_id": 0, "reason": "at x\x1b[2J"}
    left = "x\x1b[2J could not be deleted"  # a state's text that show says as it is
    (run / ".state.json").write_text(json.dumps({**state, "losses": [loss], "left_behind": [left]}))
    done = cli_in_process("show", run)
    assert r"disk space: 'x\x1b[2J could not be deleted'" in done.stdout.splitlines()
    assert "\x1b" not in done.stdout
    done = cli_in_process("finalize", run)
    assert done.returncode == 1
    assert r"incomplete: '9 rows of sample 0 were recorded but not written: at x\x1b[2J'" in (
        done.stderr
    )
    assert "\x1b" not in done.stdout + done.stderr
    index = (run / "index.md").read_text(encoding="utf-8")  # rewritten by that finalize
    assert "- 9 rows of sample 0 were recorded but not written: at x\\x1b[2J\n" in index
    assert "\x1b" not in index
    (run / ".state.json").write_text(json.dumps(state))
    history = run / "history.parquet"
    pl.read_parquet(history, glob=False).head(0).write_parquet(history)
    done = cli_in_process("show", run)
    assert done.stderr.startswith(f"torchinstruments show: {shown(run)}: this run recorded no rows")
    (run / ".state.json").write_text("{")
    done = cli_in_process("plot", run)
    assert (  # as show says it: the error's type, the whole by index.md's rule (error_said)
        f"torchinstruments plot: {shown(run)}: the run's state is unreadable (ValueError: "
        ".state.json is not JSON (Expecting property name"
    ) in done.stderr


def test_a_rank_picture_names_each_module_type_of_its_tensor_by_the_same_rule() -> None:
    lines = RankLines(
        ("new\nline", 0, ""),
        ranks=(0, 1),
        left_out=(),
        per_mode=(("train", 2),),
        types=(("Odd\x1b[2JType", (0,)), ("Linear", (1,))),
    )
    assert lines.name() == r"'new\nline' ('Odd\x1b[2JType' on rank 0; Linear on rank 1)"


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A parent of two ranks named with an escape; rank 1's reducer fails (a note, and nulls)."""
    parent = tmp_path_factory.mktemp("odd") / "p\x1b[2J"
    for rank in (0, 1):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", str(rank))
            env.setenv("WORLD_SIZE", "2")
            model = nn.Sequential(nn.Linear(2, 2))
            inject_observer(
                model,
                output_dir=parent,
                sampler=EveryNForwardsSampler(1),
                rank_policy="all",
                reducers=[boom] if rank else [],
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reducer's failure
            model(torch.randn(1, 2)).sum().backward()
        remove_observer(model)
    return parent


def test_show_parent_writes_its_directory_notes_and_reasons_by_the_same_rule(
    parent: Path, tmp_path: Path
) -> None:
    done = cli_in_process("show", parent, "--metrics", "boom", "--width", "200")
    assert done.returncode == 0, done.stderr
    assert not re.search(r"[\t\r\x1b]", done.stdout)
    lines = done.stdout.splitlines()
    assert lines[0] == f"ranks: '{parent}' (2 ranks: 0-1)".replace("\x1b", r"\x1b")
    (note,) = [line for line in lines if line.startswith("- rank 1: ")]
    assert note.startswith("- rank 1: Not measured (")
    assert r"bad\x1b[2J" in note
    assert r"rank 1: latest value null in 2 series ('reducer error: ValueError: bad\x1b[2J')" in (
        lines
    )
    done = cli_in_process("plot", parent, "--x", "step")  # refused before matplotlib is needed
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith(
        f"torchinstruments plot: no sample of {shown(parent)} "
    )
    copy = tmp_path / parent.name  # finalize rewrites the parent's index.md: a copy's
    shutil.copytree(parent, copy)
    done = cli_in_process("finalize", copy)
    assert done.returncode == 0, done.stderr
    assert f"wrote {shown(copy / 'index.md')} (2 ranks)" in done.stdout.splitlines()


class UnreadableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


def test_an_error_a_warning_or_note_quotes_is_written_by_the_same_rule() -> None:
    """`error_said` (sinks, reducers, selectors, a fit's or a script's uncaught exception)."""
    assert error_said(KeyError("k")) == "KeyError: 'k'"
    assert error_said(ValueError("")) == "ValueError"
    assert error_said(ValueError("a\nb\x1b[2J")) == r"'ValueError: a\nb\x1b[2J'"
    assert error_said(UnreadableError()) == "UnreadableError: (its message could not be read)"


def test_a_locked_run_directory_is_refused_by_its_literal(tmp_path: Path) -> None:
    """The refusal reaches the user's traceback (inject with resume=True, finalize): a line
    break in the directory's name forged a line there, an escape rewrote the terminal."""
    directory = tmp_path / "held\x1b[2J\nrun"
    with RunLock(directory), pytest.raises(RunLockedError) as refused:
        RunLock(directory).acquire()
    said = str(refused.value)
    assert said.startswith(repr(str(directory)) + " is in use by a live process (pid "), said
    assert "\x1b" not in said
    assert "\n" not in said


def test_an_error_of_several_lines_keeps_them_each_behind_the_program() -> None:
    """Polars' errors are lines (a caret under a regex, the expression it failed in): printed
    raw, the second line stood on stderr as if the program or the shell had said it; each
    line now begins with the program, and an escape is written as one."""
    with pytest.raises(pl.exceptions.PolarsError) as raised:
        pl.DataFrame({"a": ["x"]}).filter(pl.col("a").str.contains("("))
    lines = error_lines("torchinstruments show", raised.value).split("\n")
    assert lines[0] == "torchinstruments show: regex error: regex parse error:"
    assert len(lines) > 3
    assert all(line.startswith("torchinstruments show:") for line in lines), lines
    assert "\t" not in "".join(lines)
    assert lines[-1].strip() != "torchinstruments show:"
    said = error_lines("p", ValueError("a\x1b[2J\r\nb\n"), "error: ")
    assert said == "p: error: a\\x1b[2J\np: b"


def test_the_warnings_on_a_run_directory_name_it_by_its_literal(tmp_path: Path) -> None:
    """A run that sampled nothing, and one whose directory was removed while it went on: their
    warnings name the directory by index.md's rule, so a line break in its name is told apart
    from a backslash and an `n` (`printable` alone wrote both as `\\n`)."""
    unsampled, gone = tmp_path / "none\nsampled", tmp_path / "gone\nrun"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for directory in (unsampled, gone):
            model = nn.Sequential(nn.Linear(2, 2))
            inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
            if directory == gone:
                model(torch.randn(1, 2))
                while gone.exists():  # as `rm -rf`: the writer threads may add a file meanwhile
                    shutil.rmtree(gone, ignore_errors=True)
            remove_observer(model)
    said = [str(w.message) for w in caught]
    assert any(f"{str(unsampled)!r} holds no rows" in s for s in said), said
    assert any(f"the run directory {str(gone)!r} no longer exists" in s for s in said), said
