"""A resumed fit that keeps training and evaluation forwards apart (`record_eval`): each sampler
continues on its own count, an older state without those counts resumes by the earlier rule,
and the evaluation forwards no attempt observed are summed or said unknown."""

from __future__ import annotations

import json
from pathlib import Path

import lightning
import polars as pl
import pytest
import torch
from test_trainer_phases import Recorded
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver
from torchinstruments.rundir.state import read_state


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
