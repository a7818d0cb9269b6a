"""The Hugging Face Trainer's `auto_find_batch_size=True` runs its training loop again inside one
`train()` after a step that ran out of memory, with a smaller batch and global steps from 0
again: `HuggingFaceObserver` continues the run as a new attempt each time (never a run of its
own per retry, never a refused directory that raises out of `train()`), and index.md says which
attempt is a retry, with its batch size.

Running out of memory is the exception accelerate takes for it (a RuntimeError naming the CPU
allocator), raised while the batch is larger than 2 by the test's own loss after the model's
forward (inside the training step), or in a callback at the step's start, before its first
forward (outside the training step, where callbacks hear of no exception, as of one in the
optimizer step): per_device_train_batch_size=3 fails once, and the retry trains with 2.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import accelerate.utils.memory
import polars as pl
import pytest
from test_huggingface_callback import examples, tiny_bert
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver

from conftest import read_history

OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes"


class OutOfMemoryAbove2(Trainer):
    """Its loss raises accelerate's out-of-memory error, after the forward, for batches over 2."""

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if inputs["input_ids"].shape[0] > 2:
            raise RuntimeError(OOM)
        return loss


class OutOfMemoryAtTheStepStart(TrainerCallback):
    """Raises accelerate's out-of-memory error as a step begins, for batches over 2."""

    def on_step_begin(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> None:
        if state.train_batch_size is not None and state.train_batch_size > 2:
            raise RuntimeError(OOM)


@pytest.mark.parametrize(("explicit", "in_step"), [(False, True), (True, True), (True, False)])
def test_a_retry_with_a_smaller_batch_continues_the_run_as_an_attempt(
    tmp_path: Path, explicit: bool, in_step: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`in_step`: the loss runs out of memory (inside the training step), else a callback at
    the step's start (outside it, before any training step); `explicit`: the callback's
    output_dir, else its default."""
    # accelerate empties the device cache around each try with a full gc.collect(), seconds
    # in a test process holding a whole suite's objects: skipped, nothing here depends on it
    monkeypatch.setattr(accelerate.utils.memory, "clear_device_cache", lambda **_: None)
    given = tmp_path / "run"
    callback = HuggingFaceObserver(
        given if explicit else None, sampler=EveryNForwardsSampler(1), max_histogram_modules=1
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=3,
        auto_find_batch_size=True, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = (OutOfMemoryAbove2 if in_step else Trainer)(
        model=tiny_bert(),
        args=args,
        train_dataset=examples(),
        callbacks=[callback, *(() if in_step else (OutOfMemoryAtTheStepStart(),))],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()  # never raises: the Trainer retried, the callback went on
    run = given if explicit else tmp_path / "out" / "torchinstruments"
    assert callback.directory == run
    assert sorted(p.name for p in (tmp_path / "out").glob("torchinstruments*")) == (
        [] if explicit else ["torchinstruments"]
    )
    history = read_history(run)
    samples = (
        history.filter(pl.col("layer") == "bert.embeddings.word_embeddings")
        .group_by("sample_id")
        .agg(pl.col("attempt").first(), pl.col("step").first(), pl.col("shape").first())
        .sort("sample_id")
    )
    assert [
        (a, s, shape[0]) for a, s, shape in samples.select("attempt", "step", "shape").rows()
    ] == [
        *([(0, 0, 3)] if in_step else []),  # the step that ran out of memory: its forward's rows
        (1, 0, 2),  # the retry, from global step 0 again, with batches of 2
        (1, 1, 2),
    ]
    state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
    assert [a.get("continued_by") for a in state["attempts"]] == [None, "retry"]
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    raised = "training step raised RuntimeError" if in_step else "raised outside its training step"
    said = (
        "this attempt is the Trainer's retry of its training loop inside the same train() call, "
        f"with a train batch size of 2 (auto_find_batch_size: the previous attempt's {raised}, "
        "which the Trainer took for running out of memory): its global steps start again from 0"
    )
    assert f"attempt 1: {said}" in index
    # The retry repeats the failed step 0, and is said as a retry: it resumed nothing.
    repeated = (
        "attempt 1: this attempt, the trainer's retry of its training loop, started again at "
        "global step 0, and earlier attempts had recorded training samples up to step 0"
    )
    assert (repeated in index) is in_step  # outside the step, attempt 0 trained no step
    assert "resumed at global step" not in index
    ended = (
        f"the fit ended with an exception at global step 0: RuntimeError: {OOM}"
        if in_step
        else "the fit's training loop ended at global step 0 without on_train_end, and the "
        "Trainer ran it again inside the same train() call (auto_find_batch_size)"
    )
    assert f"attempt 0: {ended}" in index
    assert "the fit ran no training step" not in index  # it was not its step limit
    assert len([w for w in caught if said in str(w.message)]) == 1
