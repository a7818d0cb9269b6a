"""A Hugging Face `train()` that raised outside its training step: transformers tells callbacks
nothing, so `HuggingFaceObserver` finishes the run at the next use of the model (a forward, or
the next fit's start), as interrupted, and the model is then as if never observed."""

from __future__ import annotations

import gc
import re
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import polars as pl
import pytest
import torch
from test_huggingface_callback import examples, tiny_bert
from torch import nn
from transformers import (
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
    default_data_collator,
)

from torchinstruments import EveryNForwardsSampler, has_observer
from torchinstruments.integrations import HuggingFaceObserver

from conftest import read_history, run_status

ENDED = "the fit ended at global step 1 without on_train_end: train() raised outside"
WARNED = re.escape(ENDED)


def arguments(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    given: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    given.update(overrides)
    return TrainingArguments(**given)


class RaiseAtStepEnd(TrainerCallback):
    """Another callback that raises after the first optimizer step."""

    def on_step_end(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            raise RuntimeError("boom in a callback")


class BoomSGD(torch.optim.SGD):
    """An optimizer whose second step raises (after the second training step's backward)."""

    steps = 0

    def step(self, closure: Any = None) -> Any:
        BoomSGD.steps += 1
        if BoomSGD.steps == 2:
            raise RuntimeError("boom in the optimizer step")
        return super().step(closure)


def raising_collator() -> Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
    """A data collator whose batch for the second step raises (accelerate's loader collates one
    batch ahead: the third collated is the second step's)."""
    made: list[int] = []

    def collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        made.append(len(features))
        if len(made) == 3:
            raise RuntimeError("boom in the data collator")
        return default_data_collator(features)

    return collate


def raise_in_compute_metrics(prediction: Any) -> dict[str, float]:
    raise RuntimeError("boom in compute_metrics")


def failing_trainer(tmp_path: Path, model: nn.Module, where: str, callback: Any) -> Trainer:
    """A Trainer whose train() raises outside the training step, after one optimizer step."""
    if where == "compute_metrics":  # the evaluation after step 1 (its forward runs first)
        return Trainer(
            model=model, args=arguments(tmp_path, eval_strategy="steps", eval_steps=1),
            train_dataset=examples(), eval_dataset=examples(4), callbacks=[callback],
            compute_metrics=raise_in_compute_metrics,
        )  # fmt: skip
    if where == "callback":
        return Trainer(
            model=model, args=arguments(tmp_path), train_dataset=examples(),
            callbacks=[callback, RaiseAtStepEnd()],
        )  # fmt: skip
    if where == "collator":
        return Trainer(
            model=model, args=arguments(tmp_path), train_dataset=examples(),
            callbacks=[callback], data_collator=raising_collator(),
        )  # fmt: skip
    BoomSGD.steps = 0
    return Trainer(
        model=model, args=arguments(tmp_path), train_dataset=examples(), callbacks=[callback],
        optimizers=(BoomSGD(model.parameters(), lr=1e-3), None),
    )  # fmt: skip


def train_and_handle(trainer: Trainer) -> list[weakref.ref[Any]]:
    """`trainer.train()`, raised and handled in this frame: weak references to a tensor local to
    it and to the Trainer's optimizer, alive as long as anything keeps that frame or the Trainer."""
    local = torch.ones(8)
    with pytest.raises(RuntimeError, match="boom in"):
        trainer.train()
    return [weakref.ref(local), weakref.ref(trainer.optimizer)]


def no_proxies(model: nn.Module) -> bool:
    return all("forward" not in module.__dict__ for module in model.modules())


@pytest.mark.parametrize("where", ["compute_metrics", "callback", "collator", "optimizer"])
def test_a_later_evaluate_finishes_the_failed_fit_as_interrupted_and_runs_unobserved(
    tmp_path: Path, where: str
) -> None:
    model = tiny_bert()
    observer = HuggingFaceObserver(sampler=EveryNForwardsSampler(1))
    trainer = failing_trainer(tmp_path, model, where, observer)
    local = train_and_handle(trainer)[0]
    gc.collect()
    # The callback watches the failed train() frame, never keeps it: the locals of its callers
    # are freed once the exception is handled (before, they lived until the model's next use).
    assert local() is None
    trainer.compute_metrics = None  # the user's fixes
    trainer.pop_callback(RaiseAtStepEnd)
    trainer.data_collator = default_data_collator
    with pytest.warns(RuntimeWarning, match=WARNED):
        metrics = trainer.evaluate(eval_dataset=cast(Any, examples(4)))
    assert "eval_loss" in metrics
    assert not has_observer(model)
    assert no_proxies(model)
    assert "training_step" not in trainer.__dict__

    run = tmp_path / "out" / "torchinstruments"
    assert run_status(run) == "complete"
    index = (run / "index.md").read_text(encoding="utf-8")
    assert ENDED in index
    assert "saw it at the model's first forward after it" in index
    # The training forwards before the exception have their rows (the optimizer's raised after
    # the second forward); the evaluation after the fit is not the fit's: only the
    # compute_metrics fit evaluated inside the fit (one batch).
    trained = [0, 1] if where == "optimizer" else [0]
    assert sorted(read_history(run)["forward_index"].unique()) == trained
    inside = 1 if where == "compute_metrics" else 0
    for count in (1, 2):
        said = f"{count} evaluation forward{'s' if count > 1 else ''} inside the fit"
        assert (said in index) == (count == inside), said

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next fit is a fresh one: nothing left to say
        trainer.train()
    second = tmp_path / "out" / "torchinstruments-2"
    assert observer.directory == second
    assert run_status(second) == "complete"
    assert sorted(read_history(second)["forward_index"].unique()) == [0, 1, 2]


def test_a_new_trainer_and_callback_on_the_same_model_start_a_run_of_their_own(
    tmp_path: Path,
) -> None:
    model = tiny_bert()
    held = train_and_handle(failing_trainer(tmp_path, model, "collator", HuggingFaceObserver()))
    gc.collect()
    # Neither the failed train() frame nor its Trainer (its optimizer, dataloaders) is kept by
    # the callback, which the still observed model holds: freed once the exception is handled.
    assert [ref() for ref in held] == [None, None]
    observer = HuggingFaceObserver(sampler=EveryNForwardsSampler(1))
    trainer = Trainer(
        model=model, args=arguments(tmp_path), train_dataset=examples(), callbacks=[observer]
    )
    with pytest.warns(RuntimeWarning, match=WARNED):
        trainer.train()  # before: refused, the model still had the failed fit's observer
    first = tmp_path / "out" / "torchinstruments"
    assert "saw it when a fit with another callback started" in (first / "index.md").read_text(
        encoding="utf-8"
    )
    assert run_status(first) == "complete"
    second = tmp_path / "out" / "torchinstruments-2"
    assert observer.directory == second
    assert sorted(read_history(second)["forward_index"].unique()) == [0, 1, 2]
    assert not has_observer(model)
    assert no_proxies(model)


def test_a_direct_forward_after_a_failed_train_is_the_models_own(tmp_path: Path) -> None:
    model = tiny_bert()
    trainer = failing_trainer(tmp_path, model, "optimizer", HuggingFaceObserver())
    with pytest.raises(RuntimeError, match="boom in the optimizer step"):
        trainer.train()
    batch = default_data_collator(examples(4))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=WARNED):
        model(**batch)
    assert not has_observer(model)
    assert no_proxies(model)
    run = tmp_path / "out" / "torchinstruments"
    assert run_status(run) == "complete"
    assert "1 evaluation forward inside the fit" not in (run / "index.md").read_text(
        encoding="utf-8"
    )


def test_a_later_evaluate_takes_no_sample_into_the_failed_fits_run_with_record_eval(
    tmp_path: Path,
) -> None:
    model = tiny_bert()
    observer = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), record_eval=True)
    trainer = failing_trainer(tmp_path, model, "compute_metrics", observer)
    with pytest.raises(RuntimeError, match="boom in compute_metrics"):
        trainer.train()
    trainer.compute_metrics = None
    with pytest.warns(RuntimeWarning, match=WARNED):
        trainer.evaluate(eval_dataset=cast(Any, examples(4)))
    history = read_history(tmp_path / "out" / "torchinstruments")
    # One training forward, then the fit's one evaluation batch (its compute_metrics raised):
    # the evaluation after the fit is no sample of its run.
    samples = history.group_by("forward_index").agg(pl.col("mode").first()).sort("forward_index")
    assert samples.rows() == [(0, "train"), (1, "eval")]
