"""Merged parts that removal cannot delete are said, with the disk space they hold.

When history.parts/ is read-only at removal (a folder whose permissions were taken away, a
quota), the merge still writes history.parquet beside it and renames the folder out of the way,
but cannot delete the parts inside: a second copy of every row stays on disk. The run is
complete (no row is missing), so this is no problem of the run; but nothing may be silent:
removal warns, and index.md and the state file say where the copy is and how large it is.
Permissions are taken away for real, in a child process (under root without the capabilities
that let it ignore them, as in test_read_only_directory.py): each child is forked from this
file run once as a script under that prefix (`_fork_server`), so the removal and the continued
attempt cost one import of torch. That removal is run once for the file and restored, as it
left the run, for each test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import polars as pl
import pytest
import torch
from _fork_server import ForkServer, serve
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.layout import list_parts

from _permissions import child_prefix, give_back, prefix_fixture  # noqa: F401 (a fixture)
from conftest import run_cli

STEPS = 4
ROWS_PER_SAMPLE = 2 * len(DEFAULT_METRICS)  # one Linear: output and gradient
GONE = "history.parts.merged.torchinstruments-tmp"


def removal_child(run: Path, steps: int, rows: int) -> None:
    """`steps` sampled steps, every row in a part, history.parts/ made read-only, then
    remove_observer; prints the warnings it gave (a JSON list)."""
    model = nn.Linear(4, 2)
    config = HistoryConfig(buffer_rows=rows // steps)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
    deadline = time.monotonic() + 60
    while sum(pl.scan_parquet(p).select(pl.len()).collect().item() for p in list_parts(run)) < rows:
        assert time.monotonic() < deadline  # every row in a part before the folder is locked
        time.sleep(0.01)
    os.chmod(run / "history.parts", 0o555)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remove_observer(model)
    print(json.dumps([str(w.message) for w in caught]), flush=True)


def resumed_child(run: Path, steps: int) -> None:
    """The run continued for `steps` sampled steps, then removed."""
    model = nn.Linear(4, 2)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remove_observer(model)


def scenario(directory: Path, args: Sequence[str]) -> None:
    """A child of the server: the removal (`args`: run, steps, rows) or the continued attempt
    (run, steps)."""
    if args[0] == "removal":
        removal_child(Path(args[1]), int(args[2]), int(args[3]))
    else:
        resumed_child(Path(args[1]), int(args[2]))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This file run once as a script under `child_prefix()` (`_fork_server`): every child it
    forks meets file permissions as the prefix left them."""
    server = ForkServer(
        __file__, tmp_path_factory.mktemp("server") / "server.err", prefix=child_prefix()
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def removed_once(
    tmp_path_factory: pytest.TempPathFactory, server: ForkServer
) -> Iterator[tuple[Path, str]]:
    """The child's run removed with its parts read-only, once for the file: `root/run`, a
    pristine copy beside it, and the child's stdout (the warnings removal gave)."""
    root = tmp_path_factory.mktemp("removed")
    rows = STEPS * ROWS_PER_SAMPLE
    child = server.start(root, "removal", "removal", root / "run", STEPS, rows, pipes=True)
    try:
        assert child.stdout is not None
        stdout = child.stdout.read()
        code = child.wait(300)
    finally:
        child.kill()
    assert code == 0, child.stderr()
    shutil.copytree(root / "run", root / "pristine", symlinks=True)
    yield root, stdout
    give_back(root)


@pytest.fixture
def removed(removed_once: tuple[Path, str]) -> tuple[Path, str]:
    """The run as that removal left it (read-only parts included), at the path it ran in (its
    state file and index.md name that path); and the child's stdout."""
    root, stdout = removed_once
    give_back(root / "run")
    shutil.rmtree(root / "run")
    shutil.copytree(root / "pristine", root / "run", symlinks=True)
    return root / "run", stdout


def test_merged_parts_removal_cannot_delete_are_warned_and_named_in_index_md(
    removed: tuple[Path, str],
) -> None:
    rows = STEPS * ROWS_PER_SAMPLE
    run, stdout = removed
    said = "\n".join(json.loads(stdout.strip().splitlines()[-1]))
    gone = run / GONE
    copy = sum(p.stat().st_size for p in gone.iterdir())
    # the copy the merge could not delete: every row again
    assert pl.scan_parquet(list(gone.iterdir())).select(pl.len()).collect().item() == rows
    assert pl.read_parquet(run / "history.parquet").height == rows  # the run is whole
    assert f"{gone} could not be deleted after the merge (PermissionError" in said, said
    assert f"a second copy ({copy:,} bytes) of rows history.parquet already holds" in said
    state = json.loads((run / ".state.json").read_text("utf-8"))
    assert state["status"] == "complete"  # no row is missing
    assert [f"{gone} could not be deleted" in line for line in state["left_behind"]] == [True]
    page = (run / "index.md").read_text("utf-8")
    assert f"**Disk space:** {gone} could not be deleted after the merge" in page
    assert f"({copy:,} bytes)" in page


def test_show_says_the_copy_of_rows_an_earlier_merge_left_on_disk(
    removed: tuple[Path, str],
) -> None:
    """`show` says index.md's "Disk space" line too: a second copy of rows history.parquet
    holds, left by the merge, is disk the reader may want back, whichever view they read."""
    run = removed[0]
    gone = run / GONE
    copy = sum(p.stat().st_size for p in gone.iterdir())

    shown = run_cli("show", run)
    assert shown.returncode == 0, shown.stderr

    def unwrapped(text: str) -> str:  # long lines are wrapped, paths too: compare without spaces
        return "".join(text.split())

    text = unwrapped(shown.stdout)
    assert text.count("diskspace:") == 1, shown.stdout
    said = text.split("diskspace:")[1]
    assert said.startswith(unwrapped(f"{gone} could not be deleted after the merge"))
    assert (
        unwrapped(f"a second copy ({copy:,} bytes) of rows history.parquet already holds") in said
    )


FINALIZE = r"""
import sys
from torchinstruments.cli import main
sys.exit(main(["finalize", sys.argv[1]]))
"""


def _finalize(prefix: list[str], run: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-c", FINALIZE, str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_finalize_names_the_merged_parts_it_deletes_or_still_cannot_delete(
    prefix: list[str], removed: tuple[Path, str]
) -> None:
    """The folder removal could not delete is no temporary of a write that did not finish:
    every row in it is in history.parquet. `finalize` says what it is, whether it can delete it
    (permissions given back) or still cannot (then index.md keeps saying where the copy is)."""
    rows = STEPS * ROWS_PER_SAMPLE
    run = removed[0]
    gone = run / GONE

    still = _finalize(prefix, run)
    assert still.returncode == 0, still.stderr
    assert "incomplete temporary" not in still.stdout + still.stderr
    assert f"could not delete {gone}, the merged parts an earlier merge left" in still.stderr
    assert still.stderr.count(str(gone)) == 1  # said once, with why
    state = json.loads((run / ".state.json").read_text("utf-8"))
    assert state["status"] == "complete"
    assert [f"{gone} could not be deleted" in line for line in state["left_behind"]] == [True]
    assert f"**Disk space:** {gone} could not be deleted" in (run / "index.md").read_text("utf-8")

    gone.chmod(0o755)  # the permissions given back
    given_back = _finalize(prefix, run)
    assert given_back.returncode == 0, given_back.stderr
    assert "incomplete temporary" not in given_back.stdout
    assert (
        f"removed {gone}, the merged parts an earlier merge left (a second copy of rows "
        "history.parquet holds)"
    ) in given_back.stdout
    assert not gone.exists()
    assert pl.read_parquet(run / "history.parquet").height == rows
    state = json.loads((run / ".state.json").read_text("utf-8"))
    assert (state["status"], state["left_behind"]) == ("complete", [])
    assert "**Disk space:**" not in (run / "index.md").read_text("utf-8")


def test_a_run_continued_beside_merged_parts_it_cannot_delete_merges_every_row(
    server: ForkServer, removed: tuple[Path, str], tmp_path: Path
) -> None:
    """The next attempt's merge finds the folder the last one could not delete where it would
    rename its own merged parts: history.parquet still gets every row and the run is complete,
    with both copies said, never a merge said to have failed."""
    rows = STEPS * ROWS_PER_SAMPLE
    run = removed[0]
    later = server.start(tmp_path, "resumed", "resumed", run, 2)
    try:
        code = later.wait(300)
    finally:
        later.kill()
    assert code == 0, later.stderr()
    history = pl.read_parquet(run / "history.parquet")
    assert history.group_by("attempt").len().sort("attempt").rows() == [
        (0, rows),
        (1, 2 * ROWS_PER_SAMPLE),
    ]
    state = json.loads((run / ".state.json").read_text("utf-8"))
    assert (state["status"], state["problems"]) == ("complete", [])
    assert [f"{run / GONE} could not be deleted" in line for line in state["left_behind"]] == [True]
    assert not list((run / "history.parts").iterdir())


if __name__ == "__main__":
    serve(scenario)
