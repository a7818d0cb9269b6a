"""docs/command-line.md names every option the parser accepts, for the command that takes it.

Why: the page is where a user learns the commands, and options added to the parser without a
word there (`--window`, `--width`, `heatmap --scale`) were found only in `--help`. The parser is
read, not a list kept here, so a new option fails this test until the page names it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from torchinstruments.cli.arguments import parser

PAGE = Path(__file__).resolve().parents[1] / "docs" / "command-line.md"
# A command's section begins with a line that opens with its name in backticks (`show`: ...,
# `plot` (needs ...); everything before the first is about every command.
SECTION = re.compile(r"^`(show|compare|plot|heatmap|finalize)`[ :]", flags=re.MULTILINE)


def options_by_command() -> dict[str, list[str]]:
    """Each subcommand's option strings (`--window`, `-o`), `--help` left out."""
    (commands,) = (a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: [
            option
            for action in command._actions
            for option in action.option_strings
            if option not in ("-h", "--help")
        ]
        for name, command in commands.choices.items()
    }


def sections(page: str) -> tuple[str, dict[str, str]]:
    """The page's text before the first command's section, and each command's section (to the
    next one's start, or the page's end)."""
    starts = list(SECTION.finditer(page))
    ends = [m.start() for m in starts[1:]] + [len(page)]
    own = {m.group(1): page[m.start() : end] for m, end in zip(starts, ends, strict=True)}
    return page[: starts[0].start()] if starts else page, own


def names(text: str, option: str) -> bool:
    """Whether `text` writes `option` as a word of its own (`--x` is not in `--x-axis`)."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_the_command_line_page_names_every_option_in_its_commands_section() -> None:
    common, own = sections(PAGE.read_text("utf-8"))
    assert {"show", "compare", "plot", "heatmap"} <= set(own)
    missing = [
        f"{command} {option}"
        for command, options in options_by_command().items()
        for option in options
        if not (names(common, option) or names(own.get(command, ""), option))
    ]
    assert missing == []
