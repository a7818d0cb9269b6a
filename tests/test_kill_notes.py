"""What a run says about itself survives a SIGKILL: notes said during the run are in index.md
after `torchinstruments finalize`, not only in a run that reached `remove_observer`.

Each child is a real process killed with SIGKILL at a known point: after its first sample,
whose rows the flush thread writes at once (the training thread waits for them), so every note
said before that sample ended is on disk by then, as the rows are. The notes' facts are
computed independently of the library (TensorBoard's own event loader, the model's own count
of its calls, the sampler's own failure).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from test_trainer_phases import Recorded, Summarized
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler, inject_observer
from torchinstruments.integrations import LightningObserver

from conftest import kill_when_ready, run_cli

TAG = "net.0/call_0/output/tensor"
READY = "ready"


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
            LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1)),
            ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1),
            *([] if kill_point is None else [kill_point]),
        ],
        enable_progress_bar=False,
        enable_model_summary=isinstance(model, Summarized),
    )
    loader = DataLoader(data, batch_size=4)
    trainer.fit(model, loader, loader, ckpt_path=None if ckpt is None else str(ckpt))


def index_text(run: Path) -> str:
    return " ".join((run / "index.md").read_text(encoding="utf-8").split())


def finalized(run: Path) -> str:
    """`torchinstruments finalize RUN` as a user runs it; index.md's text, one line."""
    done = run_cli("finalize", run)
    assert done.returncode == 0, done.stderr
    return index_text(run)


def tag_steps(folder: Path) -> list[int]:
    """The steps of TAG in the event files of `folder`, read with TensorBoard's own loader."""
    return sorted(
        e.step
        for path in folder.glob("events.out.tfevents.*")
        for e in EventFileLoader(str(path)).Load()
        for v in e.summary.value
        if v.tag == TAG
    )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_resumed_fit_killed_keeps_the_note_on_the_steps_its_pinned_logger_writes_again(
    tmp_path: Path,
) -> None:
    """The resumed fit says at its start which steps its pinned logger holds from the earlier
    fit; killed after its first step, the run still says it once finalized."""
    lightning_fit(tmp_path, Recorded())  # attempt 0: steps 0-6, removed
    earlier = tag_steps(tmp_path / "tb" / "version_0")
    kill_when_ready(__file__, READY, "resumed", tmp_path)
    index = finalized(tmp_path / "run")
    again = [step for step in earlier if step >= 4]
    assert again == [4, 5, 6]
    assert (
        f"attempt 1: the trainer's TensorBoard logger writes to {tmp_path / 'tb' / 'version_0'}, "
        f"where earlier attempts wrote records up to step {again[-1]}; this fit resumed at "
        f"global step {again[0]} and writes there again"
    ) in index
    assert f"no longer the earlier attempts' at steps {again[0]} to {again[-1]}" in index


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_fit_killed_after_its_setup_keeps_the_note_on_its_setup_forwards(
    tmp_path: Path,
) -> None:
    """The model summary's and the logger graph's forwards of example_input_array are counted
    when the fit's first loop starts; a fit killed after its first step still says how many."""
    kill_when_ready(__file__, READY, "setup", tmp_path)
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
def test_a_fit_killed_after_its_sanity_check_says_its_evaluation_forwards_ran_unobserved(
    tmp_path: Path,
) -> None:
    """Without record_eval the sanity check's forwards pass through unobserved; the fit's end
    counts them, and a fit killed before its end still says how many it had seen by then, as
    a lower bound."""
    kill_when_ready(__file__, READY, "sanity", tmp_path)
    evaluation = json.loads((tmp_path / "calls.json").read_text(encoding="utf-8"))["eval"]
    assert evaluation == SANITY
    index = finalized(tmp_path / "run")
    assert (
        f"up to the run's last save of its state while it went on, {evaluation} evaluation "
        "forwards ran unobserved (a lower bound where the run ended without removal"
    ) in index


class FailsFirst:
    """Raises when asked about forward 0, samples every later forward."""

    def should_sample(self, forward_index: int) -> bool:
        if forward_index == 0:
            raise RuntimeError("no schedule yet")
        return True

    def __repr__(self) -> str:
        return "FailsFirst()"


def test_a_run_killed_after_a_recording_failure_keeps_its_note(tmp_path: Path) -> None:
    """The observer's notes (here: a sampler that raised, so forward 0 was not sampled) are
    kept in the state by the flush thread; a run killed later still says what it missed."""
    kill_when_ready(__file__, READY, "sampler", tmp_path)
    index = finalized(tmp_path / "run")
    assert (
        "sampler FailsFirst() raised RuntimeError('no schedule yet') for forward_index 0; a "
        "forward whose sampler raises is not sampled"
    ) in index


def child_main(mode: str, tmp_path: Path) -> None:
    """The killed process of each test: it prints READY on the real stdout at its kill point."""
    if mode == "resumed":  # attempt 1 of the run, from the checkpoint of step 4
        checkpoint = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
        killed = KilledAfterFirstStep(tmp_path / "calls.json")
        lightning_fit(tmp_path, Recorded(), ckpt=checkpoint, kill_point=killed)
    elif mode == "setup":
        killed = KilledAfterFirstStep(tmp_path / "calls.json")
        lightning_fit(tmp_path, Summarized(), kill_point=killed)
    elif mode == "sanity":
        killed = KilledAfterFirstStep(tmp_path / "calls.json")
        lightning_fit(tmp_path, Recorded(), kill_point=killed, sanity=SANITY)
    else:
        model = nn.Linear(4, 2)
        inject_observer(model, output_dir=tmp_path / "run", sampler=FailsFirst())
        for _ in range(2):  # forward 0: the sampler raises; forward 1: sampled
            model(torch.randn(3, 4)).sum().backward()
        print(READY, file=sys.__stdout__, flush=True)
        time.sleep(120)


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):  # the trainers print their logs
        child_main(sys.argv[1], Path(sys.argv[2]))
