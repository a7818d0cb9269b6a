"""`HuggingFaceObserver` on a Trainer that compiles regionally through accelerate.

With `ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1` (or `TorchDynamoPlugin(
use_regional_compilation=True)`) and `torch_compile=True`, accelerate's `compile_regions` builds a
new module object that shares the model's blocks, each wrapped in torch.compile, and the Trainer
trains that one (`model_wrapped`) while callbacks are handed the model it was built from. The
training forwards must be recorded all the same, under the eager model's layer names, with the
values an uncompiled run of the same steps records.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch._dynamo
from test_huggingface_callback import examples, tiny_bert
from torch import nn
from torch._dynamo.utils import counters
from transformers import Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler, has_observer
from torchinstruments.integrations import HuggingFaceObserver

from conftest import read_history, run_status

STEPS = 4


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


def train(tmp_path: Path, compiled: bool) -> tuple[Trainer, nn.Module]:
    """Train a tiny BERT for STEPS steps; the Trainer and the model it was given."""
    torch.manual_seed(0)
    model = tiny_bert()
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(2))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        torch_compile=compiled,
        torch_compile_backend="eager" if compiled else None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=examples(), callbacks=[callback])
    trainer.train()
    return trainer, model


def test_regionally_compiled_training_is_recorded_as_the_uncompiled_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train(tmp_path / "eager", compiled=False)
    eager = read_history(tmp_path / "eager" / "out" / "torchinstruments")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer, model = train(tmp_path / "regional", compiled=True)
    assert [str(w.message) for w in said if "torchinstruments" in str(w.message)] == []
    wrapped = trainer.model_wrapped
    assert wrapped is not model  # accelerate built a new module
    assert counters["stats"]["unique_graphs"] >= 1  # its regions ran compiled
    assert not has_observer(model)
    assert not has_observer(wrapped)
    assert all("forward" not in m.__dict__ for m in model.modules())
    # The only instance forwards left are torch.compile's own, on its wrappers.
    left = [m.__dict__["forward"] for m in wrapped.modules() if "forward" in m.__dict__]
    assert left
    assert all(f.__module__.startswith("torch.") for f in left)
    run = tmp_path / "regional" / "out" / "torchinstruments"
    assert run_status(run) == "complete"
    history = read_history(run)
    assert sorted(history["forward_index"].unique()) == [0, 2]
    assert set(history["layer"].unique()) == set(eager["layer"].unique())
    assert not any("_orig_mod" in layer for layer in history["layer"].unique())
    # The first sample comes before any optimizer step: the same weights and batch as eager.
    first = history.filter(history["forward_index"] == 0)
    want = eager.filter(eager["forward_index"] == 0)
    keys = ["layer", "call_index", "signal", "tensor_path", "metric"]
    first, want = first.sort(keys), want.sort(keys)
    assert first.select(keys).equals(want.select(keys))
    assert first["value"].to_list() == pytest.approx(want["value"].to_list(), rel=1e-5, abs=1e-6)
