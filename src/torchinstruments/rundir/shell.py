"""Command lines the library prints (index.md, CLI messages, warnings), safe to paste into a shell.

Design decision: every printed command that names a path is built here, with `shlex.quote` on
each word, so a run directory called `runs/exp [lr=0.1]` or `run"; $(touch x)` is one argument
that names exactly that directory and nothing in it runs. In Markdown the command goes into a
code span whose backtick fence is longer than any backtick run inside it (CommonMark), so a
backtick in a path cannot end the span early. POSIX shells only (bash, zsh, sh); the cost is
that plain paths with a space now print with quotes around them.

A word holding a character that is not printable (a line break, a tab, an escape, a byte that
is not UTF-8) is written in ANSI-C quotes instead, `$'new\\nline'`, each such character as its
escape: `shlex.quote` keeps it raw between single quotes, where a terminal acts on an escape
(`\\x1b[2J` clears the screen), a line break splits the printed command in two and a Markdown
code span shows it as a space, so the command copied from index.md names another directory.
`$'...'` is read by bash, zsh and ksh (and POSIX.1-2024's sh); a plain name needs none of it.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator

from torchinstruments.reasons import error_message

# How to get matplotlib (plot, heatmap): never `pip install torchinstruments[plot]`, since the
# package index's torchinstruments is an unrelated project (README, Install).
MATPLOTLIB_INSTALL = (
    "`pip install matplotlib` into this environment, or the checkout's `plot` extra "
    '(`uv sync --extra plot`, or `pip install ".[plot]"` in the checkout)'
)


def command_line(*words: str | os.PathLike[str]) -> str:
    """`words` joined into one POSIX shell command line, each word quoted where it needs it,
    and a path (an `os.PathLike` word) that starts with `-` written as `./-...`: the same
    directory, never read as an option by the command it is given to.

    Example:
        >>> command_line("torchinstruments", "show", "runs/exp [lr=0.1]")
        "torchinstruments show 'runs/exp [lr=0.1]'"

    (`Path("-run")` prints as `./-run`; a word with a line break or an escape in it as
    `$'a\\nb'`: see the module docstring.)
    """
    return " ".join(_quoted(_word(word)) for word in words)


# What a character is written as inside `$'...'` where it is not itself (see the module
# docstring); any other character that is not printable is written by its bytes, `\\xHH`.
_ANSI_C = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _quoted(word: str) -> str:
    """`word` as one shell word: `shlex.quote`, or ANSI-C quotes where it holds a character
    that is not printable (a lone surrogate is a byte that was not UTF-8: that byte)."""
    if word.isprintable():
        return shlex.quote(word)
    return "$'" + "".join(_ansi_c(char) for char in word) + "'"


def _ansi_c(char: str) -> str:
    """One character of a `$'...'` word (`_quoted`)."""
    if char in _ANSI_C:
        return _ANSI_C[char]
    if char.isprintable():
        return char
    if "\udc80" <= char <= "\udcff":  # os.fsdecode's stand-in for the byte 0x80-0xff
        return f"\\x{ord(char) - 0xDC00:02x}"
    return "".join(f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogatepass"))


def _word(word: str | os.PathLike[str]) -> str:
    """A word's text; a relative path that starts with `-` behind `./`."""
    text = os.fspath(word)
    return os.path.join(".", text) if isinstance(word, os.PathLike) and text[:1] == "-" else text


def tool_command(*words: str | os.PathLike[str]) -> str:
    """`<this interpreter> -m torchinstruments WORDS`, quoted: it runs as typed in a shell that
    has not activated the environment (`torchinstruments` alone is on PATH only where it has),
    and it names the interpreter of the process that prints it: the one that wrote the run.

    Example:
        >>> tool_command("show", "runs/a").endswith("-m torchinstruments show runs/a")
        True
    """
    return command_line(sys.executable, "-m", "torchinstruments", *words)


def tool_span(*words: str | os.PathLike[str]) -> str:
    """`tool_command(*words)` as a Markdown code span (for index.md)."""
    return code_span(tool_command(*words))


def code_span(text: str) -> str:
    """`text` as one Markdown inline code span, whatever backticks it holds."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    if longest or text.startswith(" ") or text.endswith(" "):
        return f"{fence} {text} {fence}"  # CommonMark strips one space on each side
    return f"{fence}{text}{fence}"


def literal_if_unclear(text: str) -> str:
    """`text` as it is, or its Python string literal (`repr`: `'a\\nb'`) where it holds a
    character that is not printable (a line break, a tab, another control character) or
    begins with a quote. A line break ended a Markdown table row (a layer named with one split
    index.md's Layers table), and an escape without the quotes (`a\\nb`) would read alike for
    a name holding a backslash and an `n`: a text that begins with a quote is a literal, any
    other is the name itself."""
    if text.isprintable() and not text.startswith(("'", '"')):
        return text
    return repr(text)


def repr_if_unclear(text: str) -> str:
    """A text quoted already (a `repr`, which begins with a quote) as it is, or its own literal
    where it is not printable (an object's repr holding a line break or an escape):
    `literal_if_unclear` for a repr, which a leading quote does not make unclear."""
    return text if text.isprintable() else repr(text)


def literal_span(text: str) -> str:
    """A text from outside (a tag, a tensor path, a directory, a reason) as index.md writes it
    in a line: a code span of `literal_if_unclear` (outside code, `*`, `_` or `<x>` renders as
    Markdown; raw, a line break splits the line and shows as a space)."""
    return code_span(literal_if_unclear(text))


def layer_span(name: str) -> str:
    """A layer's name as index.md writes it anywhere (the Layers section, every note): a code
    span of `literal_if_unclear`, `<root>` for the root. Outside code, a name holding `*`, `_`
    or `<x>` (an `nn.ModuleDict` key can be any string) renders as emphasis or an HTML tag,
    which GitHub drops; warnings name layers by `repr` instead, as plain text."""
    return code_span(literal_if_unclear(name) or "<root>")


def error_said(error: BaseException) -> str:
    """`Type: message` for a warning or a note that quotes an error from outside the library
    (a user's sink, reducer, selector or training step; `Type` alone for an empty message),
    the message as a reason holds it (`reasons.error_message`: cut, a stand-in where reading
    it raises), the whole by `literal_if_unclear`, as `show` writes a null's reason
    (`'ValueError: a\\nb'`; a KeyError's `KeyError: 'k'` stays as it is). Raw, a line break
    in the message forged a line of the terminal or a log after `RuntimeWarning:` and started
    a heading or a list in index.md's note, and an escape (`\\x1b[2J`) cleared the screen of
    whoever read the warning or `cat index.md`."""
    message = error_message(error)
    return literal_if_unclear(type(error).__name__ + (f": {message}" if message else ""))


def table_cell(text: str) -> str:
    """`text` for a GitHub Markdown table cell outside code: `literal_if_unclear`, then each
    character Markdown would read as markup behind a backslash (`markdown_text`), a `|` too
    (GitHub splits a row at every unescaped `|`). Reading a cell back, drop the backslash
    before each ASCII punctuation character (CommonMark's backslash escape)."""
    return markdown_text(literal_if_unclear(text))


# Read as markup anywhere in a line (a code span, emphasis, strikethrough, a link, an HTML tag or
# entity), and `|`, which ends a table cell: written behind a backslash by `markdown_text`.
_MARKUP = frozenset("\\`*~[]<>&|")


def markdown_text(text: str) -> str:
    """`text` as Markdown that renders as itself inside a line: each character that would
    start markup (`_MARKUP`, and an `_` not between two letters or digits: `self_attn` stays,
    `_c_` would be emphasis) behind a backslash. A layer name is any string (a `ModuleDict`
    key), and `<b>` in a cell was an HTML tag GitHub drops, `*a*` emphasis.

    GitHub also links a bare URL (GFM's extended autolinks): `www.` and a domain, a scheme's
    `://` (`http://localhost`, a `ModuleDict` key; `www.a.b`, nested modules). The `.` after
    `www` and the `:` before `//` are written behind a backslash too (`www\\.a.b`,
    `http\\://a`), which GitHub renders as the name without a link. An e-mail address
    (`a@b.c`) is written as a code span of itself (`unlinked`): GitHub finds one in the text
    after reading the escapes, so no backslash stops it, and a code span is never linked."""
    return _unlinked(text, _escaped)


def _escaped(text: str) -> str:
    """`text` with every character that starts markup or a bare link behind a backslash (see
    `markdown_text`); `text` holds no e-mail address."""
    last = len(text) - 1
    return "".join(
        "\\" + char
        if char in _MARKUP
        or (char == "_" and not (0 < i < last and text[i - 1].isalnum() and text[i + 1].isalnum()))
        or _starts_link(text, i)
        else char
        for i, char in enumerate(text)
    )


def _starts_link(text: str, i: int) -> bool:
    """Whether the character at `i` is the `.` of `www.` or the `:` of `://` (GFM's extended
    www and URL autolinks start there); behind a backslash, GitHub links neither."""
    char = text[i]
    return (char == "." and text[max(i - 3, 0) : i].lower() == "www") or (
        char == ":" and text[i + 1 : i + 3] == "//"
    )


# An e-mail address as GFM's extended e-mail autolink finds it, wider rather than narrower: ASCII
# letters and digits and `.+-_` before the `@` (a letter or digit last), a domain of letters,
# digits and `._-` after it (a letter or digit last, a `.` in it): written as a code span, whose
# characters all stand for themselves there (no escape is read inside one).
_LETTERS_DIGITS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_LOCAL = _LETTERS_DIGITS | frozenset(".+_-")
_DOMAIN = _LETTERS_DIGITS | frozenset("._-")


def _emails(text: str) -> Iterator[tuple[int, int]]:
    """Where the e-mail addresses in `text` start and end, leftmost first, found from each `@`
    outwards: linear in `text` (a regular expression tried from every position took quadratic
    time on a long run of letters: 41 s for a sink's note of 32,000 characters)."""
    done, at = 0, text.find("@")
    while at != -1:
        if at > done and text[at - 1] in _LETTERS_DIGITS:
            start, end = at - 1, at + 1
            while start > done and text[start - 1] in _LOCAL:
                start -= 1
            while end < len(text) and text[end] in _DOMAIN:
                end += 1
            while end > at + 1 and text[end - 1] not in _LETTERS_DIGITS:
                end -= 1
            if end > at + 1:
                yield start, end
                done = end
        at = text.find("@", max(at + 1, done))


def _unlinked(text: str, escape: Callable[[str], str]) -> str:
    """`text` with each e-mail address in it a code span of itself (GitHub links one outside
    code whatever is escaped in it) and the text between them written by `escape`."""
    out, at = [], 0
    for start, end in _emails(text):
        if "." not in text[start:end].partition("@")[2]:
            continue  # no domain with a dot: GitHub links none
        out += [escape(text[at:start]), code_span(text[start:end])]
        at = end
    return "".join(out) + escape(text[at:])


def unlinked(text: str) -> str:
    """A line of Markdown (an index.md note) whose code spans stay as they are, and whose text
    outside them (which quotes an error's message, a path, a name: text from outside) leaves
    GitHub no bare link to make: the `.` of `www.` and the `:` of `://` behind a backslash, an
    e-mail address a code span of itself (`markdown_text` says why). Raw, a message holding
    `https://host/x` or `<a@b.c>` rendered as a link, which is not what was recorded."""
    out, at = [], 0
    for start, end in _code_spans(text):
        out += [_unlinked(text[at:start], _link_escaped), text[start:end]]
        at = end
    return "".join(out) + _unlinked(text[at:], _link_escaped)


def _link_escaped(text: str) -> str:
    """`text` (outside code) with the characters that start a bare link behind a backslash,
    and each backtick not escaped already (a literal one, outside code: an e-mail's code span
    beside it must not grow its fence), a backslash escape kept as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            out.append(text[i : i + 2])
            i += 2
            continue
        out.append("\\" + text[i] if text[i] == "`" or _starts_link(text, i) else text[i])
        i += 1
    return "".join(out)


def _code_spans(text: str) -> list[tuple[int, int]]:
    """Where `text`'s code spans are, as CommonMark reads them: a run of backticks up to the
    next run of the same length (a backslash before a backtick outside one escapes it)."""
    spans, i = [], 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] != "`":
            i += 1
            continue
        end = i
        while end < len(text) and text[end] == "`":
            end += 1
        fence = text[i:end]
        close = re.compile(f"(?<!`){fence}(?!`)").search(text, i + len(fence))
        if close is None:
            i += len(fence)
            continue
        spans.append((i, close.end()))
        i = close.end()
    return spans


# Line breaks to `str.splitlines` that JSON writes raw (it escapes those below U+0020 only).
_JSON_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def json_on_one_line(text: str) -> str:
    """JSON text (`json.dumps(..., ensure_ascii=False)`) with NEL, LINE SEPARATOR and
    PARAGRAPH SEPARATOR written as `\\uXXXX` escapes (the same string to every JSON reader):
    raw, a layer named with one split its line of result.json (one layer per line) or of
    `show --format json` (one row per line) for a reader that splits with `str.splitlines`,
    and a Python literal in index.md's queries. They occur only inside JSON strings, so the
    replacement never touches the JSON's structure."""
    if not any(char in text for char in _JSON_BREAKS):
        return text
    return "".join(_JSON_BREAKS.get(char, char) for char in text)


def command_span(*words: str | os.PathLike[str]) -> str:
    """`command_line(*words)` as a Markdown code span (for index.md)."""
    return code_span(command_line(*words))


__all__ = [
    "MATPLOTLIB_INSTALL",
    "code_span",
    "command_line",
    "command_span",
    "error_said",
    "json_on_one_line",
    "layer_span",
    "literal_if_unclear",
    "literal_span",
    "markdown_text",
    "repr_if_unclear",
    "table_cell",
    "tool_command",
    "tool_span",
    "unlinked",
]
