"""A restarted job continues its run on request: `inject_observer(..., resume=True)`.

The job is a child forked from this file run once as a script (`_fork_server`): a plain
training loop that saves a checkpoint (weights and step) after every step, gives the step to the
history (`set_step`), and is killed with SIGKILL mid-training; it is then started again with the
same output_dir, loads its checkpoint and goes on for a few steps before `remove_observer`. The
earlier attempt's rows, read from its parts before the restart, must be in the final history
unchanged (compared value by value), with sample_id and the step column continuing after them
and result.json covering both attempts.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from _fork_server import Forked, ForkServer, serve
from polars.testing import assert_frame_equal
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
    set_step,
)
from torchinstruments.__main__ import main as cli_main
from torchinstruments.rundir.attempt_states import BY_CHECKPOINT
from torchinstruments.rundir.id_mark import read_mark
from torchinstruments.rundir.layout import list_parts
from torchinstruments.rundir.lock import RunLockedError
from torchinstruments.rundir.state import Status, read_state

from conftest import sgd_step

ROWS_PER_SAMPLE = 3 * len(DEFAULT_METRICS) * 2  # Linear, Tanh, Linear; output and gradient
CONFIG = HistoryConfig(buffer_rows=ROWS_PER_SAMPLE, window=3)
PARTS_BEFORE_KILL = 6
SECOND_STEPS = 4
WAIT_S = 60.0


def child_main(directory: Path, checkpoint: Path, steps: int | None) -> None:
    """One attempt: resume from the checkpoint if any, train `steps` steps (None: until
    killed), then remove the observer."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    step = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        step = saved["step"] + 1
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=CONFIG,
        resume=True,
    )
    done = 0
    while steps is None or done < steps:
        set_step(model, step)
        sgd_step(model, x, y, 0.05)
        partial = checkpoint.with_suffix(".partial")  # a kill mid-save leaves the last one
        torch.save({"model": model.state_dict(), "step": step}, partial)
        os.replace(partial, checkpoint)
        step += 1
        done += 1
        time.sleep(0.01)
    remove_observer(model)


def event_steps_after(run: Path, forward_index: int) -> list[int]:
    """The steps after `forward_index` at which TensorBoard (its own reader) finds a histogram in
    the run's events: after a kill, the samples whose rows died in memory."""
    from tensorboard.backend.event_processing.event_accumulator import (
        HISTOGRAMS,
        EventAccumulator,
    )

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={HISTOGRAMS: 0})
    events.Reload()
    tags: dict[str, Any] = events.Tags()
    steps = {e.step for tag in tags["histograms"] for e in events.Histograms(tag)}
    return sorted(step for step in steps if step > forward_index)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This file run once as a script that imported torch: it forks each attempt when a test
    asks (`_fork_server`), so the three attempts cost one import."""
    server = ForkServer(__file__, tmp_path_factory.mktemp("server") / "server.err")
    yield server
    server.close()


def run_child(
    server: ForkServer, name: str, directory: Path, checkpoint: Path, steps: int | None
) -> Forked:
    """An attempt (`child_main`) in a child of the server, its files `name.*` beside the run."""
    return server.start(directory.parent, name, directory, checkpoint, steps)


def scenario(root: Path, args: Sequence[str]) -> None:
    """A child of the server: `child_main` for `args`."""
    child_main(Path(args[0]), Path(args[1]), None if args[2] == "None" else int(args[2]))


def test_a_killed_job_restarted_with_resume_continues_its_run(
    tmp_path: Path, server: ForkServer
) -> None:
    run, checkpoint = tmp_path / "stats", tmp_path / "ckpt.pt"
    first = run_child(server, "first", run, checkpoint, None)
    try:
        deadline = time.monotonic() + WAIT_S
        while len(list_parts(run)) < PARTS_BEFORE_KILL:
            assert first.poll() is None, first.stderr()
            assert time.monotonic() < deadline, "the first attempt wrote no parts"
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.kill()
    assert first.wait(timeout=60) == -signal.SIGKILL
    # What the killed attempt left on disk: the rows that must survive as they are.
    before = pl.read_parquet(list_parts(run), glob=False)
    assert before["attempt"].unique().to_list() == [0]
    first_samples = before["sample_id"].n_unique()
    assert first_samples >= PARTS_BEFORE_KILL - 1
    saved = int(torch.load(checkpoint)["step"])  # the step the second attempt goes on after
    # the samples only TensorBoard's events hold (their rows died with the process)
    without_rows = event_steps_after(run, int(before["forward_index"].max()))  # type: ignore[arg-type]
    # the ids after every sample it began: a kill inside a sample's step leaves one more
    mark = read_mark(run)
    assert mark is not None

    second = run_child(server, "second", run, checkpoint, SECOND_STEPS)
    try:
        code = second.wait(timeout=120)
    finally:
        second.kill()
    assert code == 0, second.stderr()

    history = pl.read_parquet(run / "history.parquet")
    kept = history.filter(pl.col("attempt") == 0)
    assert_frame_equal(kept, before)  # every column, value by value, in order
    later = history.filter(pl.col("attempt") == 1)
    ids = later["sample_id"].unique().sort().to_list()
    last_first = before["sample_id"].max()
    assert isinstance(last_first, int)
    # after the last row, the samples only the events hold, and one the kill cut before
    # anything of it reached the disk (the id mark): each took an id
    start = mark[0]
    assert start >= last_first + 1 + len(without_rows)
    assert ids == list(range(start, start + SECOND_STEPS))
    assert int(later["forward_index"].min()) > int(before["forward_index"].max())  # type: ignore[arg-type]
    # The step column: each attempt's steps in order and without a gap, the second going on
    # from the checkpoint. Between them, the steps whose rows the kill took from memory before
    # the flush thread wrote them (as many as it lagged behind: index.md says such rows may be
    # lost); a step the kill cut before its checkpoint is trained again.
    for attempt, first_step in ((0, 0), (1, saved + 1)):
        rows = history.filter(pl.col("attempt") == attempt)
        steps = rows.group_by("sample_id").agg(pl.col("step").first()).sort("sample_id")
        values = steps["step"].to_list()
        assert values[0] == first_step
        assert all(b - a in (0, 1) for a, b in itertools.pairwise(values))
    assert int(before["step"].max()) <= saved + 1  # type: ignore[arg-type]

    total = first_samples + SECOND_STEPS
    result = json.loads((run / "result.json").read_text(encoding="utf-8"))
    tensor = result[0]["tensors"][0]
    assert tensor["observations"] == total
    assert tensor["first_sample_id"] == 0
    assert tensor["latest_sample_id"] == start + SECOND_STEPS - 1

    state = read_state(run)
    assert state.status is Status.INTERRUPTED  # the first attempt's last rows may be missing
    assert [(a.attempt, a.ended) for a in state.attempts] == [(0, "killed"), (1, "removed")]
    # its rows' samples, those only its events hold, and one its id mark alone proves: the
    # attempts add up to the run's count
    assert state.attempts[0].samples == start >= first_samples + len(without_rows)
    assert state.attempts[1].samples == SECOND_STEPS
    assert state.attempts[1].first_sample_id == start
    assert state.counts is not None
    assert state.counts_recovered  # the first attempt's counts are lower bounds
    assert state.counts.samples == start + SECOND_STEPS
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "## Attempts" in index
    assert "**State: interrupted** in an earlier attempt: attempt(s) 0 ended" in index
    assert f"| 1 | {state.attempts[1].started_at} | removed | {start} |" in index


def test_without_resume_the_refusal_names_it_and_never_a_command_that_refuses_again(
    tmp_path: Path,
) -> None:
    run = tmp_path / "stats"
    model = nn.Linear(2, 2)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    with pytest.raises(FileExistsError) as refused:
        inject_observer(nn.Linear(2, 2), output_dir=run)
    message = str(refused.value)
    assert "resume=True" in message
    assert "new output_dir" in message
    assert "finalize" not in message
    # What it names works: resume=True continues the run.
    again = nn.Linear(2, 2)
    inject_observer(again, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    again(torch.randn(1, 2)).sum().backward()
    remove_observer(again)
    history = pl.read_parquet(run / "history.parquet")
    assert history.group_by("attempt").agg(pl.col("sample_id").unique()).sort("attempt").rows() == [
        (0, [0]),
        (1, [1]),
    ]
    assert read_state(run).status is Status.COMPLETE


def test_a_live_run_is_refused_as_live_and_never_with_a_command_that_refuses_again(
    tmp_path: Path, server: ForkServer
) -> None:
    """A second process (or a model re-run in a notebook) pointed at a run another process still
    writes is told so; `resume=True`, which a live run refuses too, is not what it is told."""
    run, checkpoint = tmp_path / "stats", tmp_path / "ckpt.pt"
    writer = run_child(server, "writer", run, checkpoint, None)
    try:
        deadline = time.monotonic() + WAIT_S
        while not list_parts(run):
            assert writer.poll() is None, writer.stderr()
            assert time.monotonic() < deadline, "the writer wrote no part"
            time.sleep(0.01)
        with pytest.raises(FileExistsError) as refused:
            inject_observer(nn.Linear(2, 2), output_dir=run)
        with pytest.raises(RunLockedError, match="live process"):
            inject_observer(nn.Linear(2, 2), output_dir=run, resume=True)
    finally:
        writer.kill()
    message = str(refused.value)
    assert f"live process (pid {writer.pid})" in message
    assert "new output_dir" in message
    assert "pass resume=True" not in message


def test_a_run_live_in_this_process_is_refused_naming_the_model_not_removed(
    tmp_path: Path,
) -> None:
    """A notebook cell run again: the model it observed before was never removed."""
    run = tmp_path / "stats"
    first = nn.Linear(2, 2)
    inject_observer(first, output_dir=run)
    try:
        with pytest.raises(FileExistsError, match="this process: a model observed here was not"):
            inject_observer(nn.Linear(2, 2), output_dir=run)
    finally:
        remove_observer(first)
    assert read_state(run).status is Status.COMPLETE


def test_a_continued_run_started_when_its_first_attempt_did(tmp_path: Path) -> None:
    run = tmp_path / "stats"
    model = nn.Linear(2, 2)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    first = "2020-01-01T00:00:00+00:00"  # an earlier day than any attempt now can start on
    state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
    state["run"]["started_at"] = state["attempts"][0]["started_at"] = first
    (run / ".state.json").write_text(json.dumps(state), encoding="utf-8")
    again = nn.Linear(2, 2)
    inject_observer(again, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    again(torch.randn(1, 2)).sum().backward()
    remove_observer(again)
    after = read_state(run)
    assert after.run.started_at == first
    assert [a.started_at == first for a in after.attempts] == [True, False]
    index = (run / "index.md").read_text(encoding="utf-8")
    assert f"started at {first}" in index
    assert f"| 1 | {after.attempts[1].started_at} | removed |" in index


def test_resume_refuses_a_model_of_other_layers_and_names_the_difference(tmp_path: Path) -> None:
    run = tmp_path / "stats"
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    other = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    with pytest.raises(FileExistsError) as refused:
        inject_observer(other, output_dir=run, resume=True)
    message = str(refused.value)
    assert "2 there, 3 here" in message
    assert "only in the run: '1' (ReLU); only here: '1' (Tanh), '2' (Linear)" in message
    assert "new output_dir" in message
    assert "forward" not in vars(other[0])  # refused before anything was attached
    # The run is untouched: the same model continues it.
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    assert read_state(run).status is Status.COMPLETE
    assert pl.read_parquet(run / "history.parquet")["attempt"].unique().sort().to_list() == [0, 1]


def killed_with_events_beyond_rows(run: Path) -> None:
    """A run as a kill leaves it: samples 0-5 at forward_index 0, 2, ..., 10 in its TensorBoard
    events, only samples 0-2 in history (the rest died in memory), its state "in progress"."""
    model = nn.Linear(3, 3)
    inject_observer(
        model,
        output_dir=run,
        sampler=EveryNForwardsSampler(2),
        history_config=HistoryConfig(buffer_rows=2 * len(DEFAULT_METRICS)),
    )
    for _ in range(12):
        model(torch.randn(2, 3)).sum().backward()
    state = (run / ".state.json").read_text(encoding="utf-8")
    remove_observer(model)
    kept = pl.read_parquet(run / "history.parquet").filter(pl.col("sample_id") <= 2)
    (run / "history.parquet").unlink()
    (run / "history.parts").mkdir()
    kept.write_parquet(run / "history.parts" / "part-000000000.parquet")
    (run / ".state.json").write_text(state, encoding="utf-8")


def test_a_continued_run_never_reuses_a_sample_id_its_events_hold_and_counts_stay_bounds(
    tmp_path: Path,
) -> None:
    run = tmp_path / "stats"
    killed_with_events_beyond_rows(run)
    model = nn.Linear(3, 3)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)

    history = pl.read_parquet(run / "history.parquet")
    later = history.filter(pl.col("attempt") == 1)
    # samples 3-5 have events and no row: their ids are taken, so the new ones follow them
    assert later["sample_id"].unique().sort().to_list() == [6, 7]
    assert later["forward_index"].unique().sort().to_list() == [11, 12]
    state = read_state(run)
    assert [(a.attempt, a.ended) for a in state.attempts] == [(0, "killed"), (1, "removed")]
    assert state.attempts[1].first_sample_id == 6
    assert state.counts is not None
    assert state.counts_recovered  # attempt 0's counts are lower bounds, so the run's are
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "at least 8 samples" in index
    assert "- counts: 13 root forwards" not in index
    # samples 3-5 are attempt 0's (its events prove them), so no sample_id is skipped
    assert "| killed | 0 | 0 | at least 11 | at least 6 | at least 3 |" in index
    assert "sample_id may skip" not in index
    assert state.status is Status.INTERRUPTED  # the skipped ids are no unexplained gap
    # a later finalize keeps them bounds
    from torchinstruments.rundir.finish import finalize

    assert finalize(run).state.counts_recovered


def test_a_killed_attempts_loss_bound_is_not_quoted_from_the_attempt_that_continued(
    tmp_path: Path,
) -> None:
    """index.md's flush_seconds is the last attempt's; a killed earlier attempt may have run with
    another, so its loss bound quotes its own number, never the last attempt's."""
    run = tmp_path / "stats"
    model = nn.Linear(3, 3)
    inject_observer(
        model,
        output_dir=run,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(flush_seconds=5.0),
    )
    model(torch.randn(2, 3)).sum().backward()
    state = (run / ".state.json").read_text(encoding="utf-8")  # as a kill leaves it: live
    remove_observer(model)
    (run / ".state.json").write_text(state, encoding="utf-8")
    model = nn.Linear(3, 3)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    remove_observer(model)  # the default flush_seconds, 60

    assert [a.ended for a in read_state(run).attempts] == ["killed", "removed"]
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "flush_seconds=60.0" in index  # the Run section: this attempt's settings
    assert "last flush_seconds=60.0 s when the process was killed" not in index
    assert "last flush_seconds=5.0 s for attempt 0 when the process was killed" in index


def test_show_names_the_earlier_attempt_that_ended_without_remove_observer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`show`'s state line says, as index.md's does, that attempt 0 (not the process that
    removed the last attempt) ended without remove_observer."""
    run = tmp_path / "stats"
    model = nn.Linear(3, 3)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 3)).sum().backward()
    state = (run / ".state.json").read_text(encoding="utf-8")  # as a kill leaves it: live
    remove_observer(model)
    (run / ".state.json").write_text(state, encoding="utf-8")
    model = nn.Linear(3, 3)
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)

    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert "**State: interrupted** in an earlier attempt: attempt(s) 0 ended without" in index
    assert cli_main(["show", str(run), "--metrics", "mean"]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # `show` wraps long lines
    assert (
        "state: interrupted in an earlier attempt (attempt(s) 0 ended without remove_observer "
        "and were finalized when the run was continued"
    ) in shown
    assert "the last attempt was removed" in shown
    assert "the process ended without remove_observer" not in shown
    assert (  # how many attempts and how each ended, as index.md's Attempts table says
        "attempts: 2, continued with resume=True (killed: attempt 0; removed: attempt 1); "
        "each one's counts in index.md's Attempts table"
    ) in shown


def run_attempt(
    run: Path, sampler: EveryNForwardsSampler | None, forwards: int = 6, **options: Any
) -> None:
    """One attempt of a two-layer run continued in `run` (`resume=True`), `forwards` steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(model, output_dir=run, sampler=sampler, resume=True, **options)
    for _ in range(forwards):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)


def test_each_attempts_sampler_is_named_by_index_md_and_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job restarted with another sampler: the run's pages name each attempt's, never only
    the last one's as if it had chosen every sample."""
    run = tmp_path / "stats"
    run_attempt(run, EveryNForwardsSampler(2))
    run_attempt(run, None)  # the default: TimeIntervalSampler(60)
    run_attempt(run, EveryNForwardsSampler(5))
    history = pl.read_parquet(run / "history.parquet")
    first = history.filter(pl.col("attempt") == 0)["forward_index"].unique().sort().to_list()
    assert first == [0, 2, 4]  # attempt 0's samples were every second forward's
    said = (
        "sampler, per attempt: attempt 0: EveryNForwardsSampler(n=2): forward_index 0, 2, 4, "
        "...; attempt 1: TimeIntervalSampler(seconds=60)"
    )
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert f"- {said}" in index
    assert "attempt 2: EveryNForwardsSampler(n=5)" in index
    # the default sampler starts anew in each attempt: its first root forward is a sample
    start = read_state(run).attempts[1].first_forward_index
    second = history.filter(pl.col("attempt") == 1)["forward_index"].unique().to_list()
    assert start == 6  # attempt 0 saw 6 forwards
    assert second == [start]
    assert RESTART_SAMPLES in index
    assert cli_main(["show", str(run), "--metrics", "mean"]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # `show` wraps long lines
    assert said in shown
    assert "attempt 2: EveryNForwardsSampler(n=5)" in shown
    assert "attempts: 3, continued with resume=True (removed: attempts 0-2);" in shown
    state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
    state["attempts"][2]["continued_by"] = BY_CHECKPOINT  # as a trainer callback's resumed fit
    (run / ".state.json").write_text(json.dumps(state), encoding="utf-8")
    assert cli_main(["show", str(run), "--metrics", "mean"]) == 0
    assert (  # each way with its attempts, then the ends: no two parentheses in a row
        "attempts: 3, continued with resume=True in attempt 1 and by a fit resumed from a "
        "checkpoint in attempt 2 (removed: attempts 0-2);"
    ) in " ".join(capsys.readouterr().out.split())
    assert cli_main(["show", str(run), "--metrics", "mean", "--format", "json"]) == 0
    facts = json.loads(capsys.readouterr().out)["run"]
    assert facts["attempt_ends"] == ["removed"] * 3  # the text's attempts line, per attempt
    assert [s.split(":")[0] for s in facts["attempt_samplers"]] == [
        "EveryNForwardsSampler(n=2)",
        "TimeIntervalSampler(seconds=60)",
        "EveryNForwardsSampler(n=5)",
    ]


# What index.md's Attempts section says where an attempt ran the default sampler.
RESTART_SAMPLES = (
    "TimeIntervalSampler (the default) starts anew in each attempt: it samples the attempt's "
    "first root forward too"
)


def l2(tensor: torch.Tensor) -> float:
    """A custom metric one attempt measures and the next does not."""
    return float(tensor.double().norm())


def test_an_attempt_that_measures_other_metrics_says_so_beside_the_last_attempts_line(
    tmp_path: Path,
) -> None:
    """index.md's metrics and focus lines are the last attempt's: a restart that drops (or
    adds) a reducer, or histograms of a layer, says which only some attempts had, never
    leaving rows or histograms no page names."""
    run = tmp_path / "stats"
    run_attempt(run, EveryNForwardsSampler(3), reducers=[l2], max_histogram_modules=1)
    with pytest.warns(RuntimeWarning, match="other metrics than attempt 0 did") as said:
        run_attempt(run, EveryNForwardsSampler(3))
    assert len([w for w in said if "other metrics" in str(w.message)]) == 1
    history = pl.read_parquet(run / "history.parquet")
    assert history.filter(pl.col("metric") == "l2")["attempt"].unique().to_list() == [0]
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "- metrics: mean, std, min, max, p25, p50, p75, zero_fraction, nonfinite_fraction\n" in (
        index
    )
    assert (
        "attempt 1: this attempt measures other metrics than attempt 0 did (only there: l2; "
        "only here: none)"
    ) in index
    assert "- focus layers (TensorBoard histograms): `0`, `1`\n" in index
    assert (
        "attempt 1: this attempt's focus layers are not attempt 0's (only there: none; only "
        "here: 1)"
    ) in index


def test_attempts_of_one_sampler_name_it_once(tmp_path: Path) -> None:
    run = tmp_path / "stats"
    run_attempt(run, EveryNForwardsSampler(3))
    run_attempt(run, EveryNForwardsSampler(3))
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "- sampler: EveryNForwardsSampler(n=3): forward_index 0, 3, 6, ...\n" in index
    assert RESTART_SAMPLES not in " ".join(index.split())  # said only of the default sampler
    assert "other metrics" not in index  # the same metrics and focus layers in both attempts
    assert "focus layers are not" not in index
    assert [a.sampler for a in read_state(run).attempts] == [
        "EveryNForwardsSampler(n=3): forward_index 0, 3, 6, ..."
    ] * 2


def test_a_run_from_before_attempt_samplers_gives_its_last_attempt_the_runs_sampler(
    tmp_path: Path,
) -> None:
    """A state file written before each attempt kept its sampler: the run's sampler was its
    last attempt's; an attempt before that is unknown, and said to be."""
    run = tmp_path / "stats"
    run_attempt(run, EveryNForwardsSampler(2))
    run_attempt(run, EveryNForwardsSampler(3))
    state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
    for entry in state["attempts"]:
        del entry["sampler"]
    (run / ".state.json").write_text(json.dumps(state), encoding="utf-8")
    run_attempt(run, None)
    samplers = [a.sampler for a in read_state(run).attempts]
    assert samplers == [
        None,
        "EveryNForwardsSampler(n=3): forward_index 0, 3, 6, ...",
        "TimeIntervalSampler(seconds=60): the first root forward, then the first root forward "
        "once 60 s have passed since the last sample",
    ]
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert "attempt 0: unknown (" in index


if __name__ == "__main__":
    serve(scenario)
