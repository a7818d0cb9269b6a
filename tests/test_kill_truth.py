"""A kill never misstates: a default-config run killed after its first sample has that sample's
rows, and index.md's counts after `finalize` are true or marked unknown.

The child injects with every default (one sample a minute, a 60 s flush interval), takes its
first sample (forward and backward), runs unsampled steps, says so, and is killed with SIGKILL
long before any flush interval (the children are forked at once from one process that imported
torch, `_fork_server`). The first sample's rows are written right after it, on the
training thread, so they are on disk when the child says it is done; the later rows of the run
(none here: nothing else is sampled) would wait for the flush interval.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import polars as pl
import pytest
import torch
from _fork_server import child_stderr, kill_all_when_ready, serve
from torch import nn

from torchinstruments import DEFAULT_METRICS, inject_observer
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.index_page import counts_sentence, render_index
from torchinstruments.rundir.state import RunState, Status, read_state

from conftest import cli_in_process

STEPS = 40
LAYERS = 3  # Linear, Tanh, Linear


def child_main(directory: Path, before: bool, evaluation: bool = False) -> None:
    """A default-config run: the first forward is sampled, the next STEPS are not (`before`:
    ready before the first forward, so no row can reach the disk; `evaluation`: the sampled
    one is an evaluation forward under torch.no_grad, the training steps follow it)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    inject_observer(model, output_dir=directory)
    if evaluation:
        with torch.no_grad():
            model.eval()(torch.randn(2, 4))
        model.train()
    for _ in range(0 if before else 1 + STEPS):
        model(torch.randn(2, 4)).sum().backward()
    print("stepped", flush=True)
    time.sleep(120)


CHILDREN = {
    "first": lambda directory: child_main(directory / "stats", False),
    "before": lambda directory: child_main(directory / "stats", True),
    "evaluation": lambda directory: child_main(directory / "stats", False, True),
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The children killed once they said "stepped", into `root/<mode>/stats`: one process
    imports torch and forks them all at once (`_fork_server`), each a real process SIGKILLed
    there."""
    root = tmp_path_factory.mktemp("killed")
    for mode, code in kill_all_when_ready(__file__, root, "stepped", list(CHILDREN)).items():
        assert code == -signal.SIGKILL, child_stderr(root, mode)
    return root


def test_a_default_run_killed_after_its_first_sample_has_its_rows(killed: Path) -> None:
    run_dir = killed / "first" / "stats"
    finalize(run_dir)
    history = pl.read_parquet(run_dir / "history.parquet")
    rows = LAYERS * len(DEFAULT_METRICS)
    assert history["sample_id"].unique().to_list() == [0]
    assert history.group_by("signal").len().sort("signal").rows() == [
        ("output", rows),
        ("output_gradient", rows),
    ]
    assert history["value"].null_count() == 0  # real measurements, not placeholders

    state = read_state(run_dir)
    assert state.status is Status.INTERRUPTED
    assert state.counts_recovered
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    line = counts_sentence(state)
    assert f"- {line}" in index
    # The truth is 41 root forwards, 1 sample, 1 with output gradients: each is said as a bound.
    assert line.endswith(
        "at least 1 root forward, at least 1 sample, at least 1 sample with output gradients"
    )
    assert "never called" not in index


def test_counts_nobody_wrote_are_unknown_never_zero(tmp_path: Path) -> None:
    from torchinstruments.history_config import HistoryConfig
    from torchinstruments.records import LayerInfo, RunCounts, RunInfo

    run = RunInfo(
        output_dir=tmp_path,
        library_version="x",
        torch_version="x",
        model_class="Net",
        layers=(LayerInfo("fc", "Linear"),),
        focus_layers=("fc",),
        sampler="s",
        metrics=("mean",),
        rank=None,
        world_size=None,
        rank_policy="rank0",
        capture_direct_forwards=True,
        history=HistoryConfig(buffer_rows=1, window=1, flush_seconds=60.0),
        started_at="t",
    )
    killed = RunState(run, RunCounts(0, 0, 0), counts_recovered=True, interrupted=True)
    page = render_index(killed)
    assert "unknown root forwards, unknown samples, unknown samples with output gradients" in page
    # 2 samples on disk, 1 of them under grad: its gradient rows may have died with the process
    one_grad = RunCounts(3, 2, 0, no_grad_samples=1)
    again = render_index(RunState(run, one_grad, counts_recovered=True, interrupted=True))
    assert "at least 2 samples, unknown samples with output gradients" in again
    # A continued run: attempt 0 killed after one sample under no_grad, attempt 1 removed after
    # one without a backward: each count of samples with output gradients is a known 0.
    from torchinstruments.rundir.attempts import AttemptCounts

    attempts = (
        AttemptCounts(0, "t", root_forwards=1, samples=1, ended="killed", no_grad_samples=1),
        AttemptCounts(1, "t", 1, 1, root_forwards=2, samples=1, ended="removed"),
    )
    continued = RunState(
        run, RunCounts(3, 2, 0), counts_recovered=True, interrupted=True, attempts=attempts
    )
    page = render_index(continued)
    assert "at least 3 root forwards, at least 2 samples, 0 samples with output gradients" in page
    assert "| killed | 0 | 0 | at least 1 | at least 1 | 0 |" in page
    assert "| removed | 1 | 1 | 2 | 1 | 0 |" in page
    assert "never called" not in page
    assert " 0 root forwards" not in page
    # The live run counted, passed-through forwards too: the model never ran.
    counted = RunCounts(0, 0, 0, unobserved_eval_forwards=0, unobserved_setup_forwards=0)
    assert "the model was never called" in render_index(RunState(run, counted))
    # A state written before the passed-through forwards were counted: whether a trainer ran
    # the model unobserved is unknown, so the page never says it was never called.
    older = render_index(RunState(run, RunCounts(0, 0, 0)))
    assert "never called" not in older
    assert (
        "**No sample was recorded:** no root forward was seen (whether a trainer callback passed "
        "forwards through unobserved is unknown: the run's state predates that count)"
    ) in older


def test_samples_only_events_prove_leave_every_layer_count_unknown_never_0(tmp_path: Path) -> None:
    """As a kill leaves it when no part reached the disk but the TensorBoard events of the
    samples did (here: the parts removed by hand, the state put back to "in progress"): the
    events prove 3 samples, yet no row says which layers ran in them, so each layer's count is
    unknown, never 0."""
    from torchinstruments import EveryNForwardsSampler, remove_observer

    run = tmp_path / "stats"
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(2))
    for _ in range(6):  # samples at forward_index 0, 2, 4
        model(torch.randn(2, 3)).sum().backward()
    live = (run / ".state.json").read_text(encoding="utf-8")
    remove_observer(model)
    (run / "history.parquet").unlink()
    (run / "history.parts").mkdir()
    (run / ".state.json").write_text(live, encoding="utf-8")

    report = finalize(run)
    assert report.counts.samples == 3  # what the events prove
    result = json.loads((run / "result.json").read_text("utf-8"))
    assert [layer["sampled_forwards"] for layer in result] == [None, None]
    index = (run / "index.md").read_text(encoding="utf-8")
    layers = index.split("## Layers", 1)[1].split("\n## ", 1)[0]
    assert "| `0` | Linear | unknown |" in layers
    assert "| `1` | Tanh | unknown |" in layers
    assert "| 0 |" not in layers
    assert "at least 3 samples" in index
    shown = cli_in_process("show", run)
    assert shown.returncode == 1
    assert "no row reached the disk" in shown.stderr
    assert "no sample was taken" not in shown.stderr


def test_a_killed_run_whose_samples_ran_without_grad_knows_none_had_gradients(
    killed: Path,
) -> None:
    """Its only sample ran under torch.no_grad (the history's grad_enabled says so), so no
    gradient could reach it: 0 samples with output gradients is known, never "unknown"."""
    run_dir = killed / "evaluation" / "stats"
    assert (
        cli_in_process("finalize", run_dir)
        .stdout.splitlines()[0]
        .endswith("at least 1 sample, 0 samples with output gradients (rebuilt from history)")
    )
    state = read_state(run_dir)
    assert state.counts is not None
    assert (state.counts.samples, state.counts.no_grad_samples) == (1, 1)
    line = counts_sentence(state)
    assert line.endswith("at least 1 sample, 0 samples with output gradients")
    assert f"- {line}" in (run_dir / "index.md").read_text(encoding="utf-8")
    assert "unknown samples with output gradients" not in cli_in_process("show", run_dir).stdout


def scenario(directory: Path, args: Sequence[str]) -> None:
    """A child of the server: the child `args[0]` in `directory`."""
    CHILDREN[args[0]](directory)


if __name__ == "__main__":
    serve(scenario)


def test_samples_tensorboard_holds_without_history_rows_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a kill leaves it: the events of the last samples reached the disk, their rows did not
    (here: cut from the parts by hand, with the state put back to "in progress"). An attempt
    continued after it still names them at its removal, which does not read the job's events
    again: the finish that closed the kill found them."""
    import json

    from torchinstruments import EveryNForwardsSampler, HistoryConfig, remove_observer

    run = tmp_path / "stats"
    model = nn.Linear(3, 3)
    rows = 2 * len(DEFAULT_METRICS)
    inject_observer(
        model,
        output_dir=run,
        sampler=EveryNForwardsSampler(2),
        history_config=HistoryConfig(buffer_rows=rows),
    )
    for _ in range(12):  # samples 0-5 at forward_index 0, 2, ..., 10
        model(torch.randn(2, 3)).sum().backward()
    state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
    remove_observer(model)
    history = pl.read_parquet(run / "history.parquet")
    kept = history.filter(pl.col("sample_id") <= 2)
    (run / "history.parquet").unlink()
    (run / "history.parts").mkdir()
    kept.write_parquet(run / "history.parts" / "part-000000000.parquet")
    (run / ".state.json").write_text(json.dumps(state), encoding="utf-8")  # in progress

    report = finalize(run)
    assert report.state.events_without_rows == (6, 8, 10)
    assert report.state.events_without_rows_total == 3
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "holds histograms of 3 sampled forward(s) that have no row in history.parquet: " in index
    assert "forward_index 6, 8, 10." in index
    # Only the counts the events prove are raised: a layer's count, and the gradient one, are
    # its rows' (3 samples), and the line says so rather than that every count includes them.
    assert "the counts of root forwards and samples include them, those read from rows" in index
    assert report.counts.backward_samples == 3
    assert report.counts.layer_samples == {"": 3}
    # The counts are raised to what the events prove: 6 samples, 11 root forwards at least.
    assert report.counts.samples == 6
    assert report.counts.root_forwards == 11

    from torchinstruments.rundir import history_checks

    reads: list[Path] = []
    monkeypatch.setattr(history_checks, "event_steps", lambda d: reads.append(d) or set())
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(2), resume=True)
    model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    assert reads == []
    state = read_state(run)
    assert (state.events_without_rows, state.events_without_rows_total) == ((6, 8, 10), 3)
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "holds histograms of 3 sampled forward(s) that have no row in history.parquet: " in index


def test_a_kill_before_any_row_leaves_every_layer_count_unknown_never_0(killed: Path) -> None:
    run = killed / "before" / "stats"
    finalize(run)
    index = (run / "index.md").read_text(encoding="utf-8")
    layers = index.split("## Layers", 1)[1].split("\n## ", 1)[0]
    assert "| `0` | Linear | unknown |" in layers
    assert "| 0 |" not in layers
    assert "Never ran" not in layers
    result = json.loads((run / "result.json").read_text("utf-8"))
    assert [layer["sampled_forwards"] for layer in result] == [None] * len(result)
    shown = cli_in_process("show", run)
    assert shown.returncode == 1
    assert "no row reached the disk" in shown.stderr
    assert "unknown" in shown.stderr
    assert "no sample was taken" not in shown.stderr
