"""A parent of rank runs is read with the ranks its readers can read, and each rank they leave
out is said as it is: a rank whose process ended before its first part is said to have ended
(its lock tells), never "in progress, or ..."; a rank whose history part was cut short before
`finalize` is named with the file and the finalize of that rank to run, and the other ranks are
read (exit 0, as for ranks without history). Every rank is written by a real observer."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

from test_rank_parent_readers import observe_rank

from torchinstruments import remove_observer
from torchinstruments.rundir.layout import list_parts

from conftest import cli_in_process


def test_a_rank_whose_process_ended_before_its_first_part_is_said_to_have_ended(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stats"
    observe_rank(parent, 0)
    waiting = observe_rank(parent, 1, forwards=0, remove=False)  # no sample written yet
    try:
        # A copy of the parent is as a kill leaves it: rank 1 still in progress, and no process
        # holds its lock, so it is said to have ended, never "in progress, or ...".
        copy = tmp_path / "copy"
        shutil.copytree(parent, copy)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remove_observer(waiting)
    done = cli_in_process("show", copy, "--width", "200")
    assert done.returncode == 0, done.stderr
    assert (
        "not read, no history: rank 1: no sample written yet (its process ended before its "
        "first part, killed or crashed: no process holds its lock)"
    ) in done.stdout


def test_a_parent_reads_every_rank_but_one_whose_part_is_damaged_and_names_what_to_run(
    tmp_path: Path,
) -> None:
    """Before `finalize`, a rank's part cut short (a copy, a power loss) leaves that rank
    unread, named with its file and the finalize of that rank to run; the others are read."""
    parent = tmp_path / "stats"
    observe_rank(parent, 0, world_size=3)
    observe_rank(parent, 2, world_size=3)
    live = observe_rank(parent, 1, world_size=3, forwards=1, remove=False)  # its part at once
    rank = parent / "rank-001"
    cut = list_parts(rank)[0]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    said = f"not read, rank 1: damaged history: {cut}: unreadable (not a whole Parquet file"
    try:
        for command in ("show", "compare"):
            done = cli_in_process(command, parent, "--width", "2000")
            assert done.returncode == 0, done.stderr
            assert said in done.stdout
            assert f"torchinstruments finalize {rank}` merges the readable parts" in done.stdout
            assert f"ranks: {parent} (2 ranks: 0, 2)" in done.stdout
        done = cli_in_process("show", parent, "--format", "json")
        assert done.returncode == 0, done.stderr
        assert done.stderr.startswith(f"torchinstruments show: {said}")
        assert json.loads(done.stdout)["run"]["ranks"] == [0, 2]
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            remove_observer(live)
