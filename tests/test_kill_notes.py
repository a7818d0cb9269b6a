"""What a run says about itself survives a SIGKILL: notes said during the run are in index.md
after `torchinstruments finalize`, not only in a run that reached `remove_observer`.

Each child is a real process killed with SIGKILL at a known point, after the rows of the
samples it took are on disk (the children are forked at once from one process that imported
torch, `_fork_server`); the flush thread saves the state after the rows of a round, and
its rounds run one after another, so a note said before a round's rows is in the state once
the next round's rows are on disk (the first sample's rows are a round the training thread
waits for). The notes' facts come from outside the library: TensorBoard's own event loader,
history, the sampler's own failure. The trainer callbacks' cases are
`test_kill_notes_trainers.py`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import polars as pl
import pytest
import torch
from _fork_server import child_stderr, kill_all_when_ready, serve
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from torch import nn

from torchinstruments import DEFAULT_METRICS, EveryNForwardsSampler, inject_observer, set_step
from torchinstruments.rundir.state import Status, read_state

from conftest import cli_in_process

READY = "ready"


def index_text(run: Path) -> str:
    return " ".join((run / "index.md").read_text(encoding="utf-8").split())


def finalized(run: Path) -> str:
    """`torchinstruments finalize RUN` (its entry point); index.md's text, one line."""
    done = cli_in_process("finalize", run)
    assert done.returncode == 0, done.stderr
    return index_text(run)


def tag_steps(folder: Path, tag: str) -> list[int]:
    """The steps of `tag` in the event files of `folder`, read with TensorBoard's own loader."""
    return sorted(
        e.step
        for path in folder.glob("events.out.tfevents.*")
        for e in EventFileLoader(str(path)).Load()
        for v in e.summary.value
        if v.tag == tag
    )


class FailsFirst:
    """Raises when asked about forward 0, samples every later forward."""

    def should_sample(self, forward_index: int) -> bool:
        if forward_index == 0:
            raise RuntimeError("no schedule yet")
        return True

    def __repr__(self) -> str:
        return "FailsFirst()"


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each mode's child killed at READY, into `root/<mode>`: one process imports torch and
    forks them all at once (`_fork_server`), each a real process SIGKILLed once it says READY
    on its stdout."""
    root = tmp_path_factory.mktemp("killed")
    codes = kill_all_when_ready(__file__, root, READY, ["sampler", "shared", "events", "compiled"])
    for mode, code in codes.items():
        assert code == -signal.SIGKILL, child_stderr(root, mode)
    return root


def test_a_run_killed_after_a_recording_failure_keeps_its_note(killed: Path) -> None:
    """The observer's notes (here: a sampler that raised, so forward 0 was not sampled) are
    kept in the state by the flush thread; a run killed later still says what it missed."""
    tmp_path = killed / "sampler"
    index = finalized(tmp_path / "run")
    assert (
        "sampler FailsFirst() raised RuntimeError('no schedule yet') for forward_index 0; a "
        "forward whose sampler raises is not sampled"
    ) in index


def test_a_killed_runs_state_and_notes_go_to_stderr_beside_csv_markdown_and_pictures(
    killed: Path,
) -> None:
    """A csv or markdown table and a picture carry no header of their own: the readers say a
    killed run's state and its notes on stderr (text and json say them in their output), so a
    table or picture is never made past them silently; stdout stays the bare table."""
    run = killed / "sampler" / "run"
    finalized(run)
    note = "sampler FailsFirst() raised RuntimeError('no schedule yet')"
    outputs = [
        cli_in_process("show", run, "--format", "csv"),
        cli_in_process("show", run, "--format", "markdown"),
        cli_in_process("compare", run, run, "--format", "csv"),
        cli_in_process("plot", run, "--metrics", "mean", "-o", killed / "sampler" / "t.png"),
    ]
    for done in outputs:
        assert done.returncode == 0, done.stderr
        said = [line for line in done.stderr.splitlines() if f"{run}: state: " in line]
        assert said, done.stderr
        assert all("state: interrupted" in line for line in said), said
        assert note in done.stderr
    assert outputs[0].stdout.startswith("layer,")  # the bare csv
    states = [[line for line in done.stderr.splitlines() if "state: " in line] for done in outputs]
    assert [len(lines) for lines in states] == [1, 1, 2, 1]  # once per run (compare: both)
    json_run = cli_in_process("show", run, "--format", "json")
    assert json_run.stderr == ""
    assert "interrupted" in json.loads(json_run.stdout)["run"]["state"]


def test_a_run_killed_after_a_sample_left_out_of_its_logger_keeps_the_note(
    killed: Path,
) -> None:
    """A TensorBoardSink gets one histogram per step: a second sample at a step is left out of
    its logger. The sink counts it; the flush thread's next round keeps the note in the state,
    and a run killed after that round still says it."""
    tmp_path = killed / "shared"
    index = finalized(tmp_path / "run")
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    per_step = history.group_by("step").agg(pl.col("sample_id").n_unique()).sort("step").rows()
    assert per_step == [(40, 2), (41, 1)]  # one sample at step 40 left out of the logger
    assert tag_steps(tmp_path / "tb", "0/call_0/output/tensor") == [40, 41]
    assert (
        "1 sample shared a step with an earlier sample (gradient accumulation's micro-batches, "
        "an evaluation's batches), so the TensorBoard logger of TensorBoardSink(step=...) holds "
        "no histogram of it"
    ) in index


def test_a_run_killed_after_its_tensorboard_events_failed_still_says_so(killed: Path) -> None:
    """The run's own event file could not be created (the history goes on): the failure is a
    problem of the run, kept in the state by the flush thread, so a killed run is incomplete
    and says why, not merely interrupted."""
    tmp_path = killed / "events"
    done = cli_in_process("finalize", tmp_path / "run")
    problem = (
        "TensorBoard events under tensorboard/ could not be created ('OSError: no event file\\n"
        "here'); histograms after that point are missing (the history is not affected)"
    )
    assert done.returncode == 1  # finalize's answer for an incomplete run
    assert f"incomplete: {problem}" in done.stderr
    assert problem in index_text(tmp_path / "run")
    assert read_state(tmp_path / "run").status is Status.INCOMPLETE


class NoEventFile:
    """An event file that cannot be created (a failing disk, as the run directory sees it)."""

    def __init__(self, *args: object) -> None:
        raise OSError("no event file\nhere")  # a line break: quoted by error_said


def events_child(tmp_path: Path) -> None:
    """One sample (its rows on disk before READY) in a run whose event file failed."""
    import torchinstruments.sinks.directory as directory_sink

    directory_sink.EventFile = NoEventFile  # type: ignore[assignment, misc]
    model = nn.Sequential(nn.Linear(4, 2))
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).sum().backward()
    print(READY, file=sys.__stdout__, flush=True)
    time.sleep(120)


def shared_step_child(tmp_path: Path) -> None:
    """Samples 0 and 1 at step 40, sample 2 at step 41; each waits for the rows before it to
    be on disk, so the round that wrote sample 2's rows came after the one that wrote sample
    1's, whose save of the state followed it (one thread, one round after another)."""
    from torch.utils.tensorboard import SummaryWriter

    from torchinstruments import HistoryConfig, TensorBoardSink

    from conftest import wait_for_rows

    rows = 2 * len(DEFAULT_METRICS)  # one layer: its output's rows and its gradient's
    step = [40]
    writer = SummaryWriter(str(tmp_path / "tb"))
    model = nn.Sequential(nn.Linear(4, 2))  # one layer, '0'
    inject_observer(
        model,
        output_dir=tmp_path / "run",
        sampler=EveryNForwardsSampler(1),
        sinks=[TensorBoardSink(writer, step=lambda: step[0])],
        history_config=HistoryConfig(flush_seconds=0.2),
    )
    for sample, at in enumerate((40, 40, 41)):
        step[0] = at
        set_step(model, at)  # history's step column: the step the sink is given
        model(torch.randn(3, 4)).sum().backward()
        wait_for_rows(tmp_path / "run", (sample + 1) * rows)
    writer.flush()
    print(READY, file=sys.__stdout__, flush=True)
    time.sleep(120)


def test_a_compiled_run_killed_after_a_sample_says_it_ran_eagerly(killed: Path) -> None:
    """A sampled forward called through torch.compile runs eagerly; removal says so, and a
    run killed after its first sample says it too, as counted by then."""
    tmp_path = killed / "compiled"
    index = finalized(tmp_path / "run")
    samples = pl.read_parquet(tmp_path / "run" / "history.parquet")["sample_id"].n_unique()
    assert samples == 1
    assert (
        "torch.compile: sampled forwards ran eagerly (1 of the 1 sample was called through "
        "compiled code): torch.compile was off while each ran"
    ) in index
    # Observed through its compiled wrapper (`inject_observer(torch.compile(model))`), the root
    # is compiled itself: the killed run says its samples ran eagerly as removal would.
    wrapped = finalized(tmp_path / "wrapped")
    assert (
        "torch.compile: sampled forwards ran eagerly (compiled modules: the root): "
        "torch.compile was off while each ran"
    ) in wrapped


def compiled_child(tmp_path: Path) -> None:
    """One sampled step through torch.compile (its rows on disk before READY), in a run of
    the model compiled after inject and in one of a model observed through its wrapper."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    compiled = torch.compile(model, backend="eager")
    compiled(torch.randn(3, 4)).sum().backward()
    wrapper = cast(nn.Module, torch.compile(nn.Sequential(nn.Linear(4, 2)), backend="eager"))
    inject_observer(wrapper, output_dir=tmp_path / "wrapped", sampler=EveryNForwardsSampler(1))
    wrapper(torch.randn(3, 4)).sum().backward()
    print(READY, file=sys.__stdout__, flush=True)
    time.sleep(120)


def sampler_child(tmp_path: Path) -> None:
    """Forward 0: the sampler raises (not sampled); forward 1: sampled, its rows on disk."""
    model = nn.Linear(4, 2)
    inject_observer(model, output_dir=tmp_path / "run", sampler=FailsFirst())
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    print(READY, file=sys.__stdout__, flush=True)
    time.sleep(120)


CHILDREN = {
    "events": events_child,
    "shared": shared_step_child,
    "sampler": sampler_child,
    "compiled": compiled_child,
}


def scenario(directory: Path, args: Sequence[str]) -> None:
    """A child of the server: the mode `args[0]` in `directory`, what it prints on stderr (its
    stdout carries READY alone)."""
    with contextlib.redirect_stdout(sys.stderr):
        CHILDREN[args[0]](directory)


if __name__ == "__main__":
    serve(scenario)
