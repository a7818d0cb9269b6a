"""Every shell command the library prints names its run directory as one quoted word.

index.md is rendered for directories whose names hold spaces, brackets, quotes, `;`, backticks,
`$(...)`, a line break, an escape and a tab; each command line in it is run with `bash -c`
against stand-in `torchinstruments` and `python` executables that record their arguments, so
the test sees exactly what a pasted line would run and checks that nothing else ran (no file
created, nothing printed), and that the line itself holds no raw line break or escape.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.cli.reader import NotARunError, locate
from torchinstruments.rundir.shell import code_span, command_line, literal_if_unclear, tool_command

HOSTILE_NAMES = [
    "runs/exp [lr=0.1]",
    "with space",
    'it\'s "quoted"',
    "a;b & c | d",
    'run"; print("INJECTED"); x = ("\'$(touch PWNED)',
    "back`echo INJECTED`tick $(touch PWNED) ${HOME}",
    "new\nline\x1b[2J'tab\t",  # written as $'...': no raw line break or escape is printed
]

_RECORDER = '#!/bin/sh\nprintf "%s\\0" "$0" "$@" > "$ARGV_FILE"\n'


def code_spans(markdown: str) -> list[str]:
    """The contents of every CommonMark inline code span (any fence length) in `markdown`."""
    spans = []
    for match in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", markdown, flags=re.DOTALL):
        text = match.group(2)
        if len(text) >= 2 and text.startswith(" ") and text.endswith(" ") and text.strip():
            text = text[1:-1]
        spans.append(text)
    return spans


def run_pasted(line: str, sandbox: Path) -> tuple[list[str], str]:
    """Run `line` with bash in `sandbox`; returns the recorded argv and what bash printed."""
    bin_dir = sandbox.parent / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("torchinstruments", "python"):
        recorder = bin_dir / name
        recorder.write_text(_RECORDER)
        recorder.chmod(0o755)
    argv_file = sandbox.parent / "argv"
    argv_file.unlink(missing_ok=True)
    result = subprocess.run(
        ["bash", "-c", line],
        cwd=sandbox,
        env={"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "ARGV_FILE": str(argv_file)},
        capture_output=True,
        text=True,
        check=False,
    )
    printed = result.stdout + result.stderr
    argv = argv_file.read_bytes().decode().split("\0")[:-1] if argv_file.exists() else []
    return [Path(argv[0]).name, *argv[1:]] if argv else [], printed


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_index_md_shell_lines_address_the_run_directory_and_run_nothing_else(
    tmp_path: Path, name: str
) -> None:
    directory = tmp_path / "work" / name
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    index = (directory / "index.md").read_text(encoding="utf-8")

    # Commands run with the interpreter that wrote the run; here a recorder stands in for it.
    interpreter = shlex.quote(sys.executable) + " "
    commands = [
        "python " + span.removeprefix(interpreter)
        for span in code_spans(index)
        if span.startswith(interpreter + "-m torchinstruments ")
    ]
    # Commands that name this run: its directory (finalize) or `.`, the folder of this page.
    expected = {
        "finalize": [str(directory)],
        "show": ["."],
        "plot": ["."],
        "heatmap": ["."],
        "compare": ["OTHER_RUN", "."],
    }
    named = [c for c in commands if "rank-" not in c]
    assert sorted(c.split()[3] for c in named) == sorted(expected), commands
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    for line in named:
        argv, printed = run_pasted(line, sandbox)
        command = line.split()[3]
        assert argv == ["python", "-m", "torchinstruments", command, *expected[command]], line
        assert printed == "", (line, printed)
        assert list(sandbox.iterdir()) == [], line  # no $(touch PWNED), no redirection
    # The output_dir line is a code span holding the literal path, backticks and all (its
    # Python string literal where it holds a line break or an escape, as a layer name's).
    assert f"- output_dir: {code_span(literal_if_unclear(directory.as_posix()))};" in index
    assert "\x1b" not in index
    assert all(c.isprintable() for c in named)


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_messages_that_name_a_command_quote_the_directory(tmp_path: Path, name: str) -> None:
    directory = tmp_path / name
    (directory / "rank-000").mkdir(parents=True)
    with pytest.raises(NotARunError) as not_a_run:
        locate(directory)
    assert command_line(directory / "rank-000") in str(not_a_run.value)
    # The form every printed command takes (`tool_command`), the interpreter a recorder here.
    finalize = command_line("python", "-m", "torchinstruments", "finalize", directory)
    printed = tool_command("finalize", directory)
    assert printed == command_line(sys.executable, "-m", "torchinstruments", "finalize", directory)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    argv, printed = run_pasted(finalize, sandbox)
    assert argv == ["python", "-m", "torchinstruments", "finalize", str(directory)]
    assert (printed, list(sandbox.iterdir())) == ("", [])
    assert finalize.isprintable()
