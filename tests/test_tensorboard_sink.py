"""TensorBoardSink: focus histograms into the caller's own writer or logger, on the caller's
step, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from torchinstruments import (
    EveryNForwardsSampler,
    TensorBoardSink,
    inject_observer,
    remove_observer,
)

from _tensorboard_runs import histograms
from conftest import read_history


def test_tensorboard_sink_writes_into_the_callers_writer_and_leaves_it_open(
    run_dir: Path, tmp_path: Path
) -> None:
    writer = SummaryWriter(str(tmp_path / "caller"))
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[TensorBoardSink(writer)]
    )
    model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    writer.add_scalar("caller/after_removal", 1.0, 0)
    writer.close()
    caller = histograms(tmp_path / "caller")
    assert "0/call_0/output/tensor" in caller
    assert "1/call_0/output_gradient/tensor" in caller
    scalars = EventAccumulator(str(tmp_path / "caller"))
    scalars.Reload()
    tags: dict[str, Any] = scalars.Tags()
    assert "caller/after_removal" in tags["scalars"]
    assert set(histograms(run_dir / "tensorboard")) == set(caller)
    assert read_history(run_dir).height > 0
    assert (run_dir / "result.json").exists()
    assert (run_dir / "index.md").exists()


def test_tensorboard_sink_accepts_a_lightning_logger(run_dir: Path, tmp_path: Path) -> None:
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    logger = loggers.TensorBoardLogger(save_dir=str(tmp_path), name="lightning", version=0)
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[TensorBoardSink(logger)]
    )
    model(torch.randn(2, 3))
    remove_observer(model)
    logger.experiment.add_scalar("still/usable", 2.0, 0)
    logger.finalize("success")
    assert "0/call_0/output/tensor" in histograms(Path(logger.log_dir))


def test_tensorboard_sink_rejects_objects_that_are_not_writers() -> None:
    with pytest.raises(TypeError, match="SummaryWriter"):
        TensorBoardSink(object())


def test_tensorboard_sink_puts_histograms_on_the_callers_step(
    run_dir: Path, tmp_path: Path
) -> None:
    """`step=` replaces forward_index: forward and backward histograms land on the caller's step."""
    writer = SummaryWriter(str(tmp_path / "caller"))
    trainer_step = [0]
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(3),
        sinks=[TensorBoardSink(writer, step=lambda: trainer_step[0])],
    )
    for step in range(7):  # sampled: steps 0, 3, 6 (sample_ids 0, 1, 2)
        trainer_step[0] = 100 + step
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    writer.close()
    caller = histograms(tmp_path / "caller")
    for tag in ("0/call_0/output/tensor", "0/call_0/output_gradient/tensor"):
        assert [event.step for event in caller[tag]] == [100, 103, 106], tag
        # the run directory's own events are on forward_index
        assert [event.step for event in histograms(run_dir / "tensorboard")[tag]] == [0, 3, 6]


@pytest.mark.parametrize(
    "make_step", [np.int64, lambda n: torch.tensor(n)], ids=["numpy int", "0-d int tensor"]
)
def test_tensorboard_sink_takes_the_integers_set_step_takes(
    make_step: Any, run_dir: Path, tmp_path: Path
) -> None:
    writer = SummaryWriter(str(tmp_path / "caller"))
    trainer_step = [0]
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(2),
        sinks=[TensorBoardSink(writer, step=lambda: make_step(trainer_step[0]))],
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # the sink is never detached
        for step in range(4):
            trainer_step[0] = 50 + step
            model(torch.randn(2, 3)).sum().backward()
    assert not said, [str(w.message) for w in said]
    remove_observer(model)
    writer.close()
    caller = histograms(tmp_path / "caller")
    for tag in ("0/call_0/output/tensor", "0/call_0/output_gradient/tensor"):
        assert [event.step for event in caller[tag]] == [50, 52], tag


def test_tensorboard_sink_step_must_be_callable_and_return_an_int(
    run_dir: Path, tmp_path: Path
) -> None:
    writer = SummaryWriter(str(tmp_path / "caller"))
    with pytest.raises(TypeError, match="step must be a zero-argument callable"):
        TensorBoardSink(writer, step=5)  # type: ignore[arg-type]
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        sinks=[TensorBoardSink(writer, step=lambda: "7")],  # type: ignore[arg-type, return-value]
    )
    with pytest.warns(RuntimeWarning, match=r"step\(\) returned '7' \(str\), expected an integer"):
        model(torch.randn(2, 3))
    model(torch.randn(2, 3))  # the sink is detached; training and the run go on
    remove_observer(model)
    writer.close()
    assert histograms(tmp_path / "caller") == {}
    assert read_history(run_dir)["sample_id"].unique().to_list() == [0, 1]


def test_samples_left_out_of_the_callers_step_are_each_counted_once_in_index_md(
    run_dir: Path, tmp_path: Path
) -> None:
    """A plain loop's TensorBoardSink on a step that never moves: every sample after the first
    is left out of the caller's logger, counted once (its forward and backward records both
    arrive), however many there are, and index.md says how many."""
    writer = SummaryWriter(str(tmp_path / "caller"))
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    sink = TensorBoardSink(writer, step=lambda: 7)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[sink])
    model(torch.randn(2, 3)).sum().backward()  # sample 0: the step's first
    with pytest.warns(RuntimeWarning, match="sample 1 shares step 7 with an earlier sample"):
        model(torch.randn(2, 3)).sum().backward()
    for _ in range(148):  # said once: no more warnings
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    writer.close()
    assert sink.shared_step_samples == 149
    assert [e.step for e in histograms(tmp_path / "caller")["0/call_0/output/tensor"]] == [7]
    index = " ".join((run_dir / "index.md").read_text(encoding="utf-8").split())
    assert "149 samples shared a step with an earlier sample" in index
    assert index.count("shared a step with an earlier sample") == 1
