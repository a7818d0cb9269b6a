"""Parts a killed run leaves that this version cannot merge as they are: one cut short (a machine
that lost power after the rename), one an earlier version wrote (without the columns added since),
one a newer version wrote (with columns this one does not know). `finalize` and a restarted job
(`resume=True`) must keep every row they can read, leave the rest in place and say so, and never
lose a row of the attempt that continues the run.

The job (a child forked from this file run once as a script, `_fork_server`, as is the restarted
job) is killed for real (SIGKILL) with several parts on disk; the parts are then damaged or
rewritten with plain Polars, and every expectation is read back from the files with Polars.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import polars as pl
import pytest
import torch
from _fork_server import ForkServer, serve, write_whole
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.layout import list_parts

from conftest import cli_in_process, wait_for_rows

SAMPLES = 6
ROWS_PER_SAMPLE = 2 * 2 * 9  # two Linears, output and gradient, nine metrics
LATER_STEPS = 3  # the restarted attempt's samples
SERIES = ["sample_id", "layer", "signal", "metric"]


def observe(directory: str, *, resume: bool) -> nn.Module:
    """The job's model, observed at every forward; each sample's rows end up in parts of
    their own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=ROWS_PER_SAMPLE // 2),
        resume=resume,
    )
    return model


def killed_attempt(directory: str) -> None:
    """The first attempt: SAMPLES samples, all on disk, then says so (the file `ready` beside
    the run) and waits to be killed."""
    model = observe(directory, resume=False)
    for _ in range(SAMPLES):
        model(torch.randn(4, 3)).sum().backward()
    wait_for_rows(Path(directory), SAMPLES * ROWS_PER_SAMPLE)
    write_whole(Path(directory).parent / "ready", "ready")
    time.sleep(600)  # killed here


def restart(directory: str) -> None:
    """The restarted job: LATER_STEPS samples, then remove_observer; says `removed` beside the
    run."""
    model = observe(directory, resume=True)
    for _ in range(LATER_STEPS):
        model(torch.randn(4, 3)).sum().backward()
    remove_observer(model)
    write_whole(Path(directory).parent / "removed", "removed")


def scenario(root: Path, args: Sequence[str]) -> None:
    """A child of the server (`_fork_server`): the killed attempt, or the restarted job."""
    (killed_attempt if args[0] == "killed" else restart)(args[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This file run once as a script that imported torch: it forks the killed attempt and
    the restarted job when asked, so both cost one import."""
    server = ForkServer(__file__, tmp_path_factory.mktemp("server") / "server.err")
    yield server
    server.close()


@pytest.fixture(scope="module")
def first_attempt(tmp_path_factory: pytest.TempPathFactory, server: ForkServer) -> Path:
    """The first attempt, killed once for the file: `root/run` and a pristine copy beside it
    (`killed_run` restores it for each test; the killed child is the slow part)."""
    root = tmp_path_factory.mktemp("first")
    child = server.start(root, "killed", "killed", root / "run")
    try:
        assert child.wait_for(root / "ready", 120) == "ready"
    finally:
        child.kill()
    shutil.copytree(root / "run", root / "pristine", symlinks=True)
    return root


@pytest.fixture
def killed_run(first_attempt: Path) -> Path:
    """A directory whose first attempt was killed with SAMPLES samples in its parts, as the
    kill left it, at the path it ran in (its state and index.md name that path)."""
    directory = first_attempt / "run"
    shutil.rmtree(directory)
    shutil.copytree(first_attempt / "pristine", directory, symlinks=True)
    assert len(list_parts(directory)) >= 2 * SAMPLES
    return directory


def test_a_restart_after_a_part_was_cut_keeps_every_row_of_the_attempt_that_continues(
    killed_run: Path, server: ForkServer
) -> None:
    directory = killed_run
    parts = list_parts(directory)
    cut = parts[3]
    readable = pl.concat([pl.read_parquet(p) for p in parts if p != cut])
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])

    restarted = server.start(directory.parent, "restart", "restart", directory)
    try:
        code = restarted.wait(300)
    finally:
        restarted.kill()
    assert code == 0, restarted.stderr()
    assert (directory.parent / "removed").read_text(encoding="utf-8") == "removed"

    history = pl.read_parquet(directory / "history.parquet")
    later = history.filter(pl.col("attempt") == 1)
    # every row the restarted attempt recorded, once: none is deleted for a part number that
    # history.parquet already lists as merged
    assert later.height == LATER_STEPS * ROWS_PER_SAMPLE
    assert later["sample_id"].unique().sort().to_list() == list(
        range(SAMPLES, SAMPLES + LATER_STEPS)
    )
    earlier = history.filter(pl.col("attempt") == 0)
    assert earlier.sort(SERIES).equals(readable.sort(SERIES))
    assert history.group_by(SERIES).len()["len"].max() == 1
    assert cut.exists()  # left in place for the user, as index.md says
    state = json.loads((directory / ".state.json").read_text())
    assert state["status"] == "incomplete"
    assert any(cut.name in p for p in state["problems"]), state["problems"]


def test_samples_whose_every_part_was_cut_are_said_to_be_in_those_parts_not_unwritten(
    killed_run: Path,
) -> None:
    directory = killed_run
    held = {p: pl.read_parquet(p)["sample_id"].unique().to_list() for p in list_parts(directory)}
    cut = sorted(p for p, ids in held.items() if ids == [2])
    assert sum(pl.read_parquet(p).height for p in cut) == ROWS_PER_SAMPLE  # all of sample 2
    for part in cut:
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])

    report = finalize(directory)

    history = pl.read_parquet(directory / "history.parquet")
    assert 2 not in history["sample_id"].to_list()
    (gap,) = [p for p in report.problems if "no row of sample 2 " in p]
    names = ", ".join(p.name for p in cut)
    assert f"their rows may be in {names} (unreadable, left in place); else" in gap, gap
    assert all(p.exists() for p in cut)


def earlier_version(part: Path) -> None:
    """Rewrite `part` as a version before the `population` and `attempt` columns wrote it."""
    pl.read_parquet(part).drop("population", "attempt").write_parquet(part)


def test_parts_of_an_earlier_version_are_merged_with_the_later_columns_null(
    killed_run: Path,
) -> None:
    directory = killed_run
    parts = list_parts(directory)
    written = pl.concat([pl.read_parquet(p) for p in parts])
    earlier_rows = sum(pl.read_parquet(p).height for p in parts[::2])
    for part in parts[::2]:
        earlier_version(part)

    report = finalize(directory)

    assert report.merge is not None
    assert report.merge.unreadable_parts == ()
    history = pl.read_parquet(directory / "history.parquet")
    assert history.height == SAMPLES * ROWS_PER_SAMPLE
    columns = [c for c in written.columns if c not in ("population", "attempt")]
    assert history.select(columns).sort(SERIES).equals(written.select(columns).sort(SERIES))
    assert history["population"].null_count() == history.height
    assert history["attempt"].null_count() == earlier_rows  # null in the earlier version's rows
    assert history.filter(pl.col("attempt").is_not_null())["attempt"].unique().to_list() == [0]
    assert not (directory / "history.parts").exists()
    assert not any("history.parquet" in p for p in report.problems), report.problems


def test_a_part_of_a_newer_version_is_left_in_place_naming_the_columns_it_adds(
    killed_run: Path,
) -> None:
    directory = killed_run
    newer = list_parts(directory)[2]
    pl.read_parquet(newer).with_columns(pl.lit(1.0).alias("entropy")).write_parquet(newer)

    report = finalize(directory)

    assert report.merge is not None
    ((left, why),) = report.merge.unreadable_parts
    assert left == newer
    assert newer.exists()
    assert "['entropy']" in why, why
    assert "newer" in why, why
    history = pl.read_parquet(directory / "history.parquet")
    assert history.height == SAMPLES * ROWS_PER_SAMPLE - pl.read_parquet(newer).height

    # the readers then read history.parquet and leave that part out, as for a cut one
    shown = cli_in_process("show", directory, "--width", "200")
    assert shown.returncode == 0, shown.stderr
    assert f"left out: 1 unreadable part in history.parts/, its rows missing: {newer.name})" in (
        shown.stdout
    )
    setup = re.findall(r"```python\n(.*?)```", (directory / "index.md").read_text(), re.DOTALL)[0]
    namespace: dict = {}
    exec(compile(setup, "index.md:setup", "exec"), namespace)
    assert namespace["history"].collect().sort(SERIES).equals(history.sort(SERIES))


if __name__ == "__main__":
    serve(scenario)
