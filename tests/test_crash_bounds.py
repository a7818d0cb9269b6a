"""Loss on a crash is bounded by time: real training processes killed with SIGKILL and SIGTERM.

The child (this file run as a script) trains with the default settings except two: every root
forward is sampled (so there is something to lose) and `HistoryConfig(flush_seconds=...)` is
short. At the default `buffer_rows=8192` the child never fills a chunk in its lifetime
(`ROWS_PER_SAMPLE` rows per step, about `1 / STEP_SLEEP_S` steps per second), so every part on
disk was written because of the time bound, not the row bound.

The child prints `step K T` after step K, where T is its wall clock: every row of sample K was
measured (and appended) before T. The parent kills the child at wall time `killed_at`. Each
test's child is forked from one interpreter that imported torch (this file run as a script),
all of them at once: their time is mostly steps' sleeps and the wait for steps a flush interval
old, which they spend together; the parent kills each at its own point (`kill_when_old`). The
guarantee under test: every sample printed before `killed_at - FLUSH_SECONDS` is complete in
`history.parts/` and in the TensorBoard events (all three layers are focus layers). The run
directory's name holds glob characters, a space and non-ASCII letters, so that the live writer,
the merge and `finalize` are exercised on a path that must be used literally.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from _forked import before_forking, ended
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    EventAccumulator,
)
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)

from conftest import run_status, sgd_step

FLUSH_SECONDS = 1.0
LAYERS = 3  # Linear, Tanh, Linear: all three are focus layers and get a gradient
ROWS_PER_SAMPLE = LAYERS * len(DEFAULT_METRICS) * 2  # x 2 signals
STEP_SLEEP_S = 0.1
CHILD_LIFETIME_S = 120.0  # the child stops on its own if the parent never kills it
WAIT_S = 90.0
OLD_STEPS_BEFORE_KILL = 15  # steps printed at least one flush interval before the kill
RUN_NAME = "exp[lr=0.1]{a,b} ?*~ ü"  # glob characters, a space, non-ASCII
TAGS = [
    f"{layer}/call_0/{signal}/tensor"
    for layer in ("0", "1", "2")
    for signal in ("output", "output_gradient")
]


def child_main(directory: Path, mode: str) -> None:
    """Train until killed. mode "plain": no SIGTERM handler of its own; "chained": the
    program installs its own SIGTERM handler first (as frameworks do), which writes a marker
    and exits with status 143; "one_row_parts": rank 1 of 2 (the launcher's environment,
    `rank_policy="all"`) with the smallest parts, `buffer_rows=1`, many more than its flush
    thread writes in a flush interval."""
    torch.set_num_threads(1)
    ranked = mode == "one_row_parts"
    rows = {"buffer_rows": 1} if ranked else {}
    if ranked:
        os.environ.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    if mode == "chained":

        def on_term(signum: int, frame: Any) -> None:
            (directory.parent / "handler-ran").write_text(str(signum), encoding="utf-8")
            sys.exit(143)

        signal.signal(signal.SIGTERM, on_term)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    x, y = torch.randn(64, 6), torch.randn(64, 1)
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(flush_seconds=FLUSH_SECONDS, **rows),
        rank_policy="all" if ranked else "rank0",
    )
    deadline = time.monotonic() + CHILD_LIFETIME_S
    step = 0
    while time.monotonic() < deadline:
        sgd_step(model, x, y, 0.01)
        print(f"step {step} {time.time():.6f}", flush=True)
        step += 1
        time.sleep(STEP_SLEEP_S)


def printed_steps(log: Path) -> dict[int, float]:
    """Step number -> wall time printed after it."""
    steps = {}
    for line in log.read_text("utf-8").splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "step":
            steps[int(words[1])] = float(words[2])
    return steps


def part_files(directory: Path) -> list[Path]:
    """Completed parts, listed without any glob pattern."""
    parts = directory / "history.parts"
    if not parts.is_dir():
        return []
    return sorted(
        p for p in parts.iterdir() if p.name.startswith("part-") and p.name.endswith(".parquet")
    )


def read_parts(directory: Path) -> pl.DataFrame:
    """All rows of the completed parts."""
    frames = [pl.read_parquet(p, glob=False) for p in part_files(directory)]
    assert frames, "no part on disk"
    return pl.concat(frames)


def event_steps(directory: Path) -> dict[str, set[int]]:
    """Histogram tag -> steps (sample ids), as TensorBoard reads the event files."""
    accumulator = EventAccumulator(str(directory / "tensorboard"), size_guidance={HISTOGRAMS: 0})
    accumulator.Reload()
    tags: dict[str, Any] = accumulator.Tags()
    return {tag: {e.step for e in accumulator.Histograms(tag)} for tag in tags["histograms"]}


# Each test's child: its mode, the signal that kills it, its exit status then, and how many of
# its steps must be older than two flush intervals when it is killed.
KILLS = {
    "sigkill": ("plain", signal.SIGKILL, -signal.SIGKILL, OLD_STEPS_BEFORE_KILL),
    "one-row-parts": ("one_row_parts", signal.SIGKILL, -signal.SIGKILL, 10),
    "sigterm": ("plain", signal.SIGTERM, -signal.SIGTERM, OLD_STEPS_BEFORE_KILL),
    "chained": ("chained", signal.SIGTERM, 143, OLD_STEPS_BEFORE_KILL),
}
KILLED = "killed.json"


def old_enough(log: Path, old_steps: int) -> bool:
    """Whether `old_steps` of the steps in `log` were printed two flush intervals ago."""
    old = [s for s, t in printed_steps(log).items() if t < time.time() - 2 * FLUSH_SECONDS]
    return len(old) >= old_steps


def kill_when_old(root: Path, names: list[str]) -> str | None:
    """In the script: every named child (`KILLS`) forked at once, its output in
    `root/<name>/child.log`; each gets its signal once its steps are old enough (or after
    `WAIT_S`: said as late), and SIGKILL a minute after a signal it outlived. Returns the name in
    the child; in this process writes the exit statuses and kill times to `root/killed.json`
    once every child ended, and ends (`_forked.ended`)."""
    running: dict[str, int] = {}
    for name in names:
        (root / name).mkdir()
        (root / name / "child.log").touch()  # read from here while the child starts
        before_forking()
        pid = os.fork()
        if pid == 0:
            log = os.open(root / name / "child.log", os.O_WRONLY)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
            return name
        running[name] = pid
    start = time.monotonic()
    codes: dict[str, int] = {}
    killed_at: dict[str, float] = {}
    signalled: dict[str, float] = {}
    late: list[str] = []
    while running:
        for name, pid in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[name] = os.waitstatus_to_exitcode(status)
                del running[name]
            elif name not in signalled:
                old = old_enough(root / name / "child.log", KILLS[name][3])
                if old or time.monotonic() - start > WAIT_S:
                    late += [] if old else [name]
                    killed_at[name], signalled[name] = time.time(), time.monotonic()
                    os.kill(pid, KILLS[name][1])
            elif time.monotonic() - signalled[name] > 60:
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    report = {"codes": codes, "killed_at": killed_at, "late": late}
    (root / KILLED).write_text(json.dumps(report), encoding="utf-8")
    ended()


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test's child killed at its point (this file as the script, `kill_when_old`)."""
    root = tmp_path_factory.mktemp("killed")
    done = subprocess.run(
        [sys.executable, __file__, str(root), *KILLS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return root


def killed_run(root: Path, name: str) -> tuple[Path, dict[int, float], float]:
    """The child of `name` as its kill left it: its run directory, the steps it printed and the
    kill time; it must have been killed in time and ended with the exit status of `KILLS`."""
    report, log = json.loads((root / KILLED).read_text("utf-8")), root / name / "child.log"
    assert name in report["killed_at"], f"training child exited early:\n{log.read_text('utf-8')}"
    assert name not in report["late"], f"fewer than {KILLS[name][3]} steps after {WAIT_S} s"
    assert report["codes"][name] == KILLS[name][2], log.read_text("utf-8")
    return root / name / RUN_NAME, printed_steps(log), report["killed_at"][name]


def assert_bound(
    directory: Path, steps: dict[int, float], killed_at: float, *, by_time: bool = True
) -> set[int]:
    """Every step printed one flush interval before the kill is complete in the parts and in the
    TensorBoard events; returns the sample ids in the parts (`by_time`: every part was written
    by the time bound, none by the row bound)."""
    old = {s for s, t in steps.items() if t < killed_at - FLUSH_SECONDS}
    assert len(old) >= (OLD_STEPS_BEFORE_KILL if by_time else 1)
    rows = read_parts(directory)
    per_sample = dict(rows.group_by("sample_id").len().iter_rows())
    missing = sorted(s for s in old if per_sample.get(s) != ROWS_PER_SAMPLE)
    assert not missing, f"samples older than {FLUSH_SECONDS} s not (fully) in the parts: {missing}"
    # no part is larger than the rows of the run so far: the row bound never triggered
    assert rows.height < HistoryConfig().buffer_rows or not by_time
    events = event_steps(directory)
    assert set(events) == set(TAGS)
    for tag in TAGS:
        assert old <= events[tag], (tag, sorted(old - events[tag]))
    # both hold only samples that were really measured (at most the step in flight besides)
    printed = set(steps)
    assert set(per_sample) <= printed | {max(printed) + 1}
    for tag in TAGS:
        assert events[tag] <= printed | {max(printed) + 1}
    return set(per_sample)


def finalize_cli(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchinstruments", "finalize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_sigkill_loses_at_most_one_flush_interval_and_finalize_completes(killed: Path) -> None:
    directory, steps, killed_at = killed_run(killed, "sigkill")
    assert not (directory / "history.parquet").exists()
    in_parts = assert_bound(directory, steps, killed_at)
    parts_rows = read_parts(directory).height

    done = finalize_cli(directory)
    assert done.returncode == 0, done.stderr
    history = pl.read_parquet(directory / "history.parquet", glob=False)
    assert history.height == parts_rows
    assert set(history["sample_id"].unique().to_list()) == in_parts
    assert part_files(directory) == []
    index = (directory / "index.md").read_text("utf-8")
    # a killed run is never called complete: what it held in memory is unknown
    assert run_status(directory) == "interrupted"
    assert f"flush_seconds={FLUSH_SECONDS}" in index
    assert "state: interrupted" in done.stdout  # the CLI says the same
    shown = subprocess.run(
        [sys.executable, "-m", "torchinstruments", "show", str(directory), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["run"]["state"].startswith("interrupted")


def test_sigkill_of_a_rank_writing_one_row_parts_loses_at_most_one_flush_interval(
    killed: Path,
) -> None:
    """With `buffer_rows=1` its flush thread writes a part a row, far fewer rows a second than
    a sample a step records: once the oldest is due, every buffered row goes at once, so the
    time bound holds (before, the rows waited behind the one-row parts, seconds old)."""
    directory, steps, killed_at = killed_run(killed, "one-row-parts")
    rank = directory / "rank-001"
    assert_bound(rank, steps, killed_at, by_time=False)
    sizes = [pl.read_parquet(p, glob=False).height for p in part_files(rank)]
    assert max(sizes) > 1  # the time bound's parts: more than buffer_rows rows
    assert sizes.count(1) > 0  # and the row bound's


def test_sigterm_flushes_everything_then_ends_with_the_default_action(killed: Path) -> None:
    directory, steps, killed_at = killed_run(killed, "sigterm")
    in_parts = assert_bound(directory, steps, killed_at)
    # SIGTERM loses no more than SIGKILL, and in fact nothing that was measured before it:
    # every printed step is in the parts and in the events.
    assert set(steps) <= in_parts
    for tag, found in event_steps(directory).items():
        assert set(steps) <= found, tag

    done = finalize_cli(directory)
    assert done.returncode == 0, done.stderr
    history = pl.read_parquet(directory / "history.parquet", glob=False)
    assert set(steps) <= set(history["sample_id"].unique().to_list())


def test_sigterm_chains_to_the_handler_installed_before(killed: Path) -> None:
    directory, steps, _ = killed_run(killed, "chained")
    assert (killed / "chained" / "handler-ran").read_text("utf-8") == str(int(signal.SIGTERM))
    # the program's own handler ended it with SystemExit, so the run finished normally
    # (interpreter exit finalizes an unremoved observer): complete, with every printed step
    history = pl.read_parquet(directory / "history.parquet", glob=False)
    assert set(steps) <= set(history["sample_id"].unique().to_list())
    assert run_status(directory) == "complete"
    assert part_files(directory) == []


def in_process_run(directory: Path) -> nn.Module:
    """Inject into a small model (default buffer and flush interval) and take three samples."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        model(torch.randn(4, 6)).sum().backward()
    # The first sample's rows were written at once; the other two are still in memory.
    assert read_parts(directory)["sample_id"].unique().to_list() == [0]
    assert read_parts(directory).height == ROWS_PER_SAMPLE
    return model


def test_sigterm_handler_chains_in_process_and_is_restored(tmp_path: Path) -> None:
    calls: list[int] = []

    def mine(signum: int, frame: Any) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        model = in_process_run(tmp_path / "run")
        assert signal.getsignal(signal.SIGTERM) is not mine
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]  # chained to the handler installed before
        assert read_parts(tmp_path / "run").height == 3 * ROWS_PER_SAMPLE  # flushed first
        remove_observer(model)
        assert signal.getsignal(signal.SIGTERM) is mine  # restored at removal
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_handler_installed_over_ours_that_calls_ours_decides_what_sigterm_does(
    tmp_path: Path,
) -> None:
    """Lightning's pattern: a handler installed after inject calls the one it found (ours) and
    ends the program its own way. Ours flushes and returns: it never re-raises the default
    action, which without the library that handler would have found and not called."""
    calls: list[int] = []
    previous = signal.getsignal(signal.SIGTERM)
    try:
        model = in_process_run(tmp_path / "run")
        ours = signal.getsignal(signal.SIGTERM)
        assert callable(ours)

        def framework(signum: int, frame: Any) -> None:
            calls.append(signum)
            ours(signum, frame)

        signal.signal(signal.SIGTERM, framework)
        os.kill(os.getpid(), signal.SIGTERM)  # the test process lives on
        assert calls == [signal.SIGTERM]
        assert read_parts(tmp_path / "run").height == 3 * ROWS_PER_SAMPLE  # flushed first
        signal.signal(signal.SIGTERM, ours)
        remove_observer(model)
        assert run_status(tmp_path / "run") == "complete"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ignored_sigterm_stays_ignored(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model = in_process_run(tmp_path / "run")
        os.kill(os.getpid(), signal.SIGTERM)  # still ignored: this test goes on
        assert read_parts(tmp_path / "run").height == 3 * ROWS_PER_SAMPLE
        model(torch.randn(4, 6)).sum().backward()
        remove_observer(model)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        history = pl.read_parquet(tmp_path / "run" / "history.parquet", glob=False)
        assert history.height == 4 * ROWS_PER_SAMPLE
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_rows_are_written_when_sampling_stops(tmp_path: Path) -> None:
    """The time bound does not depend on later samples: one sample, then no forward at all."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    inject_observer(
        model,
        output_dir=tmp_path / "run",
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(flush_seconds=0.5),
    )
    try:
        model(torch.randn(4, 6)).sum().backward()
        deadline = time.monotonic() + 30  # generous: only a hung flush thread fails this
        while not part_files(tmp_path / "run") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_parts(tmp_path / "run").height == ROWS_PER_SAMPLE
        assert set(event_steps(tmp_path / "run")) == set(TAGS)  # events flushed with them
    finally:
        remove_observer(model)


def test_a_continuously_sampled_run_writes_one_part_per_half_flush_interval(
    tmp_path: Path,
) -> None:
    """The age that makes rows due is that of the oldest row still buffered: rows appended while
    a part was written wait their own half interval, so parts do not follow each other back to
    back (before, hundreds of tiny parts in a few seconds after the first time-triggered one)."""
    flush_seconds, duration = 1.0, 4.0
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    inject_observer(
        model,
        output_dir=tmp_path / "run",
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(flush_seconds=flush_seconds),
    )
    try:
        x = torch.randn(4, 6)
        steps = 0
        end = time.monotonic() + duration
        while time.monotonic() < end:
            model(x).sum().backward()
            steps += 1
        parts = part_files(tmp_path / "run")
    finally:
        remove_observer(model)
    expected = duration / (flush_seconds / 2)  # by the time trigger; the row trigger is far off
    # rows per half interval stay under a chunk: the parts were written by the time trigger
    assert steps * ROWS_PER_SAMPLE / expected < HistoryConfig().buffer_rows
    # + 2: the first sample's forward and backward rows, written at once
    assert len(parts) <= 3 * expected + 2, f"{len(parts)} parts in {duration} s"
    assert len(parts) >= 2 + duration // flush_seconds  # and the time bound still writes


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_flush_seconds_must_be_a_positive_finite_number(bad: object) -> None:
    with pytest.raises(ValueError, match="flush_seconds"):
        HistoryConfig(flush_seconds=bad)  # type: ignore[arg-type]


if __name__ == "__main__":
    name = kill_when_old(Path(sys.argv[1]), sys.argv[2:])
    if name is not None:  # the child: it trains until killed, or ends as the script would
        child_main(Path(sys.argv[1]) / name / RUN_NAME, KILLS[name][0])
