"""One trainer callback used for several fits: each fit's run samples like the first.

A sampler keeps state (the default `TimeIntervalSampler` its last sample time), so each fit's run
is sampled by a fresh copy of the sampler as the callback was built with it. Real trainers, the
default sampler: every fit's first training forward is a sample, well inside its 60 s interval.
A fit of a trainer that had finished trains nothing: its run says so, and why. What a custom
reducer did wrong is warned and said by each fit's run, as by the first (the callback's reducers
serve every fit).
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch
from test_huggingface_callback import tiny_bert, train
from test_lightning_callback import STEPS, Tiny, fit
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments.integrations import HuggingFaceObserver, LightningObserver

from conftest import read_history


class Careless:
    """A reducer that writes into its argument and returns a key beyond its metrics."""

    metrics = ("peak",)

    def __call__(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        peak = tensor.amax()
        tensor.zero_()
        return {"peak": peak, "spare": peak}


def test_a_second_lightning_fit_samples_and_says_like_the_first(tmp_path: Path) -> None:
    # TimeIntervalSampler(60): the first forward, then 60 s on
    callback = LightningObserver(reducers=[Careless()])
    runs, said = [], []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(tmp_path, Tiny(), callback)
        runs.append(callback.directory)
        said.append([str(w.message) for w in caught if "reducer Careless" in str(w.message)])
    assert runs == [tmp_path / "logs" / f"version_{n}" / "torchinstruments" for n in (0, 1)]
    for run, messages in zip(runs, said, strict=True):
        assert run is not None
        history = read_history(run)
        assert history["forward_index"].unique().to_list() == [0], run
        peak = history.filter(metric="peak")
        assert peak["value"].null_count() == peak.height > 0
        assert set(peak["unavailable_reason"]) == {
            "reducer Careless modified its argument in place (it was given a copy: training is "
            "unaffected)"
        }
        # Shared across fits, the second fit warned nothing and its index.md named nothing.
        assert [m.split(";")[0] for m in messages] == [
            "torchinstruments: reducer Careless returned 'spare' beyond its metrics ('peak',)",
            "torchinstruments: reducer Careless modified its argument in place (it was given a copy: "
            "training is unaffected)",
        ], run
        index = (run / "index.md").read_text(encoding="utf-8")
        assert "`Careless` returned `'spare'` beyond its metrics `peak`" in index, run
        modified = "reducer Careless modified its argument in place (it was given a copy: "
        note = next(line for line in index.splitlines() if modified in line)
        assert note.startswith(f"**Note:** Not measured (`{modified}training is unaffected)`) in 3")
        assert "`net.0` (output: peak in 1 sample; output_gradient: peak in 1 sample)" in note


def test_a_second_hf_train_samples_its_first_forward_like_the_first(tmp_path: Path) -> None:
    callback = HuggingFaceObserver(max_histogram_modules=1)
    model = tiny_bert()
    runs = []
    for _ in range(2):
        train(tmp_path, model, callback)
        runs.append(callback.directory)
    assert runs == [tmp_path / "out" / "torchinstruments", tmp_path / "out" / "torchinstruments-2"]
    for run in runs:
        assert run is not None
        assert read_history(run)["forward_index"].unique().to_list() == [0], run


class Uncopyable:
    """Samples its first call only, across everything that asks it (a lock: no deep copy)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked = 0

    def should_sample(self, forward_index: int) -> bool:
        self.asked += 1
        return self.asked == 1


def test_a_sampler_that_cannot_be_copied_is_used_as_it_is_across_fits(tmp_path: Path) -> None:
    sampler = Uncopyable()
    callback = LightningObserver(sampler=sampler)
    fit(tmp_path, Tiny(), callback)
    fit(tmp_path, Tiny(), callback)
    assert sampler.asked == 6  # the very object, asked by both fits (3 steps each)
    first, second = (tmp_path / "logs" / f"version_{n}" / "torchinstruments" for n in (0, 1))
    assert read_history(first)["forward_index"].unique().to_list() == [0]
    assert read_history(second).is_empty()  # its state carried over: no first sample


def test_a_second_fit_of_a_finished_trainer_says_it_ran_no_training_step(tmp_path: Path) -> None:
    """A trainer whose max_steps was reached trains nothing in a second fit(): that fit's run
    is empty, and index.md and a warning say why, with the step it ended at (never that the
    model was never called)."""
    callback = LightningObserver()
    model = Tiny()
    trainer = fit(tmp_path, model, callback)
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=4))
    run = tmp_path / "logs" / "version_0" / "torchinstruments-2"
    assert callback.directory == run
    assert read_history(run).is_empty()
    said = (
        f"the fit ran no training step: it ended at global step {STEPS} without one (max_steps "
        "or max_epochs was reached already: a second trainer.fit() of a trainer that had "
        "finished, or a fit resumed from a checkpoint saved at the end of training"
    )
    index = (run / "index.md").read_text(encoding="utf-8")
    assert f"**Note:** {said}" in index
    assert (
        "**No sample was recorded:** the fit ran no training step (the note above says why), "
        "so history.parquet has no rows"
    ) in index
    assert len([w for w in caught if said in str(w.message)]) == 1
