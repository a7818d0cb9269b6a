"""A count of 1 reads as one thing: "1 evaluation forward was", never "1 evaluation forwards
were", in the trainer notes and everywhere index.md counts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lightning
import pytest
import torch
from test_trainer_phases import Recorded
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver
from torchinstruments.records import RunCounts
from torchinstruments.rundir.attempts import REMOVED, AttemptCounts, Continuation
from torchinstruments.rundir.ledger import LostRows
from torchinstruments.rundir.ranges import plural, was_were
from torchinstruments.rundir.unsampled import no_sample_warning, unsampled_sentence


def test_plural_names_one_thing_in_the_singular() -> None:
    assert [plural(n, "sample") for n in (0, 1, 2)] == ["0 samples", "1 sample", "2 samples"]
    assert plural(1, "directory", "directories") == "1 directory"
    assert plural(3, "directory", "directories") == "3 directories"
    assert [was_were(n) for n in (0, 1, 2)] == ["were", "was", "were"]


def test_index_md_says_one_root_forward_was_seen() -> None:
    counts = RunCounts(root_forwards=1, samples=0, backward_samples=0)
    assert unsampled_sentence(counts) == "1 root forward was seen and the sampler chose none"


def test_an_attempt_without_a_sample_counts_the_earlier_samples_whose_rows_history_holds() -> None:
    """A removed attempt took samples 0 to 2, and sample 2's rows were never written (the loss
    ledger's): the next attempt, sampling nothing, says history holds rows of 2 of them."""
    earlier = AttemptCounts(0, "2026-01-01T00:00:00+00:00", samples=3, ended=REMOVED)
    continued = Continuation(1, 3, 6, 1, (earlier,), samples_held=2)
    counts = RunCounts(root_forwards=0, samples=0, backward_samples=0)
    assert no_sample_warning(counts, Path("/runs/a"), continued) == (
        "torchinstruments: this attempt recorded no sample (0 root forwards seen, none "
        "sampled): /runs/a holds none of its rows, and rows of 2 of the 3 samples the earlier "
        "attempts took (sample_id 0 to 2; the rest were recorded but not written, as index.md "
        "says); its index.md's Attempts table says so"
    )
    every = dataclasses.replace(continued, samples_held=3)  # all of them: the count is exact
    assert "holds the earlier attempts' 3 samples (sample_id 0 to 2)" in no_sample_warning(
        counts, Path("/runs/a"), every
    )


def test_the_loss_ledger_says_one_row_was_not_written() -> None:
    loss = LostRows(rows=1, first_sample_id=4, last_sample_id=4, reason="disk full")
    assert loss.describe().startswith("1 row of sample 4 was recorded but not written")


def one_sanity_batch_fit(tmp_path: Path, callback: LightningObserver) -> None:
    """Two training steps and a sanity check of one validation batch, no validation after."""
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    trainer = lightning.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=1,
        check_val_every_n_epoch=10,
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(data, batch_size=4)
    trainer.fit(Recorded(), loader, DataLoader(data, batch_size=4))


@pytest.mark.parametrize("record_eval", [False, True])
def test_a_fit_with_one_evaluation_forward_says_one(tmp_path: Path, record_eval: bool) -> None:
    run = tmp_path / "run"
    callback = LightningObserver(run, sampler=EveryNForwardsSampler(1), record_eval=record_eval)
    one_sanity_batch_fit(tmp_path, callback)
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    if record_eval:
        assert "**Note:** 1 evaluation forward was seen (record_eval)." in index
    else:
        assert (
            "**Note:** 1 evaluation forward inside the fit (sanity check, validation, evaluation "
            "the trainer runs during training: forwards outside a training step, and those "
            "under no_grad inside a training step, which no backward follows, as generate()'s) "
            "was not "
            "observed: it takes no sample and forward_index does not count it"
        ) in index
        assert "1 evaluation forward ran unobserved" in index
    assert "1 evaluation forwards" not in index
