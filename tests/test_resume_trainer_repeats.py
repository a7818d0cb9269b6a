"""A fit resumed behind the step its run reached: the steps trained again, and evaluations run
again, are said apart in index.md; one resumed where its checkpoint left repeats none."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning
import polars as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_huggingface_callback import examples, tiny_bert
from test_lightning_callback import Tiny
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver

from _resumed_fits import training_steps

RETRAINED = "trained again, so (its|their) samples appear in more than one attempt"


ONE_RETRAINED = "was trained again, so its samples appear in more than one attempt"


SOME_RETRAINED = "were trained again, so their samples appear in more than one attempt"


def test_a_fit_resumed_behind_the_step_its_run_reached_says_which_steps_repeat(
    tmp_path: Path,
) -> None:
    """Preempted after its last checkpoint: the resumed fit trains global step 2 again, so step 2
    has samples in both attempts; index.md and a warning say so (the step query would pair both
    with one logged loss)."""
    run = tmp_path / "run"
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)

    def fit(max_steps: int, ckpt: Path | None) -> None:
        trainer = lightning.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            callbacks=[
                LightningObserver(run, sampler=EveryNForwardsSampler(1)),
                ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1),
            ],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Tiny(), data, ckpt_path=None if ckpt is None else str(ckpt))

    fit(3, None)  # samples at global steps 0, 1, 2; the last checkpoint is at step 2
    with pytest.warns(RuntimeWarning, match=RETRAINED):
        fit(4, tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    history = pl.read_parquet(run / "history.parquet")
    steps = history.group_by("attempt").agg(pl.col("step").unique().sort()).sort("attempt")
    assert steps.rows() == [(0, [0, 1, 2]), (1, [2, 3])]
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert (
        "attempt 1: this fit resumed at global step 2, and earlier attempts had recorded "
        f"training samples up to step 2: step 2 {ONE_RETRAINED}"
    ) in index


def test_an_hf_train_resumed_behind_the_step_its_run_reached_says_which_steps_repeat(
    tmp_path: Path,
) -> None:
    def train(max_steps: int, resume: str | None) -> None:
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=max_steps,
            per_device_train_batch_size=4,
            save_strategy="steps",
            save_steps=2,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), max_histogram_modules=1)
        trainer = Trainer(
            model=tiny_bert(), args=args, train_dataset=examples(32), callbacks=[callback]
        )
        trainer.train(resume_from_checkpoint=resume)

    train(3, None)  # samples at global steps 0, 1, 2; checkpoint-2 holds step 2
    with pytest.warns(RuntimeWarning, match=RETRAINED):
        train(4, str(tmp_path / "out" / "checkpoint-2"))
    run = tmp_path / "out" / "torchinstruments"
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert "attempt 1: this fit resumed at global step 2" in index
    assert f"up to step 2: step 2 {ONE_RETRAINED}" in index


def hf_train_with_evaluation(out: Path, max_steps: int, resume: str | bool | None) -> None:
    """A Trainer fit with gradient accumulation, evaluation every 2 steps recorded as its own
    series (record_eval) and a checkpoint every 2 steps."""
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = HuggingFaceObserver(
        sampler=EveryNForwardsSampler(1), record_eval=True, max_histogram_modules=1
    )
    trainer = Trainer(
        model=tiny_bert(),
        args=args,
        train_dataset=examples(32),
        eval_dataset=examples(4),
        callbacks=[callback],
    )
    trainer.train(resume_from_checkpoint=resume)


def test_an_hf_train_resumed_where_its_checkpoint_left_repeats_no_step_despite_evaluations(
    tmp_path: Path,
) -> None:
    """The evaluation after the last checkpointed step carries that step (the global step then);
    the resumed fit's first training forwards carry it too, for the next step. Nothing was
    trained twice, and index.md must not say it was (it said "steps 4 to 4 were trained
    again", from the evaluation samples)."""
    out = tmp_path / "out"
    hf_train_with_evaluation(out, 4, None)  # checkpoint-4 holds step 4; evaluated at 2 and 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_train_with_evaluation(out, 6, True)  # resumes from checkpoint-4
    run = out / "torchinstruments"
    assert training_steps(run) == [(0, [0, 1, 2, 3]), (1, [4, 5])]
    history = pl.read_parquet(run / "history.parquet")
    evaluated = (
        history.filter(pl.col("mode") == "eval")
        .group_by("attempt")
        .agg(pl.col("step").unique().sort())
    )
    assert evaluated.sort("attempt").rows() == [(0, [2, 4]), (1, [6])]
    assert not [w for w in caught if "trained again" in str(w.message)]
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert "trained again" not in index
    assert "evaluated again" not in index  # step 4's evaluation ran before checkpoint-4
    # both fits ran in this one process: two attempts, not two processes
    assert "This run was written in 2 attempts" in index
    assert "processes" not in index.split("## Attempts")[1].split("##")[0]


def test_an_hf_train_resumed_behind_names_training_steps_and_evaluations_repeated_apart(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    hf_train_with_evaluation(out, 4, None)
    with pytest.warns(RuntimeWarning, match=RETRAINED):
        hf_train_with_evaluation(out, 4, str(out / "checkpoint-2"))
    run = out / "torchinstruments"
    assert training_steps(run) == [(0, [0, 1, 2, 3]), (1, [2, 3])]
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert f"training samples up to step 3: steps 2 to 3 {SOME_RETRAINED}" in index
    # step 2's evaluation ran before checkpoint-2; step 4's ran in both attempts
    assert (
        "attempt 1: this fit resumed at global step 2 and evaluated again at step 4, where "
        "earlier attempts had recorded evaluation samples too, so the evaluation samples at step "
        "4 appear in more than one attempt (2 samples in attempt 0, 2 samples in this one)"
    ) in index
