"""A fit resumed behind the last step its run recorded evaluates again at steps an earlier
attempt evaluated at: index.md names those steps, with each attempt's evaluation samples there,
and every per-attempt count adds up to the run's.

The first attempt is a real process: it evaluates at global step 8 and is killed with SIGKILL at
step 9, before its checkpoint of step 9; the second resumes from checkpoint-6 (in this process,
or in a process killed at step 9 too) and evaluates at step 8 again. Counts are checked against history, never against the note.
"""

from __future__ import annotations

import functools
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning
import polars as pl
import pytest
import torch
from _forked import ended, killed_when_ready
from lightning.pytorch.callbacks import ModelCheckpoint
from test_huggingface_callback import examples, tiny_bert
from test_trainer_phases import Recorded
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from torchinstruments import EveryNForwardsSampler, HistoryConfig
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.state import read_state

EVAL_STEPS, SAVE_STEPS, KILLED_AT, TOTAL = 4, 3, 9, 10
REPEATED = "evaluated again at"


class ReadyAt(TrainerCallback):
    """At the end of global step `step` (before that step's checkpoint): say so and wait for
    the kill, once the rows written so far had a flush interval to reach the disk."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            time.sleep(1.0)  # ten flush intervals
            print("ready", file=sys.__stdout__, flush=True)
            time.sleep(120)


def train(out: Path, resume: str | None, *callbacks: TrainerCallback) -> None:
    """Evaluation every 4 steps (2 batches, recorded as their own series), a checkpoint every
    3 steps, every training and evaluation forward sampled."""
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=TOTAL,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
        eval_strategy="steps",
        eval_steps=EVAL_STEPS,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    observer = HuggingFaceObserver(
        sampler=EveryNForwardsSampler(1),
        record_eval=True,
        max_histogram_modules=1,
        history_config=HistoryConfig(flush_seconds=0.1),
    )
    trainer = Trainer(
        model=tiny_bert(),
        args=args,
        train_dataset=examples(64),
        eval_dataset=examples(4),
        callbacks=[observer, *callbacks],
    )
    trainer.train(resume_from_checkpoint=resume)


def evaluation_samples(history: pl.DataFrame) -> pl.DataFrame:
    """Per attempt and step, the evaluation samples (no train-mode row, no gradient row)."""
    training = (pl.col("mode") == "train") | (pl.col("signal") == "output_gradient")
    return (
        history.group_by("sample_id")
        .agg(training.any().alias("training"), pl.col("step").max(), pl.col("attempt").first())
        .filter(~pl.col("training"))
        .group_by("attempt", "step")
        .len()
        .sort("attempt", "step")
    )


@pytest.fixture(scope="module")
def first_attempt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first attempt, killed with SIGKILL at step 9, once for the file, and the second,
    resumed from its checkpoint-6 and killed at step 9 too: pristine copies of the output
    folder after each kill beside it (`killed_out` and `killed_twice_out` restore them for each
    test). An attempt importing transformers is the slow part, so both are children forked one
    after the other from one process that imported it (`killed_attempts`)."""
    root = tmp_path_factory.mktemp("first")
    done = subprocess.run(
        [sys.executable, __file__, str(root)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return root


def restored(root: Path, pristine: str) -> Path:
    """The output folder as a kill left it (`root/<pristine>`), at the path it ran in (its run
    directory's state and pages, and its checkpoints, name that path)."""
    out = root / "out"
    shutil.rmtree(out)
    shutil.copytree(root / pristine, out, symlinks=True)
    return out


@pytest.fixture
def killed_out(first_attempt: Path) -> Path:
    """The output folder after the first attempt's kill."""
    return restored(first_attempt, "pristine")


@pytest.fixture
def killed_twice_out(first_attempt: Path) -> Path:
    """The output folder after the second attempt's kill."""
    return restored(first_attempt, "pristine-twice")


def test_a_train_resumed_behind_its_last_evaluation_names_the_evaluations_it_repeats(
    killed_out: Path,
) -> None:
    out = killed_out
    assert not (out / f"checkpoint-{KILLED_AT}").exists()
    with pytest.warns(RuntimeWarning, match=REPEATED) as said:
        train(out, str(out / "checkpoint-6"))
    run = out / "torchinstruments"
    history = pl.read_parquet(run / "history.parquet")

    evaluated = evaluation_samples(history)
    # step 8 in both attempts; the Trainer also evaluates at its last step, 10
    assert evaluated.rows() == [(0, 4, 2), (0, 8, 2), (1, 8, 2), (1, 10, 2)]
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert (
        "attempt 1: this fit resumed at global step 6 and evaluated again at step 8, where "
        "earlier attempts had recorded evaluation samples too, so the evaluation samples at "
        "step 8 appear in more than one attempt (2 samples in attempt 0, 2 samples in this one)"
    ) in index
    assert (
        "attempt 1: this fit resumed at global step 6, and earlier attempts had recorded" in index
    )
    assert "steps 6 to 8 were trained again" in index

    # Every per-attempt count adds up to the run's, and each is its attempt's rows.
    state = read_state(run)
    assert [(a.attempt, a.ended) for a in state.attempts] == [(0, "killed"), (1, "removed")]
    per_attempt = history.group_by("attempt").agg(pl.col("sample_id").n_unique()).sort("attempt")
    assert [a.samples for a in state.attempts] == per_attempt["sample_id"].to_list()
    assert sum(a.samples for a in state.attempts) == history["sample_id"].n_unique()
    seen = [int(n) for n in re.findall(r"(\d+) evaluation forwards? (?:was|were) seen", index)]
    killed, this_attempt = (evaluated.filter(pl.col("attempt") == a)["len"].sum() for a in (0, 1))
    assert seen == [killed, this_attempt]
    # the killed attempt never reached its end-of-fit note: its count is as of its last save
    assert (
        f"attempt 0: up to the run's last save of its state while it went on, {killed} "
        "evaluation forwards were seen (record_eval) (a lower bound where the run ended without "
        "removal"
    ) in index
    assert f"attempt 1: {this_attempt} evaluation forwards were seen (record_eval)." in index
    assert state.attempts[1].eval_forwards == this_attempt

    # The Attempts table splits each attempt's forwards: every forward was sampled, so the
    # resumed attempt's training forwards are its training samples (steps 7 to 10, one batch
    # each); the killed attempt never wrote its counters: unknown, never 0.
    table = [line for line in index_lines(run) if re.match(r"\| \d+ \|", line)]
    trained = history.filter(pl.col("attempt") == 1, pl.col("mode") == "train")
    assert trained["sample_id"].n_unique() == TOTAL - 6
    assert any(
        line.endswith("| training forwards | evaluation forwards |") for line in index_lines(run)
    )
    assert table[0].endswith("| unknown | unknown |")
    assert table[1].endswith(f"| {TOTAL - 6} | {this_attempt} |")
    # Those unknown counts are where the samplers would have continued: the fallback (training
    # from the run's root forwards, evaluation forwards included; evaluation from 0) is said.
    first = state.attempts[1].first_forward_index
    assert (
        "attempt 1: attempt 0 ended without removal (killed) before it wrote how many training "
        "and how many evaluation forwards its samplers were asked about (record_eval), so this "
        f"attempt's samplers cannot continue where it left them: the training sampler is asked "
        f"from {first} on (the run's root forwards so far as its rows and TensorBoard events "
        "show, evaluation forwards included) and the evaluation sampler from 0 on"
    ) in index
    assert any("cannot continue where it left them" in str(w.message) for w in said)


def test_a_resumed_fit_killed_after_repeating_an_evaluation_still_names_it(
    killed_twice_out: Path,
) -> None:
    """Both attempts are real processes killed with SIGKILL at step 9: the second resumed from
    checkpoint-6 and evaluated at step 8 again before its kill, so its fit never ended. The
    repeated evaluation is still said once the run is finalized, with each attempt's evaluation
    samples there as history holds them; the steps it trained again are said once, by the note
    read from history (its fit-start note on them, kept live, is superseded)."""
    run = killed_twice_out / "torchinstruments"
    finalize(run)
    history = pl.read_parquet(run / "history.parquet")
    evaluated = evaluation_samples(history)
    at_8 = dict(evaluated.filter(pl.col("step") == 8).select("attempt", "len").iter_rows())
    assert set(at_8) == {0, 1}  # both attempts evaluated at step 8
    assert [(a.attempt, a.ended) for a in read_state(run).attempts] == [
        (0, "killed"),
        (1, "killed"),
    ]
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert (
        f"attempt 1: evaluated again at step 8, where earlier attempts had recorded evaluation "
        f"samples too, so the evaluation samples at step 8 appear in more than one attempt "
        f"({samples(at_8[0])} in attempt 0, at least {samples(at_8[1])} in attempt 1)"
    ) in index
    # the steps both attempts trained, from history: resumed at 6, killed after step 9
    training = (pl.col("mode") == "train") | (pl.col("signal") == "output_gradient")
    trained = (
        history.group_by("sample_id")
        .agg(training.any().alias("training"), pl.col("step").max(), pl.col("attempt").first())
        .filter(pl.col("training"))
    )
    steps = [set(trained.filter(pl.col("attempt") == a)["step"].to_list()) for a in (0, 1)]
    both = sorted(steps[0] & steps[1])
    assert both == [6, 7, 8]
    per_attempt = [
        trained.filter(pl.col("attempt") == a, pl.col("step").is_in(both)).height for a in (0, 1)
    ]
    assert (
        f"attempt 1: trained again at steps 6-8, where earlier attempts had recorded training "
        f"samples too, so the training samples at steps 6-8 appear in more than one attempt "
        f"({samples(per_attempt[0])} in attempt 0, at least {samples(per_attempt[1])} in "
        "attempt 1)"
    ) in index
    assert "attempt 1: this fit resumed at global step 6" not in index
    assert index.count("trained again") == 1


def index_lines(run: Path) -> list[str]:
    return (run / "index.md").read_text(encoding="utf-8").splitlines()


def samples(n: int) -> str:
    return "1 sample" if n == 1 else f"{n} samples"


def lightning_fit(tmp_path: Path, max_steps: int, ckpt: Path | None) -> list[tuple[str, int]]:
    """Validation every 2 batches (one batch), a checkpoint every 2 steps, every forward
    sampled into `tmp_path/run`; returns the (phase, global step) of every call of the model."""
    model = Recorded()
    train_data = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    val = TensorDataset(torch.randn(4, 4), torch.randint(0, 2, (4,)))
    trainer = lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        val_check_interval=2,
        num_sanity_val_steps=1,
        callbacks=[
            LightningObserver(tmp_path / "run", sampler=EveryNForwardsSampler(1), record_eval=True),
            ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        model,
        DataLoader(train_data, batch_size=4),
        DataLoader(val, batch_size=4),
        ckpt_path=None if ckpt is None else str(ckpt),
    )
    return model.calls


def test_a_lightning_fit_resumed_behind_names_the_evaluation_steps_both_attempts_sampled(
    tmp_path: Path,
) -> None:
    """Which evaluations a resumed Lightning fit repeats (its sanity check at the restored step,
    validation after the checkpoint's step) is read from what each fit did: the note names
    exactly the steps both fits' evaluation forwards ran at, with the counts history holds."""
    first = lightning_fit(tmp_path, 7, None)  # checkpoints at steps 2, 4, 6
    with pytest.warns(RuntimeWarning, match=REPEATED):
        second = lightning_fit(tmp_path, 7, tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    both = sorted({s for p, s in first if p == "eval"} & {s for p, s in second if p == "eval"})
    assert both  # the resumed fit evaluated again where the first had
    run = tmp_path / "run"
    evaluated = evaluation_samples(pl.read_parquet(run / "history.parquet"))
    per_attempt = {
        attempt: int(
            evaluated.filter(pl.col("attempt") == attempt, pl.col("step").is_in(both))["len"].sum()
        )
        for attempt in (0, 1)
    }
    assert per_attempt == {
        0: sum(p == "eval" and s in both for p, s in first),
        1: sum(p == "eval" and s in both for p, s in second),
    }
    where = f"step {both[0]}" if len(both) == 1 else f"steps {', '.join(map(str, both))}"
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert (
        f"attempt 1: this fit resumed at global step 4 and evaluated again at {where}, where "
        "earlier attempts had recorded evaluation samples too, so the evaluation samples at "
        f"{where} appear in more than one attempt ({samples(per_attempt[0])} in "
        f"attempt 0, {samples(per_attempt[1])} in this one)"
    ) in index


def killed_attempt(out: Path, resume: str | None) -> None:
    """One attempt in a child forked from this process, SIGKILLed once it says ready."""
    attempt = functools.partial(train, out, resume, ReadyAt(KILLED_AT))
    status = killed_when_ready("ready", attempt, quiet=True)  # the Trainer prints its logs
    assert status == -signal.SIGKILL, (
        f"the attempt resumed from {resume} never reached step {KILLED_AT}"
    )


def killed_attempts(root: Path) -> None:
    """Both killed attempts into `root/out`, a pristine copy after each."""
    out = root / "out"
    killed_attempt(out, None)
    shutil.copytree(out, root / "pristine", symlinks=True)
    killed_attempt(out, str(out / "checkpoint-6"))
    shutil.copytree(out, root / "pristine-twice", symlinks=True)


if __name__ == "__main__":
    killed_attempts(Path(sys.argv[1]))
    ended()
