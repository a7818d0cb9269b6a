"""A trainer fit resumed from a checkpoint continues its run: Lightning `fit(ckpt_path=...)` and
the Hugging Face Trainer's `train(resume_from_checkpoint=...)`.

Each trainer fits a few steps and saves a checkpoint; a second trainer with a new callback (as a
restarted job builds them) resumes from it. The callback sees the resume and continues the run
in the same directory (`resume=True`): the first fit's rows are unchanged (compared value by
value with history.parquet as the first fit left it), sample_id continues, the step column
(the trainer's global step) runs on without a gap, and result.json covers both fits.
"""

from __future__ import annotations

import warnings
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import Any, cast

import lightning
import polars as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from polars.testing import assert_frame_equal
from test_huggingface_callback import examples, tiny_bert
from test_lightning_callback import Tiny
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver
from torchinstruments.rundir.state import Status, read_state

from _resumed_fits import FIRST, TOTAL, check_continued, lightning_fit, training_steps


def test_a_lightning_fit_resumed_with_ckpt_path_continues_the_run(tmp_path: Path) -> None:
    trainer = lightning_fit(tmp_path, FIRST, None)
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)
    run = tmp_path / "logs" / "version_0" / "torchinstruments"
    first = pl.read_parquet(run / "history.parquet")
    lightning_fit(tmp_path, TOTAL, ckpt)
    assert not (run.parent / "torchinstruments-2").exists()  # continued, not a new run
    check_continued(run, first)
    assert "trained again" not in (run / "index.md").read_text(encoding="utf-8")


def hf_train(tmp_path: Path, max_steps: int, resume: bool) -> Trainer:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=FIRST,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), max_histogram_modules=1)
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=examples(32), callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer


def test_an_hf_fit_resumed_from_checkpoint_continues_the_run(tmp_path: Path) -> None:
    hf_train(tmp_path, FIRST, resume=False)
    run = tmp_path / "out" / "torchinstruments"
    first = pl.read_parquet(run / "history.parquet")
    hf_train(tmp_path, TOTAL, resume=True)
    assert not (run.parent / "torchinstruments-2").exists()
    check_continued(run, first)


def test_notes_of_a_continued_run_name_the_attempt_that_added_them(tmp_path: Path) -> None:
    """A fit that raised, then resumed from its checkpoint: the first fit's note says it ended
    with an exception, as attempt 0's, not as the whole run's (which went on)."""
    run = tmp_path / "run"
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)

    def fit(model: Tiny, ckpt: Path | None) -> None:
        trainer = lightning.Trainer(
            max_steps=4,
            accelerator="cpu",
            devices=1,
            logger=False,
            callbacks=[
                LightningObserver(run, sampler=EveryNForwardsSampler(1)),
                ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1),
            ],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data, ckpt_path=None if ckpt is None else str(ckpt))

    with pytest.raises(ValueError, match="boom in training_step"):
        fit(Tiny(raise_at=2), None)
    first = (run / "index.md").read_text(encoding="utf-8")
    raised = "the fit ended with an exception at global step 2: ValueError: boom in training_step"
    assert f"**Note:** {raised}. The run holds this attempt's samples up to then" in first
    fit(Tiny(), tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    index = (run / "index.md").read_text(encoding="utf-8")
    notes = [line for line in index.splitlines() if line.startswith("**Note:** ")]
    said = f"**Note:** attempt 0: {raised}. The run holds this attempt's samples up to then"
    assert len([note for note in notes if said in note]) == 1
    assert not any(raised in note and "attempt 0: " not in note for note in notes)
    assert [a.ended for a in read_state(run).attempts] == ["removed", "removed"]


def _part_observers(tmp_path: Path, chosen_by: str) -> list[LightningObserver]:
    """Observers of `net.0` and `net.2`: by attribute path, each with its own output_dir, or,
    in the trainer's default directory, by lambdas (a GAN's `lambda m: m.generator` and
    `lambda m: m.discriminator`, told apart by what they read) or by `operator.attrgetter` and
    `functools.partial` (told apart by their arguments)."""
    every = EveryNForwardsSampler(1)
    if chosen_by == "paths":
        return [
            LightningObserver(tmp_path / name, module=name, sampler=every)
            for name in ("net.0", "net.2")
        ]
    if chosen_by == "attrgetters":
        return [LightningObserver(module=attrgetter(f"net.{i}"), sampler=every) for i in (0, 2)]
    if chosen_by == "partials":
        return [
            LightningObserver(module=partial(_net_layer, index=i), sampler=every) for i in (0, 2)
        ]
    if chosen_by == "objects":
        return [LightningObserver(module=NetLayer(i), sampler=every) for i in (0, 2)]
    return [
        LightningObserver(module=lambda m: cast(nn.Sequential, m.net)[0], sampler=every),
        LightningObserver(module=lambda m: cast(nn.Sequential, m.net)[2], sampler=every),
    ]


def _net_layer(model: nn.Module, index: int) -> nn.Module:
    return cast(nn.Sequential, model.get_submodule("net"))[index]


class NetLayer:
    """A callable object choosing `net[index]`: one class, told apart by its attributes."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, model: nn.Module) -> nn.Module:
        return _net_layer(model, self.index)


@pytest.mark.parametrize("chosen_by", ["paths", "lambdas", "attrgetters", "partials", "objects"])
def test_two_observers_in_one_trainer_each_keep_and_continue_their_own_run(
    tmp_path: Path, chosen_by: str
) -> None:
    """Two callbacks (two parts of the model) in one Trainer: each has a checkpoint state of its
    own, so both fit and each resumed fit continues its own run; two lambdas, attrgetters or
    partials too (each pair had one key, and Lightning refused the Trainer: "more than one
    stateful callback"), as did two callable objects of one class)."""
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)

    def fit(max_steps: int, ckpt: Path | None) -> list[Path | None]:
        observers = _part_observers(tmp_path, chosen_by)
        trainer = lightning.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            default_root_dir=tmp_path,
            callbacks=[*observers, ModelCheckpoint(tmp_path / "ckpt", save_last=True)],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Tiny(), data, ckpt_path=None if ckpt is None else str(ckpt))
        return [observer.directory for observer in observers]

    runs = fit(2, None)
    assert None not in runs
    assert len(set(runs)) == 2
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    kept = sorted(state["run_directory"] for state in saved.values() if "run_directory" in state)
    assert kept == sorted(str(run) for run in runs)
    assert fit(4, tmp_path / "ckpt" / "last.ckpt") == runs  # each continues its own run
    for run, width in zip(runs, (8, 2), strict=True):
        assert run is not None
        history = pl.read_parquet(run / "history.parquet")
        assert set(history["layer"]) == {""}  # the observed part itself is the one layer
        assert set(history["shape"].list.last()) == {width}  # net.0's 8 features, net.2's 2
        samples = history.group_by("attempt").agg(pl.col("step").unique().sort()).sort("attempt")
        assert samples.rows() == [(0, [0, 1]), (1, [2, 3])]


class RaiseAfterStep(TrainerCallback):
    """Raises at the end of global step `step`: an exception outside the training step, which
    leaves the observer attached (transformers tells callbacks of no exception)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError("an error outside the training step")


def test_a_new_trainer_resumed_after_an_error_outside_the_step_continues_the_run(
    tmp_path: Path,
) -> None:
    """A notebook's way: the first fit dies after its step 3 (checkpoint-2 saved), outside its
    training step, so its observer stays attached and holds the run; a new Trainer with a new
    callback resumes from the last checkpoint. Its fit used to raise RunLockedError in
    on_train_begin; it now finishes the earlier fit's run (a note and a warning say why) and
    continues it."""
    out = tmp_path / "out"

    def trainer(max_steps: int, *callbacks: TrainerCallback) -> Trainer:
        args = TrainingArguments(
            output_dir=str(out),
            max_steps=max_steps,
            per_device_train_batch_size=4,
            save_strategy="steps",
            save_steps=2,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        return Trainer(
            model=tiny_bert(), args=args, train_dataset=examples(32), callbacks=list(callbacks)
        )

    first = HuggingFaceObserver(sampler=EveryNForwardsSampler(1))
    with pytest.raises(RuntimeError, match="outside the training step"):
        trainer(6, first, RaiseAfterStep(3)).train()
    second = HuggingFaceObserver(sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match="removed this fit's observer when it started"):
        trainer(5, second).train(resume_from_checkpoint=True)  # from checkpoint-2
    run = out / "torchinstruments"
    assert first.directory == second.directory == run
    state = read_state(run)
    assert state.status is Status.COMPLETE
    assert [(a.attempt, a.ended, a.samples) for a in state.attempts] == [
        (0, "removed", 3),
        (1, "removed", 3),
    ]
    assert training_steps(run) == [(0, [0, 1, 2]), (1, [2, 3, 4])]
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert (
        "attempt 0: the fit ended without the trainer's end-of-fit callback (an exception "
        "outside the training step is the likely cause); a later fit that resumed from a "
        "checkpoint continues this run, and its HuggingFaceObserver removed this fit's observer"
    ) in index


def test_a_resumed_fit_that_takes_no_sample_never_says_its_run_holds_no_rows(
    tmp_path: Path,
) -> None:
    """A fit resumed from the checkpoint of its last step (a finished job requeued) trains no
    step: its attempt takes no sample, while the run keeps the earlier attempt's. The removal's
    warning said the directory "holds no rows, and its index.md says so": neither was true."""
    trainer = lightning_fit(tmp_path, FIRST, None)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    run = tmp_path / "logs" / "version_0" / "torchinstruments"
    first = pl.read_parquet(run / "history.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lightning_fit(tmp_path, FIRST, ckpt)  # resumed at step FIRST of FIRST: nothing to train
    assert_frame_equal(pl.read_parquet(run / "history.parquet"), first)  # rows kept as they were
    said = [str(w.message) for w in caught if "torchinstruments" in str(w.message)]
    assert not [s for s in said if "holds no rows" in s], said
    assert [s for s in said if "recorded no sample" in s] == [
        f"torchinstruments: this attempt recorded no sample (0 root forwards seen, none "
        f"sampled): {run} holds the earlier attempts' {FIRST} samples (sample_id 0 to "
        f"{FIRST - 1}) and none of this one's; its index.md's Attempts table says so"
    ]
    state = read_state(run)
    assert [(a.attempt, a.samples) for a in state.attempts] == [(0, FIRST), (1, 0)]
    assert "No sample was recorded" not in (run / "index.md").read_text(encoding="utf-8")


def test_two_hf_observers_of_parts_chosen_by_lambdas_each_keep_their_own_run(
    tmp_path: Path,
) -> None:
    """Two lambdas choosing two parts: each observer's run has a key of its own in the
    TrainerState a checkpoint saves (one key, they kept one run for both, and a resumed train
    continued the other's)."""
    every = EveryNForwardsSampler(1)
    observers = [
        HuggingFaceObserver(module=lambda m: m.get_submodule("bert.pooler"), sampler=every),
        HuggingFaceObserver(module=lambda m: m.get_submodule("classifier"), sampler=every),
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=examples(4), callbacks=[*observers]
    )
    trainer.train()
    kept = trainer.state.stateful_callbacks
    assert isinstance(kept, dict)
    runs = {entry["run_directory"] for key, entry in kept.items() if "Observer" in key}
    assert runs == {str(observer.directory) for observer in observers}
    assert len(runs) == 2
    for observer, layers in zip(observers, ({"dense", "activation"}, {""}), strict=True):
        assert observer.directory is not None
        assert set(pl.read_parquet(observer.directory / "history.parquet")["layer"]) == layers
