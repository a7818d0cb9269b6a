"""`HuggingFaceObserver(record_eval=True)` on a Trainer that compiles regionally through
accelerate: the Trainer trains the compiled copy (`model_wrapped`), which the callback observes,
but evaluates inside the fit through `trainer.model`, the module that copy was built from. Those
evaluation forwards are observed all the same: sampled on their own count, mode eval, under the
eager model's layer names, as in an uncompiled fit.

The reference is an uncompiled fit of the same steps."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch._dynamo
from test_huggingface_callback import examples, tiny_bert
from torch import nn
from transformers import Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler, has_observer
from torchinstruments.integrations import HuggingFaceObserver

from conftest import read_history

STEPS = 4
EVAL_BATCHES = 2  # 8 evaluation examples, 4 a batch


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


def fit(tmp_path: Path, compiled: bool) -> tuple[pl.DataFrame, Trainer, nn.Module]:
    """STEPS training steps with an evaluation after step 2 and 4; the history, the Trainer
    and the model it was given."""
    torch.manual_seed(0)
    model = tiny_bert()
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(2), record_eval=True)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        torch_compile=compiled,
        torch_compile_backend="eager" if compiled else None,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=examples(),
        eval_dataset=examples(4 * EVAL_BATCHES),
        callbacks=[callback],
    )
    trainer.train()
    return read_history(tmp_path / "out" / "torchinstruments"), trainer, model


def test_evaluation_through_the_model_a_regional_copy_was_built_from_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, _, _ = fit(tmp_path / "eager", compiled=False)
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    history, trainer, model = fit(tmp_path / "regional", compiled=True)
    assert trainer.model_wrapped is not model  # accelerate built a new module
    assert trainer.model is model  # the one evaluation calls
    assert not has_observer(model)
    assert not has_observer(trainer.model_wrapped)
    assert all("forward" not in m.__dict__ for m in model.modules())  # restored at the end

    def per_mode(frame: pl.DataFrame) -> list[tuple[str, int]]:
        samples = frame.group_by("mode").agg(pl.col("sample_id").n_unique()).sort("mode")
        return [(mode, n) for mode, n in samples.rows()]

    # Evaluation forwards: 2 evaluations of EVAL_BATCHES batches, every 2nd sampled.
    assert per_mode(eager) == [("eval", 2), ("train", 2)]
    assert per_mode(history) == per_mode(eager)
    evaluation = history.filter(pl.col("mode") == "eval")
    assert set(evaluation["layer"]) == set(eager.filter(pl.col("mode") == "eval")["layer"])
    assert set(evaluation["signal"]) == {"output"}
