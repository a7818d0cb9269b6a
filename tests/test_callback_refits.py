"""One trainer callback used for several fits: each fit's run samples like the first.

A sampler keeps state (the default `TimeIntervalSampler` its last sample time), so each fit's run
is sampled by a fresh copy of the sampler as the callback was built with it. Real trainers, the
default sampler: every fit's first training forward is a sample, well inside its 60 s interval.
"""

from __future__ import annotations

import threading
from pathlib import Path

from test_huggingface_callback import tiny_bert, train
from test_lightning_callback import Tiny, fit

from torchinstruments.integrations import HuggingFaceObserver, LightningObserver

from conftest import read_history


def test_a_second_lightning_fit_samples_its_first_forward_like_the_first(tmp_path: Path) -> None:
    callback = LightningObserver()  # TimeIntervalSampler(60): the first forward, then 60 s on
    runs = []
    for _ in range(2):
        fit(tmp_path, Tiny(), callback)
        runs.append(callback.directory)
    assert runs == [tmp_path / "logs" / f"version_{n}" / "torchinstruments" for n in (0, 1)]
    for run in runs:
        assert run is not None
        assert read_history(run)["forward_index"].unique().to_list() == [0], run


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
