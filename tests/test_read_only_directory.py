"""A run directory made read-only mid-run: memory stays capped and removal still says what is lost.

Permissions are taken away for real (`chmod` of the run directory, so every new file, rename and
deletion there fails with EACCES, while files already open stay writable), in a child process:
root ignores permissions, so under root the child runs without the capabilities that let it
(`setpriv`, skipped where that is missing). Nothing is injected. Removal cannot delete the disk reserve there; it must still write what it can, warn
about every row it could not write, and release the run's lock.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.state import Status, read_state

from _permissions import prefix_fixture, run_fixture  # noqa: F401 (fixtures)
from conftest import cli_in_process, kill_when_ready, rows_in_parts, wait_for_rows

SAMPLES = 45  # what CHILD takes: 5 before the change, 40 after
ROWS_PER_SAMPLE = 18  # one Linear, default metrics, output and gradient

CHILD = r"""
import fcntl, json, os, sys, time, warnings
from pathlib import Path
import torch
from torch import nn
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.cli.reader import state_sentence
from torchinstruments.rundir.state import read_state
from torchinstruments.rundir.write_trouble import read_trouble

run = sys.argv[1]
torch.manual_seed(0)
model = nn.Linear(4, 2)
x = torch.randn(3, 4)
config = HistoryConfig(buffer_rows=18, max_buffered_rows=1800, flush_seconds=3600.0)
inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
for _ in range(5):  # one part a sample: 18 rows
    model(x).sum().backward()
for folder, _, _ in os.walk(run):
    os.chmod(folder, 0o555)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(40):
        model(x).sum().backward()
    deadline = time.monotonic() + 60  # the flush thread's first failed part write says it
    while read_trouble(Path(run)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    live = state_sentence(Path(run), read_state(Path(run)))  # as show and compare say it
    remove_observer(model)
with open(os.path.join(run, ".lock"), "rb") as lock:  # a second open file: its own lock
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        released = True
    except OSError:
        released = False
said = [str(w.message) for w in caught]
print(json.dumps({"warnings": said, "lock_released": released, "live": live}))
"""


def run_child(prefix: list[str], run: Path) -> dict[str, object]:
    """Run CHILD on `run`; its JSON report."""
    done = subprocess.run(
        [*prefix, sys.executable, "-c", CHILD, str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_removal_in_a_read_only_directory_counts_every_unwritten_row_and_releases_the_lock(
    prefix: list[str], run: Path
) -> None:
    report = run_child(prefix, run)
    said = "\n".join(report["warnings"])  # type: ignore[arg-type]
    assert "is detached" not in said, said  # the run directory finished its close
    assert ".state.json could not be written" in said, said
    assert "index.md could not be written" in said, said
    # every row not in a part before the change is counted, with its samples (18 rows a sample)
    on_disk = rows_in_parts(run)
    lost = re.search(r"([\d,]+) rows of samples (\d+)-(\d+) were recorded but not written", said)
    assert lost is not None, said
    assert int(lost[1].replace(",", "")) + on_disk == SAMPLES * ROWS_PER_SAMPLE
    assert (int(lost[2]), int(lost[3])) == (on_disk // ROWS_PER_SAMPLE, SAMPLES - 1)
    assert report["lock_released"] is True
    # Readers never call it a run going on as before: while it lived, the state file (written
    # before the change) said "in progress", and its lock file why nothing reached the disk;
    # after its removal, that it is not live, and why its state file still says so.
    assert str(report["live"]).startswith(
        "in progress, but recording nothing to its directory since "
    ), report["live"]
    assert "no history.parts/ part could be written (PermissionError" in str(report["live"])
    shown = cli_in_process("show", run, "--format", "json")
    assert shown.returncode == 0, shown.stderr
    state = json.loads(shown.stdout)["run"]["state"]
    assert state.startswith("interrupted: its writes failed since "), state
    assert "remove_observer ended the run, but its .state.json could not be written" in state
    assert "no process holds the run's lock" in state
    compared = cli_in_process("compare", run, run, "--format", "csv")
    assert f"{run}: state: {state}" in compared.stderr

    # Permissions back: no state on disk says the run ended, so finalize takes it for a killed
    # one, and the TensorBoard events (their file was open before the change) name the samples
    # whose rows are missing.
    for folder, _, _ in os.walk(run):
        os.chmod(folder, 0o755)
    finalize(run)
    assert read_state(run).status is Status.INTERRUPTED
    index = (run / "index.md").read_text()
    first, last = int(lost[2]), int(lost[3])
    missing = f"histograms of {last - first + 1} sampled forward(s) that have no row in history"
    assert f"{missing}.parquet: forward_index {first}-" in index, index


def killed(run: str) -> None:
    """A run killed with KILLED_SAMPLES samples on disk (this file run as a script)."""
    import torch
    from torch import nn

    from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer

    model = nn.Linear(4, 2)
    config = HistoryConfig(buffer_rows=ROWS_PER_SAMPLE)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), history_config=config)
    for _ in range(KILLED_SAMPLES):
        model(torch.randn(3, 4)).sum().backward()
    wait_for_rows(Path(run), KILLED_SAMPLES * ROWS_PER_SAMPLE)
    print("ready", flush=True)
    time.sleep(600)  # killed here


KILLED_SAMPLES = 3


def test_finalize_of_a_directory_it_may_not_write_says_each_file_it_could_not_write(
    prefix: list[str], run: Path
) -> None:
    kill_when_ready(__file__, "ready", run)
    # what a kill during the merge leaves: the merged file's temporary
    leftover = run / "history.parquet.torchinstruments-tmp"
    leftover.write_bytes(b"PAR1")
    for folder, _, _ in os.walk(run):
        os.chmod(folder, 0o555)

    done = subprocess.run(
        [*prefix, sys.executable, "-m", "torchinstruments", "finalize", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )

    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    said = done.stderr
    assert f"could not remove temporary {leftover} (PermissionError" in said, said
    assert "merging history.parts/ into history.parquet failed (PermissionError" in said, said
    assert ".state.json could not be written (PermissionError" in said, said
    assert "index.md could not be written (PermissionError" in said, said
    assert not (run / "history.parquet").exists()

    # permissions back: the same command finishes it, every row written before the kill kept
    for folder, _, _ in os.walk(run):
        os.chmod(folder, 0o755)
    report = finalize(run)
    assert leftover in report.removed_temporaries
    assert report.kept_temporaries == ()
    history = pl.read_parquet(run / "history.parquet")
    assert history.height == KILLED_SAMPLES * ROWS_PER_SAMPLE
    assert history["sample_id"].unique().sort().to_list() == list(range(KILLED_SAMPLES))


if __name__ == "__main__":
    killed(sys.argv[1])
