"""What a trainer callback says about its fit survives a SIGKILL: notes a Lightning fit says
before its end (the steps a pinned logger gets again on a resumed fit, the fit's setup
forwards, the evaluation forwards passed through unobserved so far, the training batches whose
training_step returned None) are in index.md after `torchinstruments finalize`.

Each child is a real fit killed with SIGKILL at the end of its first training step, once its
first sample's rows are on disk (the flush thread writes them at once, and the training thread
waits for them), so every note said before that sample is on disk by then. The notes' facts
come from outside the library: TensorBoard's own event loader, the model's own count of its
calls. The plain-loop cases are `test_kill_notes.py`.

Importing Lightning takes seconds, so one process (this file run as a script) imports it and
forks each killed fit from there, all at once, killing each at its kill point; the tests read
the killed runs of that one module fixture.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning
import polars as pl
import pytest
import torch
from _forked import ended, killed_together_when_ready
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from test_kill_notes import READY, finalized, tag_steps
from test_trainer_phases import Recorded, Summarized
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver

TAG = "net.0/call_0/output/tensor"  # the first Linear of `Recorded`


class KilledAfterFirstStep(lightning.Callback):
    """At the end of the fit's first training batch (its first sample's rows are on disk): write
    the model's own count of its calls so far to `calls` (setup and evaluation calls), say
    READY on the real stdout and wait for the kill."""

    def __init__(self, calls: Path) -> None:
        self.calls = calls

    def on_train_batch_end(
        self, trainer: lightning.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        said = {
            "setup": getattr(pl_module, "setup_calls", 0),
            "eval": sum(phase == "eval" for phase, _ in pl_module.calls),
        }
        self.calls.write_text(json.dumps(said), encoding="utf-8")
        print(READY, file=sys.__stdout__, flush=True)
        time.sleep(120)


def lightning_fit(
    tmp_path: Path,
    model: Recorded,
    *,
    ckpt: Path | None = None,
    kill_point: lightning.Callback | None = None,
    sanity: int = 0,
    record_eval: bool = False,
) -> None:
    """Up to 7 optimizer steps into `tmp_path/run`, every forward sampled, a checkpoint every 2
    steps, the TensorBoard logger pinned to `tmp_path/tb/version_0` (a graph of an example input
    and the model summary where the model has one), a sanity check of `sanity` batches."""
    data = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    trainer = lightning.Trainer(
        max_steps=7,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(tmp_path, name="tb", version=0, log_graph=True),
        limit_val_batches=sanity,
        num_sanity_val_steps=sanity,
        callbacks=[
            LightningObserver(
                tmp_path / "run", sampler=EveryNForwardsSampler(1), record_eval=record_eval
            ),
            ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1),
            *([] if kill_point is None else [kill_point]),
        ],
        enable_progress_bar=False,
        enable_model_summary=isinstance(model, Summarized),
    )
    loader = DataLoader(data, batch_size=4)
    trainer.fit(model, loader, loader, ckpt_path=None if ckpt is None else str(ckpt))


class SkipsFirstBatch(Recorded):
    """Its training_step returns None at global step 0: Lightning runs no backward there."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:  # a loss, or None at step 0
        loss = super().training_step(batch, batch_idx)
        return None if self.trainer.global_step == 0 else loss


MODES = ("resumed", "setup", "sanity", "sanity-recorded", "skipped")


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """Each mode's fit killed at its kill point, into `root/<mode>`; and the steps the pinned
    logger held after attempt 0 of "resumed" (run here: steps 0-6, removed)."""
    root = tmp_path_factory.mktemp("killed")
    with warnings.catch_warnings():  # as the tests' filterwarnings mark: Lightning's warnings
        warnings.simplefilter("ignore", RuntimeWarning)
        lightning_fit(root / "resumed", Recorded())
    earlier = tag_steps(root / "resumed" / "tb" / "version_0", TAG)
    done = subprocess.run(
        [sys.executable, __file__, str(root), *MODES],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return root, earlier


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_resumed_fit_killed_keeps_the_note_on_the_steps_its_pinned_logger_writes_again(
    killed: tuple[Path, list[int]],
) -> None:
    """The resumed fit says at its start which steps its pinned logger holds from the earlier
    fit; killed after its first step, the run still says it once finalized."""
    root, earlier = killed
    tmp_path = root / "resumed"
    index = finalized(tmp_path / "run")
    again = [step for step in earlier if step >= 4]
    assert again == [4, 5, 6]
    assert (
        f"attempt 1: the trainer's TensorBoard logger writes to `{tmp_path / 'tb' / 'version_0'}`, "
        f"where earlier attempts wrote records up to step {again[-1]}; this fit resumed at "
        f"global step {again[0]} and writes there again"
    ) in index
    assert f"no longer the earlier attempts' at steps {again[0]} to {again[-1]}" in index


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_fit_killed_after_its_setup_keeps_the_note_on_its_setup_forwards(
    killed: tuple[Path, list[int]],
) -> None:
    """The model summary's and the logger graph's forwards of example_input_array are counted
    when the fit's first loop starts; a fit killed after its first step still says how many."""
    tmp_path = killed[0] / "setup"
    setup = json.loads((tmp_path / "calls.json").read_text(encoding="utf-8"))["setup"]
    assert setup >= 1
    index = finalized(tmp_path / "run")
    forwards, were = ("forward", "was") if setup == 1 else ("forwards", "were")
    assert (
        f"**Note:** {setup} setup {forwards} at the fit's start, before its first loop "
        "(Lightning's model summary and the logger's graph of example_input_array, an "
        f"on_fit_start hook), {were} not observed, whatever record_eval says"
    ) in index
    assert index.count(f"{setup} setup {forwards} at the fit's start") == 1


SANITY = 2  # the sanity check's batches: evaluation forwards before the first training step


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("record_eval", [False, True])
def test_a_fit_killed_after_its_sanity_check_says_how_many_evaluation_forwards_it_had(
    killed: tuple[Path, list[int]], record_eval: bool
) -> None:
    """The sanity check's forwards pass through unobserved (or, with record_eval, are its own
    series); the fit's end counts them, and a fit killed before its end still says how many it
    had by then, as a lower bound."""
    tmp_path = killed[0] / ("sanity-recorded" if record_eval else "sanity")
    evaluation = json.loads((tmp_path / "calls.json").read_text(encoding="utf-8"))["eval"]
    assert evaluation == SANITY
    index = finalized(tmp_path / "run")
    what = "were seen (record_eval)" if record_eval else "ran unobserved"
    assert (
        f"up to the run's last save of its state while it went on, {evaluation} evaluation "
        f"forwards {what} (a lower bound where the run ended without removal"
    ) in index
    # how many forwards each schedule had is unknown: said, never left out
    unknown = "training and evaluation forwards (record_eval, counted apart): unknown"
    assert (unknown in index) is record_eval


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_fit_killed_after_a_batch_without_backward_keeps_the_note_naming_its_sample(
    killed: tuple[Path, list[int]],
) -> None:
    """A training_step that returned None (Lightning runs no backward for its batch) leaves
    its samples with output rows only; the run says so as soon as the batch ends, so a fit
    killed before its end keeps the note, which names the sample, as a lower bound."""
    run = killed[0] / "skipped" / "run"
    index = finalized(run)
    assert (
        "up to the run's last save of its state while it went on (a lower bound where the run "
        "ended without removal: the fit's end names every such batch), training_step returned "
        "None for 1 training batch (global step 0), and Lightning runs no backward for such a "
        "batch"
    ) in index
    assert "sample 0 of that batch has output rows and no output_gradient rows" in index
    assert index.count("training_step returned None") == 1
    history = pl.read_parquet(run / "history.parquet")
    assert history.filter(pl.col("sample_id") == 0)["signal"].unique().to_list() == ["output"]


def child_main(mode: str, tmp_path: Path) -> None:
    """The killed fit of each test: it prints READY on the real stdout at its kill point."""
    killed = KilledAfterFirstStep(tmp_path / "calls.json")
    if mode == "resumed":  # attempt 1 of the run, from the checkpoint of step 4
        checkpoint = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
        lightning_fit(tmp_path, Recorded(), ckpt=checkpoint, kill_point=killed)
    elif mode == "setup":
        lightning_fit(tmp_path, Summarized(), kill_point=killed)
    elif mode == "skipped":
        lightning_fit(tmp_path, SkipsFirstBatch(), kill_point=killed)
    else:
        recorded = mode == "sanity-recorded"
        lightning_fit(tmp_path, Recorded(), kill_point=killed, sanity=SANITY, record_eval=recorded)


def killed_forks(root: Path, modes: list[str]) -> None:
    """Each mode's killed fit (`child_main`) in a child forked from this process, all at once:
    SIGKILLed once it says READY on its stdout (a pipe to this process)."""
    fits = {mode: functools.partial(child_main, mode, root / mode) for mode in modes}
    statuses = killed_together_when_ready(READY, fits, quiet=True)  # Lightning prints its logs
    for mode, status in statuses.items():
        assert status == -signal.SIGKILL, f"{mode}: the fit never reached its kill point"


if __name__ == "__main__":
    killed_forks(Path(sys.argv[1]), sys.argv[2:])
    ended()
