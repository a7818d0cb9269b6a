"""Reading `history.parts/` while a live run writes parts: every read succeeds, none is partial.

A part is written under a temporary name outside `history.parts/` and renamed into it, so a
reader of the directory (`pl.read_parquet(run / "history.parts")`, which refuses a directory
holding files of different extensions), of its `*.parquet` glob, or through index.md's own
`history_of` only ever sees completed parts. The writer is a child process (forked from this
file run once as a script, `_fork_server`) writing one part per sample as fast as it can; this process reads in a loop until the child has written its parts,
then on while `remove_observer` merges them: once history.parquet is in place the folder is taken
away in one rename, so a reader of it gets every row or an error, never fewer rows, and
`history_of` gets every row at any moment. Before the first part the folder is empty: reading it
fails (as documented), and `history_of` says no part was written yet.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

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
from torchinstruments.cli.reader import read_history
from torchinstruments.rundir import merge
from torchinstruments.rundir.layout import list_parts

from conftest import wait_for_rows

PARTS = 60
ROWS_PER_PART = 2 * len(DEFAULT_METRICS)  # one Linear: its output and its output gradient
WAIT_S = 120.0


def child_main(directory: Path) -> None:
    """The writer: one part per sample, PARTS of them, then wait for the reader to finish."""
    model = nn.Linear(4, 4)
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=ROWS_PER_PART),
    )
    for _ in range(PARTS):
        model(torch.randn(2, 4)).sum().backward()
    wait_for_rows(directory, PARTS * ROWS_PER_PART)  # the flush thread writes the later ones
    (directory.parent / "written").touch()
    sys.stdin.read()  # the reader closes stdin when it has read the last part
    remove_observer(model)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This file run once as a script that imported torch: it forks each test's child when the
    test asks (`_fork_server`), so the two children cost one import."""
    server = ForkServer(__file__, tmp_path_factory.mktemp("server") / "server.err")
    yield server
    server.close()


def history_reader(run: Path) -> Callable[[Path], pl.LazyFrame]:
    """index.md's own `history_of`, from its setup block (run as printed, but not called)."""
    text = (run / "index.md").read_text(encoding="utf-8")
    setup = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "history = history_of(run)" in setup
    namespace: dict[str, Any] = {}
    exec(compile(setup.replace("history = history_of(run)", ""), "index.md", "exec"), namespace)
    return namespace["history_of"]


def child_first_sample(directory: Path) -> None:
    """Inject, wait for a line on stdin, take one sample, wait for stdin to close, remove."""
    model = nn.Linear(4, 4)
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    print("injected", flush=True)
    sys.stdin.readline()
    model(torch.randn(2, 4)).sum().backward()
    print("sampled", flush=True)
    sys.stdin.read()
    remove_observer(model)


def test_before_the_first_part_readers_are_told_and_right_after_it_they_read(
    tmp_path: Path, server: ForkServer
) -> None:
    run = tmp_path / "stats"
    parts_dir = run / "history.parts"
    child = server.start(tmp_path, "child", run, "first", pipes=True)
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "injected"
        history_of = history_reader(run)
        assert list(parts_dir.iterdir()) == []  # the moment before the first part
        with pytest.raises(pl.exceptions.ComputeError):  # as README and index.md say
            pl.read_parquet(parts_dir)
        with pytest.raises(SystemExit, match=r"no part written yet .* first sample writes"):
            history_of(run)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "sampled"
        # its rows are on disk right after the sample, not a flush interval later
        assert pl.read_parquet(parts_dir).height == ROWS_PER_PART
        assert history_of(run).collect().height == ROWS_PER_PART
    finally:
        code = child.close(timeout=60)
    assert code == 0, child.stderr()
    assert history_of(run).collect().height == ROWS_PER_PART  # now history.parquet
    assert not parts_dir.exists()


def test_reading_history_parts_while_parts_are_written_never_fails(
    tmp_path: Path, server: ForkServer
) -> None:
    run = tmp_path / "stats"
    parts_dir = run / "history.parts"
    child = server.start(tmp_path, "child", run, pipes=True)
    failures: list[str] = []
    during_merge: list[int | None] = []
    merged: list[int] = []
    reads = 0
    parts_seen: set[int] = set()
    try:
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "written").exists():
            assert child.poll() is None, child.stderr()
            assert time.monotonic() < deadline, "the writer did not finish in time"
            if not list_parts(run):
                time.sleep(0.005)
                continue
            for read in (
                lambda: pl.read_parquet(parts_dir),
                lambda: pl.read_parquet(parts_dir / "*.parquet"),
                lambda: (
                    pl.scan_parquet(sorted(parts_dir.glob("part-*.parquet")), glob=False)
                    .select(pl.len())
                    .collect()
                ),
            ):
                try:
                    frame = read()
                except Exception as error:  # every kind of failure counts
                    failures.append(f"{type(error).__name__}: {error}")
                    continue
                reads += 1
                if "sample_id" in frame.columns:
                    parts_seen.add(frame.height // ROWS_PER_PART)
        # removal: the merge, then the parts taken away; read all the while
        history_of = history_reader(run)
        child.close_stdin()
        while child.poll() is None:
            try:
                during_merge.append(pl.read_parquet(parts_dir).height)
            except (OSError, pl.exceptions.ComputeError):  # gone: history.parquet holds them
                during_merge.append(None)
            merged.append(history_of(run).collect().height)
    finally:
        code = child.close(timeout=60)
    assert code == 0, child.stderr()
    assert failures == []
    every = PARTS * ROWS_PER_PART
    assert set(during_merge) <= {every, None}, sorted(set(during_merge), key=str)  # never fewer
    assert set(merged) == {every}
    assert len(merged) >= 3
    # The reads really overlapped the writes: they saw the directory at many sizes.
    assert len(parts_seen) >= 10, sorted(parts_seen)
    assert reads >= 30
    assert pl.read_parquet(run / "history.parquet").height == PARTS * ROWS_PER_PART


def test_a_continued_runs_live_attempt_is_read_with_the_earlier_attempts(tmp_path: Path) -> None:
    """While a continued run's attempt runs, history.parquet holds the earlier attempts and
    history.parts/ its own rows: index.md's `history_of` reads both, and once the removal's
    merge put the parts in history.parquet, a part still beside it (a kill before the parts
    were taken away) is read once, never twice."""
    run = tmp_path / "stats"
    model = nn.Linear(4, 4)
    config = HistoryConfig(buffer_rows=ROWS_PER_PART)
    sampler = EveryNForwardsSampler(1)
    inject_observer(model, output_dir=run, sampler=sampler, history_config=config)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    inject_observer(model, output_dir=run, sampler=sampler, history_config=config, resume=True)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    wait_for_rows(run, 2 * ROWS_PER_PART)
    history_of = history_reader(run)  # the page the continued attempt wrote at its inject
    live = history_of(run).collect()
    parts = {p.name: p.read_bytes() for p in list_parts(run)}
    remove_observer(model)
    final = pl.read_parquet(run / "history.parquet")
    assert final.group_by("attempt").agg(pl.col("sample_id").unique().sort()).sort(
        "attempt"
    ).rows() == [(0, [0, 1, 2]), (1, [3, 4])]
    order = ["sample_id", "signal", "metric"]
    assert live.sort(order).equals(final.sort(order))
    (run / "history.parts").mkdir()
    for name, data in parts.items():  # as a kill between the merge and the parts' removal
        (run / "history.parts" / name).write_bytes(data)
    assert history_of(run).collect().sort(order).equals(final.sort(order))


def test_a_reader_overtaken_by_a_continued_runs_merge_reads_each_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`show` and the other commands list history.parquet and the parts beside it, then read
    them. The continued attempt's removal puts a history.parquet that holds those parts in
    place before it takes the parts away: a reading in between read their rows twice."""
    run = tmp_path / "stats"
    model = nn.Linear(4, 4)
    config = HistoryConfig(buffer_rows=ROWS_PER_PART)
    sampler = EveryNForwardsSampler(1)
    inject_observer(model, output_dir=run, sampler=sampler, history_config=config)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    inject_observer(model, output_dir=run, sampler=sampler, history_config=config, resume=True)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    wait_for_rows(run, 2 * ROWS_PER_PART)
    overtaken: list[bool] = []

    def merged_meanwhile(history: pl.LazyFrame) -> pl.LazyFrame:
        if not overtaken:  # the removal's merge, up to the parts' removal, after the listing
            with monkeypatch.context() as patch:
                patch.setattr(merge, "_take_parts_away", lambda *_: [])
                merge.merge_history(run)
            overtaken.append(True)
        return history

    rows = read_history(run, merged_meanwhile)
    remove_observer(model)
    assert overtaken
    assert rows.height == 5 * ROWS_PER_PART
    assert rows.select("sample_id", "signal", "metric").is_unique().all()
    assert sorted(rows["sample_id"].unique()) == [0, 1, 2, 3, 4]


def scenario(root: Path, args: Sequence[str]) -> None:
    """A child of the server (`_fork_server`): the writer, or the first sample's child."""
    if args[1:] == ["first"]:
        child_first_sample(Path(args[0]))
    else:
        child_main(Path(args[0]))


if __name__ == "__main__":
    serve(scenario)
