"""A trainer fit resumed from a checkpoint continues its run: Lightning `fit(ckpt_path=...)` and
the Hugging Face Trainer's `train(resume_from_checkpoint=...)`.

Each trainer fits a few steps and saves a checkpoint; a second trainer with a new callback (as a
restarted job builds them) resumes from it. The callback sees the resume and continues the run
in the same directory (`resume=True`): the first fit's rows are unchanged (compared value by
value with history.parquet as the first fit left it), sample_id continues, the step column
(the trainer's global step) runs on without a gap, and result.json covers both fits.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning
import polars as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from polars.testing import assert_frame_equal
from test_huggingface_callback import examples, tiny_bert
from test_lightning_callback import Tiny
from test_trainer_phases import Recorded
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver
from torchinstruments.rundir.state import Status, read_state

FIRST, TOTAL = 3, 6


def check_continued(run: Path, first: pl.DataFrame) -> None:
    """The two fits' rows in `run` as one run, the first fit's kept as they were."""
    history = pl.read_parquet(run / "history.parquet")
    assert_frame_equal(history.filter(pl.col("attempt") == 0), first)
    assert first["attempt"].unique().to_list() == [0]
    later = history.filter(pl.col("attempt") == 1)
    first_ids = first["sample_id"].unique().sort().to_list()
    assert first_ids == list(range(FIRST))
    assert later["sample_id"].unique().sort().to_list() == list(range(FIRST, TOTAL))
    steps = history.group_by("sample_id").agg(pl.col("step").unique()).sort("sample_id")
    assert steps["step"].to_list() == [[step] for step in range(TOTAL)]  # global steps 0-5
    result = json.loads((run / "result.json").read_text(encoding="utf-8"))
    entry = next(t for layer in result for t in layer["tensors"])
    assert entry["observations"] == TOTAL
    assert (entry["first_sample_id"], entry["latest_sample_id"]) == (0, TOTAL - 1)
    state = read_state(run)
    assert state.status is Status.COMPLETE
    assert [(a.attempt, a.ended, a.samples) for a in state.attempts] == [
        (0, "removed", FIRST),
        (1, "removed", TOTAL - FIRST),
    ]


def lightning_fit(tmp_path: Path, max_steps: int, ckpt: Path | None) -> lightning.Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs", version=0),
        callbacks=[LightningObserver(sampler=EveryNForwardsSampler(1))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Tiny(),
        train_dataloaders=DataLoader(data, batch_size=4),
        ckpt_path=None if ckpt is None else str(ckpt),
    )
    return trainer


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


def record_eval_fit(
    run: Path, max_steps: int, ckpt: Path | None, record_eval: bool = True
) -> list[tuple[str, int]]:
    """A Lightning fit with validation every 2 batches and a one-batch sanity check, recording
    evaluation forwards (EveryNForwardsSampler(3) for both schedules; unless not `record_eval`)
    into `run`; saves `run.parent/step{max_steps}.ckpt` and returns the (phase, global step) of
    every call."""
    torch.manual_seed(0)
    model = Recorded()
    train = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    val = TensorDataset(torch.randn(4, 4), torch.randint(0, 2, (4,)))
    callback = LightningObserver(run, sampler=EveryNForwardsSampler(3), record_eval=record_eval)
    trainer = lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        val_check_interval=2,
        num_sanity_val_steps=1,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        model,
        DataLoader(train, batch_size=4),
        DataLoader(val, batch_size=4),
        ckpt_path=None if ckpt is None else str(ckpt),
    )
    trainer.save_checkpoint(run.parent / f"step{max_steps}.ckpt")
    return model.calls


def sampled_calls(fits: list[tuple[list[tuple[str, int]], dict[str, int]]]) -> list[tuple]:
    """The calls an EveryNForwardsSampler(3) per phase samples: each fit's calls with the index
    each phase's schedule starts that fit at."""
    expected = []
    for calls, start in fits:
        counts = dict(start)
        for phase, step in calls:
            if counts[phase] % 3 == 0:
                expected.append((phase, step))
            counts[phase] += 1
    return expected


def sample_phases(run: Path) -> list[tuple]:
    """(mode, step) of each sample of the run, in sample_id order."""
    history = pl.read_parquet(run / "history.parquet")
    samples = history.group_by("sample_id").agg(pl.col("mode").first(), pl.col("step").first())
    return samples.sort("sample_id").select("mode", "step").rows()


def phase_counts(calls: list[tuple[str, int]]) -> dict[str, int]:
    return {kind: sum(phase == kind for phase, _ in calls) for kind in ("train", "eval")}


def test_a_resumed_fit_continues_each_sampler_on_its_own_count(tmp_path: Path) -> None:
    """With record_eval, the training sampler goes on after the first fit's training forwards
    and the evaluation sampler after its evaluation forwards (sanity check and validations)."""
    run = tmp_path / "run"
    first = record_eval_fit(run, 6, None)
    second = record_eval_fit(run, 12, tmp_path / "step6.ckpt")
    assert sample_phases(run) == sampled_calls(
        [(first, {"train": 0, "eval": 0}), (second, phase_counts(first))]
    )
    attempts = read_state(run).attempts
    assert [(a.train_forwards, a.eval_forwards) for a in attempts] == [
        tuple(phase_counts(calls).values()) for calls in (first, second)
    ]


def test_a_state_without_schedule_counts_resumes_by_the_earlier_rule(tmp_path: Path) -> None:
    """A state written before the per-schedule counts were kept reads them as unknown: the
    training schedule then continues from forward_index, the evaluation schedule from 0."""
    run = tmp_path / "run"
    first = record_eval_fit(run, 6, None)
    state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
    for counts in (state["counts"], *state["attempts"]):
        del counts["train_forwards"], counts["eval_forwards"]
    (run / ".state.json").write_text(json.dumps(state), encoding="utf-8")
    assert [a.train_forwards for a in read_state(run).attempts] == [None]
    second = record_eval_fit(run, 12, tmp_path / "step6.ckpt")
    assert sample_phases(run) == sampled_calls(
        [(first, {"train": 0, "eval": 0}), (second, {"train": len(first), "eval": 0})]
    )


@pytest.mark.parametrize("older", [False, True])
def test_a_continued_run_sums_its_unobserved_evaluation_forwards_or_says_them_unknown(
    tmp_path: Path, older: bool
) -> None:
    """The evaluation forwards each fit passed through unobserved add up across a resume; an
    earlier attempt whose state predates that count makes the run's total unknown (null in the
    state), never 0 and never just the last attempt's."""
    run = tmp_path / "run"
    first = record_eval_fit(run, 6, None, record_eval=False)
    if older:
        state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
        del state["counts"]["unobserved_eval_forwards"]
        del state["counts"]["unobserved_setup_forwards"]
        (run / ".state.json").write_text(json.dumps(state), encoding="utf-8")
    second = record_eval_fit(run, 12, tmp_path / "step6.ckpt", record_eval=False)
    evaluation = [phase_counts(calls)["eval"] for calls in (first, second)]
    assert all(evaluation)
    counts = read_state(run).counts
    assert counts is not None
    if older:
        assert counts.unobserved_eval_forwards is None
        assert counts.unobserved_setup_forwards is None
    else:
        assert counts.unobserved_eval_forwards == sum(evaluation)
        assert counts.unobserved_setup_forwards == 0


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
    assert (
        f"**Note:** attempt 0: {raised}. The run holds this attempt's samples up to then"
        in (notes[0])
    )
    assert not any(raised in note and "attempt 0: " not in note for note in notes)
    assert [a.ended for a in read_state(run).attempts] == ["removed", "removed"]


def versioned_fit(tmp_path: Path, max_steps: int, ckpt: Path | None, **options: object) -> Path:
    """`lightning_fit` with the default auto-versioned TensorBoardLogger (each trainer writes a
    new `logs/version_N`); returns the callback's run directory."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    callback = LightningObserver(sampler=EveryNForwardsSampler(1), **options)  # type: ignore[arg-type]
    trainer = lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(save_dir=tmp_path, name="logs"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Tiny(),
        train_dataloaders=DataLoader(data, batch_size=4),
        ckpt_path=None if ckpt is None else str(ckpt),
    )
    if ckpt is None:
        trainer.save_checkpoint(tmp_path / "step3.ckpt")
    assert callback.directory is not None
    return callback.directory


def test_a_fit_resumed_into_a_new_logger_version_continues_the_checkpoints_run(
    tmp_path: Path,
) -> None:
    run = versioned_fit(tmp_path, FIRST, None)
    assert run == tmp_path / "logs" / "version_0" / "torchinstruments"
    first = pl.read_parquet(run / "history.parquet")
    assert versioned_fit(tmp_path, TOTAL, tmp_path / "step3.ckpt") == run
    assert (tmp_path / "logs" / "version_1").is_dir()  # the logger moved on; the run did not
    assert not (tmp_path / "logs" / "version_1" / "torchinstruments").exists()
    check_continued(run, first)


def test_a_checkpoints_run_that_is_gone_is_named_in_index_md(tmp_path: Path) -> None:
    run = versioned_fit(tmp_path, FIRST, None)
    shutil.rmtree(run)
    with pytest.warns(RuntimeWarning, match="could not be continued"):
        later = versioned_fit(tmp_path, TOTAL, tmp_path / "step3.ckpt")
    assert later == tmp_path / "logs" / "version_1" / "torchinstruments"
    index = (later / "index.md").read_text(encoding="utf-8")
    assert f"whose run {run} could not be continued ({run} holds no run)" in index
    assert str(tmp_path / "step3.ckpt") in index


def test_an_explicit_output_dir_wins_over_the_checkpoints_run(tmp_path: Path) -> None:
    run = versioned_fit(tmp_path, FIRST, None)
    elsewhere = tmp_path / "elsewhere"
    assert versioned_fit(tmp_path, TOTAL, tmp_path / "step3.ckpt", output_dir=elsewhere) == (
        elsewhere
    )
    assert read_state(run).attempts[-1].attempt == 0  # the checkpoint's run is left as it was


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


def test_two_observers_in_one_trainer_each_keep_and_continue_their_own_run(
    tmp_path: Path,
) -> None:
    """Two callbacks (two parts of the model, each its own output_dir) in one Trainer: each has
    a checkpoint state of its own, so both fit and each resumed fit continues its own run."""
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)

    def fit(max_steps: int, ckpt: Path | None) -> list[LightningObserver]:
        observers = [
            LightningObserver(tmp_path / name, module=name, sampler=EveryNForwardsSampler(1))
            for name in ("net.0", "net.2")
        ]
        trainer = lightning.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            callbacks=[*observers, ModelCheckpoint(tmp_path / "ckpt", save_last=True)],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Tiny(), data, ckpt_path=None if ckpt is None else str(ckpt))
        return observers

    fit(2, None)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    runs = sorted(state["run_directory"] for state in saved.values() if "run_directory" in state)
    assert runs == [str(tmp_path / "net.0"), str(tmp_path / "net.2")]
    fit(4, tmp_path / "ckpt" / "last.ckpt")
    for name in ("net.0", "net.2"):
        history = pl.read_parquet(tmp_path / name / "history.parquet")
        assert set(history["layer"]) == {""}  # the observed part itself is the one layer
        samples = history.group_by("attempt").agg(pl.col("step").unique().sort()).sort("attempt")
        assert samples.rows() == [(0, [0, 1]), (1, [2, 3])]


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


def training_steps(run: Path) -> list[tuple[int, list[int]]]:
    """Per attempt, the steps of its training samples (those with gradient rows)."""
    history = pl.read_parquet(run / "history.parquet")
    grads = history.filter(pl.col("signal") == "output_gradient")
    return grads.group_by("attempt").agg(pl.col("step").unique().sort()).sort("attempt").rows()


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


def hf_fit(
    out: Path, max_steps: int, save: bool, resume: str | None, **options: Any
) -> HuggingFaceObserver:
    """A Trainer fit into `out` with a default-directory observer (every forward sampled),
    checkpointing every FIRST steps if `save`; returns the callback."""
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        save_strategy="steps" if save else "no",
        save_steps=FIRST,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **options,
    )
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), max_histogram_modules=1)
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=examples(32), callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=resume)
    return callback


@pytest.mark.parametrize("restore_callback_states", [False, True])
def test_an_hf_train_resumed_from_an_older_runs_checkpoint_continues_that_run(
    tmp_path: Path, restore_callback_states: bool
) -> None:
    """Two fits into one output_dir (the second a fresh one, torchinstruments-2), then a resume
    from the first fit's checkpoint: the checkpoint names its run, which the resumed fit
    continues; the later run is left as it was. With restore_callback_states_from_checkpoint,
    which rebuilds a callback whose class name the checkpoint keeps from its saved arguments,
    the user's callback (its sampler samples every forward) is the one that observes."""
    out = tmp_path / "out"
    first_run, later_run = out / "torchinstruments", out / "torchinstruments-2"
    assert hf_fit(out, FIRST, True, None).directory == first_run
    assert hf_fit(out, 2, False, None).directory == later_run
    first = pl.read_parquet(first_run / "history.parquet")
    later = pl.read_parquet(later_run / "history.parquet")
    resumed = hf_fit(
        out,
        TOTAL,
        False,
        str(out / f"checkpoint-{FIRST}"),
        restore_callback_states_from_checkpoint=restore_callback_states,
    )
    assert resumed.directory == first_run
    check_continued(first_run, first)
    assert_frame_equal(pl.read_parquet(later_run / "history.parquet"), later)
    assert [a.attempt for a in read_state(later_run).attempts] == [0]


def test_an_hf_checkpoint_that_names_no_run_says_which_run_was_continued(tmp_path: Path) -> None:
    """A checkpoint whose trainer_state.json keeps no run (written before checkpoints kept it):
    the resumed fit continues the last run under output_dir, and a warning and index.md say that
    it may not be the run that wrote the checkpoint."""
    out = tmp_path / "out"
    hf_fit(out, FIRST, True, None)
    later_run = out / "torchinstruments-2"
    assert hf_fit(out, 2, False, None).directory == later_run
    saved = out / f"checkpoint-{FIRST}" / "trainer_state.json"
    state = json.loads(saved.read_text(encoding="utf-8"))
    kept = state["stateful_callbacks"]
    assert kept.pop("torchinstruments.HuggingFaceObserver") == {
        "run_directory": str(out / "torchinstruments")
    }
    saved.write_text(json.dumps(state), encoding="utf-8")
    with pytest.warns(RuntimeWarning, match="names no run"):
        resumed = hf_fit(out, TOTAL, False, str(saved.parent))
    assert resumed.directory == later_run
    index = " ".join((later_run / "index.md").read_text(encoding="utf-8").split())
    assert (
        f"this fit resumed from the checkpoint of global step {FIRST}, which names no run"
    ) in index
    assert f"continued {later_run}, the last run under args.output_dir, which may not" in index


def test_an_hf_checkpoints_run_that_is_gone_is_named_in_index_md(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = out / "torchinstruments"
    assert hf_fit(out, FIRST, True, None).directory == run
    shutil.rmtree(run)
    with pytest.warns(RuntimeWarning, match="could not be continued"):
        resumed = hf_fit(out, TOTAL, False, str(out / f"checkpoint-{FIRST}"))
    assert resumed.directory == run  # a new run where the gone one was, said in index.md
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert (
        f"this fit resumed from the checkpoint of global step {FIRST}, whose run {run} could "
        f"not be continued ({run} holds no run)"
    ) in index
