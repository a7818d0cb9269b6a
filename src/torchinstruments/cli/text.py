"""Plain-text tables for the terminal, and the machine formats (csv, json, markdown).

Design decision: text tables are laid out for a fixed width (80 columns unless told otherwise):
numbers get fixed-width cells (4 significant digits), and name columns are shortened to fit, or,
for layer names (`wrap_first`), a name too long for its column is printed whole on a line of its
own above its row: `bert.encoder.layer.0...query` and `...layer.1...query` differ in the middle,
where any cut would make them print alike. The machine formats always
carry every row and full float precision, so scripts never parse the text view.

JSON is compact, one row per line (`{"run":{...},"rows":[` then a row per line, then `]}`),
whether or not stdout is a terminal: a 3,000-layer run's `show` is 54,000 rows, 25 MB
indented and about half that compact; `jq` indents it for a reader, `grep`, `head` and `wc -l`
work row by row (as on result.json, one layer per line), and the bytes never depend on where
the output goes (a terminal switch would make `> file` differ from what was seen). Indentation
also kept `json` on its pure-Python encoder, most of the command's time on such a run.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

import polars as pl

from torchinstruments.notices import printable
from torchinstruments.records import OUTPUT
from torchinstruments.rundir.layout import INDEX_FILE
from torchinstruments.rundir.ranges import plural
from torchinstruments.rundir.shell import (
    json_on_one_line,
    literal_if_unclear,
    markdown_text,
    table_cell,
)

NUMBER_WIDTH = 10
# A comparison's text view's most series unless --all (`earliest` chooses them): 3,000 layers
# compared are 54,000 series, a table no one reads at a terminal.
TEXT_SERIES = 60
FORMATS = ("text", "csv", "json", "markdown")


# `show` (of a run, and of a parent's ranks) begins at most this many of the notes, each cut to
# NOTE_CHARS characters.
NOTES_SHOWN = 5
NOTE_CHARS = 150


def cut_note(note: str) -> str:
    """A note's beginning, at most `NOTE_CHARS` characters (`...` where it was cut)."""
    return note if len(note) <= NOTE_CHARS else note[: NOTE_CHARS - 3].rstrip() + "..."


def notes_lines(notes: Sequence[str]) -> list[str]:
    """A run's notes as `show` says them (and `compare`, `plot` and `heatmap`, which never draw
    or compare a run silently past what it did not record): how many index.md holds and where,
    then the beginning of each of the first `NOTES_SHOWN` (a note is a paragraph; the summary
    stays short, and a note cut says so with `...`). A note quotes users' texts (a sink's error
    message, a class name) inside a sentence it cannot take apart here: the whole beginning is
    written by index.md's rule (`literal_if_unclear`), so an escape or a carriage return in it
    is shown as `\\x1b`, `\\r` in a quoted literal and never rewrites the terminal."""
    if not notes:
        return []
    lines = [f"notes: {len(notes)}, in full at the top of {INDEX_FILE}:"]
    for note in notes[:NOTES_SHOWN]:
        lines.append(f"- {literal_if_unclear(cut_note(note))}")
    if len(notes) > NOTES_SHOWN:
        lines.append(f"- ... ({len(notes) - NOTES_SHOWN} more)")
    return lines


def error_lines(prog: str, error: BaseException, kind: str = "") -> str:
    """An error for stderr: `prog: KIND message`, a message of several lines kept as lines,
    each behind `prog: `, each written by `notices.printable` (tabs as spaces).

    Why lines, not one literal: Polars' errors (a damaged file, a regex it refuses) are meant
    to be read as lines (a caret under the pattern, the expression it failed in); one
    `'...\\n...'` literal hid that. Raw, a line of the message stood unprefixed on stderr,
    where it read as the program's own next line (or a shell's), and an escape in a quoted
    path rewrote the terminal; prefixed, every line says whose it is and `grep prog:` keeps
    the whole message."""
    lines = [printable(line.expandtabs(4)) for line in re.split(r"\r\n|\n", str(error))]
    while len(lines) > 1 and not lines[-1].strip():
        lines.pop()
    first, *rest = lines
    return "\n".join([f"{prog}: {kind}{first}", *(f"{prog}: {line}".rstrip() for line in rest)])


def tensor_label(
    layer: str, call_index: int, tensor_path: str, mode: str = "train", *, calls: bool
) -> str:
    """How every command names a tensor: `layer` (`<root>` for the root), `layer#call` for
    layers called several times (`calls`), the tensor path, then ` [eval]` for an eval series
    (a series of its own: never averaged with the train one).

    The name before ` [eval]` is written as index.md writes a layer's (`literal_if_unclear`):
    its Python string literal where it holds a character that is not printable (a line break
    would split its row, a carriage return or an escape rewrite the screen) or begins with a
    quote, so that `'a\\nb'` (a line break) and `a\\nb` (a backslash and an `n`) never read
    alike; the machine formats keep names as they are."""
    name = (layer or "<root>") + (f"#{call_index}" if calls else "") + tensor_path
    return literal_if_unclear(name) + ("" if mode == "train" else f" [{mode}]")


def several_calls(frame: pl.DataFrame) -> set[str]:
    """The layers of `frame` called more than once in a forward (their names carry `#call`)."""
    return set(frame.filter(pl.col("call_index") > 0)["layer"].to_list())


def signal_short(signal: str) -> str:
    """`out` for output, `grad` for output_gradient: a table's signal column."""
    return "out" if signal == OUTPUT else "grad"


def series_name(row: dict[str, Any], several_calls: set[str]) -> str:
    """`tensor_label` of a row of a command's frame (`several_calls`: the layers called more
    than once)."""
    return tensor_label(
        row["layer"],
        row["call_index"],
        row["tensor_path"],
        row.get("mode", "train"),
        calls=row["layer"] in several_calls,
    )


def number(value: float | None, *, missing: str = "-") -> str:
    """A float in at most NUMBER_WIDTH characters (4 significant digits); None -> `missing`."""
    if value is None:
        return missing
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    text = f"{value:.4g}"
    return text if len(text) <= NUMBER_WIDTH else f"{value:.2e}"


def columns(text: str) -> int:
    """The terminal columns `text` takes: 2 for a wide character (CJK: East Asian Wide or
    Fullwidth), 0 for a combining mark (it sits on the character before), 1 for the others.
    `len` counted characters, and a layer named in Chinese, or with an accent written as a
    combining mark, pushed the columns after it out of line."""
    return sum(_char_columns(char) for char in text)


def _char_columns(char: str) -> int:
    """`columns` of one character."""
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _tail(text: str, width: int) -> str:
    """The longest end of `text` that takes at most `width` columns."""
    taken, start = 0, len(text)
    while start > 0 and taken + _char_columns(text[start - 1]) <= width:
        start -= 1
        taken += _char_columns(text[start])
    return text[start:]


def _head(text: str, width: int) -> str:
    """The longest beginning of `text` that takes at most `width` columns."""
    taken, end = 0, 0
    while end < len(text) and taken + _char_columns(text[end]) <= width:
        taken += _char_columns(text[end])
        end += 1
    return text[:end]


def shorten(text: str, width: int) -> str:
    """`text` cut to `width` columns (`columns`), keeping its end (the distinctive part of a
    layer name)."""
    if columns(text) <= width:
        return text
    return "..." + _tail(text, width - 3) if width > 3 else _head(text, width)


def _pieces(text: str, width: int) -> list[str]:
    """`text` split into lines of at most `width` columns (a wide character never halved)."""
    pieces = []
    while text:
        piece = _head(text, width) or text[0]
        pieces.append(piece)
        text = text[len(piece) :]
    return pieces


def series_table(
    frame: pl.DataFrame,
    headers: Sequence[str],
    cells: Callable[[dict[str, Any]], list[str]],
    *,
    width: int,
    wrap_first: bool = False,
    calls: set[str] | None = None,
) -> list[str]:
    """A row per series of `frame`: its tensor (`series_name`; `calls`: `several_calls`, by
    default of `frame`), signal (`signal_short`), the third column's value (`metric` or `at`,
    named by `headers[2]`), then `cells(row)`: numbers, right-aligned. A metric name is never
    shortened. See `table`.
    """
    third = headers[2]
    calls = several_calls(frame) if calls is None else calls
    rows = [
        [series_name(r, calls), signal_short(r["signal"]), str(r[third]), *cells(r)]
        for r in frame.iter_rows(named=True)
    ]
    numeric = [False] * 3 + [True] * (len(headers) - 3)
    whole = [False, False, third == "metric"] + [False] * (len(headers) - 3)
    return table(headers, rows, numeric=numeric, width=width, whole=whole, wrap_first=wrap_first)


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    numeric: Sequence[bool],
    width: int,
    whole: Sequence[bool] | None = None,
    wrap_first: bool = False,
) -> list[str]:
    """Rows as aligned text lines no wider than `width`; text columns shrink to fit.

    Args:
        headers: column titles.
        rows: cell strings.
        numeric: per column, whether it is right-aligned (numbers) and never shortened.
        width: the widest a line may be (exceeded only when the numbers and `whole` columns
            need it). Where the text columns shrunk to their floors are still too wide, columns
            are one space apart instead of two, and then a `wrap_first` column shrinks further.
        whole: per column, a text column that is never shortened either (metric names: a cut
            `..._fraction` could be either fraction); default none.
        wrap_first: the first column's cells that do not fit go whole on a line of their own
            (split at `width` when longer), above the row, whose first cell is then blank.
    """
    sizes = [max([columns(h), *(columns(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    gap = 2
    excess = sum(sizes) + gap * (len(sizes) - 1) - width
    keep = whole if whole is not None else [False] * len(headers)
    shrinkable = [i for i, is_num in enumerate(numeric) if not is_num and not keep[i]]
    while excess > 0 and shrinkable:
        widest = max(shrinkable, key=lambda i: sizes[i])
        floor = max(6, columns(headers[widest]))
        if sizes[widest] <= floor:
            shrinkable.remove(widest)
            continue
        cut = min(excess, sizes[widest] - floor)
        sizes[widest] -= cut
        excess -= cut
    if excess > 0:  # the columns that are never cut need the width: one space between columns
        gap = 1
        excess -= len(sizes) - 1
    # Still too wide: a first column that wraps gives up its width, down to its header's, or
    # else all of it (each of its cells then goes on a line of its own above its row, and the
    # column and its gap are left out), so no line is wider than `width` where the others fit.
    first_out = False
    if excess > 0 and wrap_first and not numeric[0]:
        left = sizes[0] - excess
        sizes[0] = left if left >= columns(headers[0]) else 0
        first_out = sizes[0] == 0

    def line(cells: Sequence[str]) -> str:
        out = []
        for cell, size, is_num in zip(cells, sizes, numeric, strict=True):
            cell = shorten(cell, size)
            pad = " " * (size - columns(cell))  # by columns: `ljust` counts characters
            out.append(pad + cell if is_num else cell + pad)
        return (" " * gap).join(out[1:] if first_out else out).rstrip()

    out = [line(headers), line(["-" * s for s in sizes])]
    for r in rows:
        if wrap_first and columns(r[0]) > sizes[0]:
            out += _pieces(r[0], width)
            r = ["", *r[1:]]
        out.append(line(r))
    return out


def earliest(frame: pl.DataFrame, column: str, limit: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The `limit` rows of `frame` whose `column` is smallest (nulls last, ties in the frame's
    order), in that order, and the other rows: a long comparison's text table shows where its
    runs or ranks part first (an order by a measured position, not a score)."""
    ranked = (
        frame.with_row_index("_pos").sort(pl.col(column).is_null(), column, "_pos").drop("_pos")
    )
    return ranked.head(limit), ranked.slice(limit)


def _jsonable(value: Any) -> Any:
    """Floats that JSON can hold (no NaN or Infinity: they become null), in lists too (a
    parent's `departing_values`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _finite_floats(frame: pl.DataFrame) -> tuple[pl.DataFrame, list[str]]:
    """`frame` with NaN and infinities of its float columns made null (in Polars, not per
    value in Python), and the columns `_jsonable` still has to see (lists and other nested)."""
    finite = [
        pl.when(pl.col(name).is_finite()).then(pl.col(name)).alias(name)
        for name, dtype in frame.schema.items()
        if dtype.is_float()
    ]
    nested = [name for name, dtype in frame.schema.items() if dtype.is_nested()]
    return (frame.with_columns(finite) if finite else frame), nested


def _json(value: Any) -> str:
    """One compact JSON value: strict (no NaN or Infinity), UTF-8 text as it is."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return json_on_one_line(text)  # one row per line, whatever a name holds


def json_document(frame: pl.DataFrame, facts: dict[str, Any]) -> str:
    """`{"run": facts, "rows": [...]}`, compact, each row on a line of its own (the module
    docstring says why)."""
    frame, nested = _finite_floats(frame)
    rows = frame.iter_rows(named=True)
    if nested:
        rows = ({**row, **{k: _jsonable(row[k]) for k in nested}} for row in rows)
    lines = [_json(row) for row in rows]
    body = "[\n" + ",\n".join(lines) + "\n]" if lines else "[]"
    return '{"run":' + _json(facts) + ',"rows":' + body + "}"


def markdown(frame: pl.DataFrame) -> str:
    """A GitHub pipe table of `frame` (floats with full repr precision), one line per row: a
    text holding a line break (a layer name, an error's message in a reason) is written as
    its Python string literal, and each character Markdown reads as markup (`|`, `*`, `<`, a
    backtick...) behind a backslash (`rundir.shell.table_cell`), so a name renders as itself."""

    def cell(value: Any) -> str:
        if value is None:
            return ""
        return table_cell(value) if isinstance(value, str) else markdown_text(str(value))

    lines = [
        "| " + " | ".join(frame.columns) + " |",
        "| " + " | ".join("---" for _ in frame.columns) + " |",
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.iter_rows()]
    return "\n".join(lines)


def render_frame(frame: pl.DataFrame, fmt: str, facts: dict[str, Any] | None = None) -> str:
    """`frame` as csv, json (`{"run": facts, "rows": [...]}`) or markdown."""
    if fmt == "csv":
        return frame.write_csv().rstrip("\n")
    if fmt == "json":
        return json_document(frame, facts or {})
    if fmt == "markdown":
        return markdown(frame)
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


__all__ = [
    "FORMATS",
    "NOTES_SHOWN",
    "NOTE_CHARS",
    "NUMBER_WIDTH",
    "TEXT_SERIES",
    "cut_note",
    "earliest",
    "error_lines",
    "json_document",
    "markdown",
    "notes_lines",
    "number",
    "plural",
    "render_frame",
    "series_name",
    "series_table",
    "several_calls",
    "shorten",
    "signal_short",
    "table",
    "tensor_label",
]
