"""Under `record_eval`, Lightning's sanity check is sampled into the evaluation series like a
validation, but it checks the model before training on `num_sanity_val_steps` batches: index.md
says how many of the evaluation samples are its, and where they are, so a reader of the
validations can leave them out. The calls are recorded by the module itself, with Lightning's
own `trainer.sanity_checking`."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import test_trainer_phases
from test_trainer_phases import Recorded, lightning_fit

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver

from conftest import read_history


class SanityRecorded(Recorded):
    """`Recorded`, also noting whether each call was the sanity check's."""

    def __init__(self) -> None:
        super().__init__()
        self.sanity: list[bool] = []
        self.register_forward_pre_hook(lambda *_: self.sanity.append(self.trainer.sanity_checking))


def test_index_md_names_the_sanity_checks_evaluation_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_trainer_phases, "Recorded", SanityRecorded)  # lightning_fit's model
    callback = LightningObserver(
        tmp_path / "run", sampler=EveryNForwardsSampler(2), record_eval=True
    )
    model = lightning_fit(tmp_path, callback)
    assert isinstance(model, SanityRecorded)
    # forward_index counts every call (record_eval): the sanity check's are the first ones
    history = read_history(tmp_path / "run")
    checked = [i for i, sanity in enumerate(model.sanity) if sanity]
    assert checked == [0, 1]
    sampled = history.filter(pl.col("forward_index").is_in(checked))
    assert set(sampled["mode"]) == {"eval"}
    ids = sorted(set(sampled["sample_id"]))
    assert ids == [0]  # every second evaluation forward: the first of the two
    first_train = history.filter(pl.col("mode") == "train")["forward_index"].min()
    before = history.filter(pl.col("mode") == "eval", pl.col("forward_index") < first_train)
    assert sorted(set(before["sample_id"])) == ids
    index = " ".join((tmp_path / "run" / "index.md").read_text(encoding="utf-8").split())
    assert (
        "the sanity check ran 2 evaluation forwards before the first training step "
        "(num_sanity_val_steps), and record_eval took 1 sample of them into the evaluation "
        "series, as a validation's: it is this attempt's first evaluation sample (step 0, "
        "before its first training sample)"
    ) in index
