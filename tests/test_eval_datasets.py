"""A fit that evaluates several datasets under record_eval (a Hugging Face dict `eval_dataset`,
Lightning's several validation dataloaders): their samples share each evaluation's step, so
index.md lists which sample ids are each dataset's, checked against the model's own record of
which dataset each call was."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning
import torch
from test_huggingface_callback import tiny_bert
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver
from torchinstruments.integrations._eval_sets import SETS, SHOWN, EvaluationSets
from torchinstruments.records import SampleRecord

from conftest import one_mean, read_history, read_spans

SAID = "the fit's evaluations ran 2 evaluation datasets ("


def sample_ids(calls: list[str], name: str) -> str:
    """The ranges of the calls of `name` (every forward is a sample: sample_id = call order)."""
    ids = [i for i, called in enumerate(calls) if called == name]
    spans: list[list[int]] = []
    for i in ids:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def datasets_note(run: Path) -> str:
    """index.md's note on the datasets (one line)."""
    lines = (run / "index.md").read_text(encoding="utf-8").splitlines()
    [note] = [line for line in lines if SAID in line]
    return note


def examples(n: int, length: int) -> list[dict[str, torch.Tensor]]:
    """`n` examples of `length` tokens: the length tells the datasets apart in the model's record."""
    generator = torch.Generator().manual_seed(length)
    return [
        {
            "input_ids": torch.randint(0, 32, (length,), generator=generator),
            "labels": torch.tensor(i % 2),
        }
        for i in range(n)
    ]


class PredictsAtFirstStep(TrainerCallback):
    """Another callback that runs `trainer.predict()` inside the fit, after the first step."""

    trainer: Trainer

    def on_step_end(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            self.trainer.predict(examples(2, 3))  # type: ignore[arg-type]


def test_huggingface_record_eval_names_each_eval_datasets_samples(tmp_path: Path) -> None:
    """A predict() inside the fit (another callback's) is none of the datasets' samples."""
    model = tiny_bert()
    calls: list[str] = []
    names = {6: "train", 5: "eval_first", 4: "eval_second", 3: "predict"}
    model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(names[kw["input_ids"].shape[1]]), with_kwargs=True
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
        per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), record_eval=True)
    evaluated = {"first": examples(2, 5), "second": examples(4, 4)}
    predicts = PredictsAtFirstStep()
    predicts.trainer = Trainer(
        model=model, args=args, train_dataset=examples(8, 6), eval_dataset=evaluated,  # type: ignore[arg-type]
        callbacks=[callback, predicts],
    )  # fmt: skip
    predicts.trainer.train()
    assert [calls.count("eval_first"), calls.count("eval_second")] == [2, 4]  # 1 + 2 batches, x2
    assert calls.count("predict") == 1
    run = tmp_path / "out" / "torchinstruments"
    assert sorted(read_history(run)["sample_id"].unique()) == list(range(len(calls)))
    note = datasets_note(run)
    assert read_spans(note)[:4] == ["eval_<name>_loss", "eval_loss", "eval_first", "eval_second"]
    assert (
        f"`eval_first`: sample_id {sample_ids(calls, 'eval_first')}; "
        f"`eval_second`: sample_id {sample_ids(calls, 'eval_second')}."
    ) in note


class TwoLoaders(lightning.LightningModule):
    """Validates on two dataloaders; every call records its dataloader (or training)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.calls: list[str] = []
        self.loader = "train"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(self.loader)
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.loader = "train"
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.loader = f"dataloader_idx_{dataloader_idx}"
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_record_eval_names_each_validation_dataloaders_samples(tmp_path: Path) -> None:
    model = TwoLoaders()
    callback = LightningObserver(
        tmp_path / "run", sampler=EveryNForwardsSampler(1), record_eval=True
    )
    trainer = lightning.Trainer(
        max_steps=4, val_check_interval=2, num_sanity_val_steps=1, accelerator="cpu", devices=1,
        logger=False, callbacks=[callback], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = [TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,))) for n in (16, 8, 4)]
    trainer.fit(
        model, DataLoader(data[0], batch_size=4), [DataLoader(d, batch_size=4) for d in data[1:]]
    )
    assert model.calls.count("dataloader_idx_0") == 5  # sanity check 1, validations 2 x 2
    assert model.calls.count("dataloader_idx_1") == 3
    run = tmp_path / "run"
    assert sorted(read_history(run)["sample_id"].unique()) == list(range(len(model.calls)))
    note = datasets_note(run)
    assert (
        f"`dataloader_idx_0`: sample_id {sample_ids(model.calls, 'dataloader_idx_0')}; "
        f"`dataloader_idx_1`: sample_id {sample_ids(model.calls, 'dataloader_idx_1')}."
    ) in note


def test_the_datasets_note_keeps_its_size_whatever_the_evaluations() -> None:
    """Many datasets, each evaluated often: the note lists the first SETS datasets' first
    SHOWN ranges and counts the rest (index.md has a size budget)."""
    sets = EvaluationSets()
    sample_id = 0
    for _ in range(SHOWN + 5):  # one evaluation: a sample of each dataset
        for loader in range(SETS + 2):
            sets.running(f"dataloader_idx_{loader}")
            record = dataclasses.replace(one_mean(sample_id), mode="eval")
            sets.write_forward(SampleRecord("output", sample_id, sample_id, (record,)))
            sample_id += 1
    note = sets.note("their metrics")
    assert note is not None
    first = ", ".join(str(i * (SETS + 2)) for i in range(SHOWN))
    assert f"`dataloader_idx_0`: sample_id {first}, ... (5 more samples); " in note
    assert "`dataloader_idx_7`: sample_id 7, 17," in note
    assert "dataloader_idx_8" not in note
    assert note.endswith(
        "; and 2 more datasets. A summary over all evaluation samples "
        "(result.json's eval entries, a window mean) mixes the datasets"
    )
