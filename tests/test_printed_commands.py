"""Every command the library prints runs as typed, and index.md reads the run it sits in.

Commands are taken from the texts a user reads (index.md, the command line's own messages) and
run with `bash -c` in a fresh environment whose PATH holds only a folder with the interpreter
(no activated environment, no `torchinstruments` script): a command printed as `torchinstruments
show DIR` or `python -m torchinstruments ...` fails there, `<the interpreter that wrote the run>
-m torchinstruments ...` runs. index.md's setup block is run from a copy of the run while another
run sits where the original was written: it must read the copy, and stop when it finds neither.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.__main__ import main


def fresh_shell(tmp_path: Path) -> dict[str, str]:
    """An environment with only a folder holding a `python` link to the interpreter on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    link = bin_dir / "python"
    if not link.exists():
        link.symlink_to(sys.executable)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}


def bash(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def train(directory: Path, **kwargs: Any) -> Path:
    torch.manual_seed(0)
    # the first layer has no parameters and is fed the data: its outputs never require grad
    model = nn.Sequential(nn.ReLU(), nn.Linear(3, 3), nn.Tanh())
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1), **kwargs)
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    return directory


def code_spans(markdown: str) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"(`+)(.+?)\1", markdown)]


def test_index_md_commands_run_as_typed_in_a_fresh_shell(tmp_path: Path) -> None:
    run = train(tmp_path / "runs" / "a")
    page = (run / "index.md").read_text(encoding="utf-8")
    commands = [c for c in code_spans(page) if " -m torchinstruments " in c]
    assert {c.split(" -m torchinstruments ")[1].split()[0] for c in commands} >= {
        "show",
        "compare",
        "plot",
        "heatmap",
        "finalize",
    }
    env = fresh_shell(tmp_path)
    assert bash("torchinstruments --help", run, env).returncode == 127  # not on this PATH
    for command in commands:
        if "rank-000" in command:
            continue  # the ranks' example names directories this run does not have
        assert command.startswith(sys.executable), command  # the interpreter that wrote it
        if " finalize " in command:
            continue  # a finished run: finalize has nothing to do (run below on a live copy)
        result = bash(command.replace("OTHER_RUN", "."), run, env)
        assert result.returncode == 0, (command, result.stderr)
    assert (run / "trends.png").is_file()  # plot and heatmap write where the page says
    assert (run / "heatmap-mean.png").is_file()


def test_the_finalize_command_show_prints_for_an_unfinished_run_runs(tmp_path: Path) -> None:
    """A live run copied elsewhere is an unfinished run nobody holds: `show` says how to
    complete it, and that command, pasted into a fresh shell, does."""
    model = nn.Sequential(nn.Linear(3, 3))
    live = tmp_path / "live"
    inject_observer(
        model,
        output_dir=live,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=1),
    )
    try:
        model(torch.randn(2, 3))
        model(torch.randn(2, 3))
        deadline = 100
        while not list((live / "history.parts").glob("part-*.parquet")) and deadline:
            torch.randn(1)  # parts are written by the buffer; wait until one is on disk
            deadline -= 1
        copy = tmp_path / "copy"
        shutil.copytree(live, copy, ignore=shutil.ignore_patterns("*.lock", ".lock"))
    finally:
        remove_observer(model)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["show", str(copy), "--width", "2000"]) == 0
    (state_line,) = [line for line in out.getvalue().splitlines() if line.startswith("state:")]
    match = re.search(r"`([^`]+ -m torchinstruments finalize [^`]+)`", state_line)
    assert match is not None, state_line
    result = bash(match.group(1), tmp_path, fresh_shell(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (copy / "history.parquet").is_file()


def test_the_finalize_command_names_a_directory_whose_name_starts_with_a_dash_as_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run directory named `-run`, read by its relative name (after `--`): the printed
    finalize command, pasted into a fresh shell, completes it (`-run` alone would be read as an
    option, and the command would stop at a missing DIR)."""
    model = nn.Sequential(nn.Linear(3, 3))
    live = tmp_path / "live"
    inject_observer(
        model,
        output_dir=live,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=1),
    )
    try:
        model(torch.randn(2, 3))
        model(torch.randn(2, 3))
        deadline = 100
        while not list((live / "history.parts").glob("part-*.parquet")) and deadline:
            torch.randn(1)  # parts are written by the buffer; wait until one is on disk
            deadline -= 1
        shutil.copytree(live, tmp_path / "-run", ignore=shutil.ignore_patterns("*.lock", ".lock"))
    finally:
        remove_observer(model)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["show", "--width", "2000", "--", "-run"]) == 0
    (state_line,) = [line for line in out.getvalue().splitlines() if line.startswith("state:")]
    match = re.search(r"`([^`]+ -m torchinstruments finalize [^`]+)`", state_line)
    assert match is not None, state_line
    result = bash(match.group(1), tmp_path, fresh_shell(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "-run" / "history.parquet").is_file()


def setup_block(run: Path) -> str:
    page = (run / "index.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", page, flags=re.MULTILINE | re.DOTALL)[0]


def run_setup(block: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = block + "\nprint('READ', run, history.select(pl.len()).collect().item())\n"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_index_md_reads_the_run_it_sits_in(tmp_path: Path) -> None:
    original = train(tmp_path / "runs" / "a")
    copy = tmp_path / "copied" / "a"
    shutil.copytree(original, copy)
    rows = pl.read_parquet(original / "history.parquet").height
    # another run now sits where the original was written (a run is told by its start time, to
    # the second: runs started in the same second at the same place would look alike)
    shutil.rmtree(original)
    time.sleep(1.0)
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(3, 3))
    inject_observer(other, output_dir=original, sampler=EveryNForwardsSampler(1))
    other(torch.randn(2, 3))
    remove_observer(other)
    assert pl.read_parquet(original / "history.parquet").height != rows

    block = setup_block(copy)
    from_copy = run_setup(block, copy)
    assert from_copy.returncode == 0, from_copy.stderr
    assert from_copy.stdout.split() == ["READ", str(copy), str(rows)]  # the copy, not the other

    elsewhere = run_setup(block, tmp_path)
    assert elsewhere.returncode == 1
    assert "no other run is read" in elsewhere.stderr
    assert "start Python in the folder that holds this index.md" in elsewhere.stderr
    assert "Traceback" not in elsewhere.stderr


def test_index_md_says_why_a_layer_has_no_gradient_rows(tmp_path: Path) -> None:
    run = train(tmp_path / "run")
    history = pl.read_parquet(run / "history.parquet")
    relu = history.filter(pl.col("layer") == "0")
    assert set(relu["signal"]) == {"output"}  # no gradient rows: its outputs never required grad
    assert set(history.filter(pl.col("layer") == "1")["signal"]) == {"output", "output_gradient"}
    page = (run / "index.md").read_text(encoding="utf-8")
    assert (
        "1 selected layer never returned an output that requires grad, so no gradient can "
        "arrive and it has no output_gradient rows: `0`"
    ) in page


def test_index_md_points_only_to_sections_it_has(tmp_path: Path) -> None:
    run = train(tmp_path / "run")
    page = (run / "index.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^#+ (.+)$", page, flags=re.MULTILINE))
    assert "Interrupted samples" not in headings  # nothing was interrupted in this run
    for named in re.findall(r"\b(?:see|the) ([A-Z][\w ]+?) section\b", page):
        assert named in headings, named
    assert "see Interrupted samples" not in page
    assert "the State section" not in page
