"""A KeyboardInterrupt that cuts the library's own bookkeeping is healed, never left behind.

The cut is made exactly where a Ctrl-C can land (`tests/test_sigint_bookkeeping.py` sends real
ones): the restoration of the layers' proxies at a sampled forward's end raises once, as an
interrupt there would; and a backward pass raises after some of a sample's gradients arrived.
"""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import polars as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, reasons, remove_observer
from torchinstruments import gradients as gradients_module
from torchinstruments.capture import Proxies
from torchinstruments.events import EventFile, MissingHistogram


def model_and_input() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    return model, torch.randn(3, 4)


def cut_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first `restore_layers` raises KeyboardInterrupt before it does anything."""
    original = Proxies.restore_layers
    calls = [0]

    def restore_layers(self: Proxies, *holder: object) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        original(self, *holder)

    monkeypatch.setattr(Proxies, "restore_layers", restore_layers)


def layer_proxies(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if name and "forward" in m.__dict__]


def values(history: pl.DataFrame, sample_id: int) -> dict[tuple, float | None]:
    rows = history.filter((pl.col("sample_id") == sample_id) & (pl.col("metric") != "interrupted"))
    key = ["signal", "layer", "call_index", "tensor_path", "metric"]
    return {tuple(r[k] for k in key): r["value"] for r in rows.iter_rows(named=True)}


def twin(tmp_path: Path, steps: int) -> pl.DataFrame:
    model, x = model_and_input()
    inject_observer(model, output_dir=tmp_path / "twin", sampler=EveryNForwardsSampler(1))
    for _ in range(steps):
        model(x).sum().backward()
    remove_observer(model)
    return pl.read_parquet(tmp_path / "twin" / "history.parquet")


def test_a_sample_end_cut_inside_the_library_is_healed_at_the_next_root_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x = model_and_input()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    cut_once(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        model(x).sum().backward()  # sample 0: its end is cut
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # samples 1 to 3
            model(x).sum().backward()
            assert layer_proxies(model) == []  # none left after a step
    said = [str(w.message) for w in caught if "cut the end" in str(w.message)]
    assert len(said) == 1
    assert "sampled forward 0 " in said[0]
    remove_observer(model)
    assert all("forward" not in m.__dict__ for m in model.modules())

    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    marker = history.filter(pl.col("metric") == "interrupted")
    assert marker["sample_id"].to_list() == [0]
    assert marker["unavailable_reason"].to_list() == [reasons.CUT_IN_BOOKKEEPING]
    assert history.filter(pl.col("call_index") > 0).height == 0  # no layer counted twice
    expected = twin(tmp_path, 4)
    forward_only = {k: v for k, v in values(expected, 0).items() if k[0] == "output"}
    assert values(history, 0) == forward_only  # the cut one kept what it measured (no backward)
    for sample_id in range(1, 4):  # later ones are the twin's
        assert values(history, sample_id) == values(expected, sample_id), sample_id
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "cut the end of sampled forward 0 " in index


def test_removal_right_after_a_cut_restores_every_forward_and_marks_the_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x = model_and_input()
    own = model[2].forward  # a forward of the user's own, kept by identity
    model[2].forward = own
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    cut_once(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    assert layer_proxies(model)  # left on by the cut
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remove_observer(model)
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == ["2"]
    assert model[2].__dict__["forward"] is own
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    marker = history.filter(pl.col("metric") == "interrupted")
    assert marker["unavailable_reason"].to_list() == [reasons.CUT_IN_BOOKKEEPING]


def test_a_backward_pass_that_raised_is_marked_and_later_passes_are_written_at_their_end(
    tmp_path: Path,
) -> None:
    model, x = model_and_input()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))

    def interrupt(grad: torch.Tensor) -> None:
        raise KeyboardInterrupt

    out = model(x)  # sample 0
    out.register_hook(interrupt)  # after the library's hook on the last layer's output
    with pytest.raises(KeyboardInterrupt):
        out.sum().backward()
    model(x).sum().backward()  # sample 1, whole
    remove_observer(model)

    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    grads = history.filter(pl.col("signal") == "output_gradient")
    marker = grads.filter(pl.col("metric") == "interrupted")
    assert marker["sample_id"].to_list() == [0]
    assert marker["unavailable_reason"].to_list() == [reasons.BACKWARD_RAISED]
    measured = grads.filter(pl.col("metric") != "interrupted")
    assert set(measured.filter(pl.col("sample_id") == 0)["layer"]) == {"4"}  # what arrived
    expected = twin(tmp_path, 2)
    assert values(history, 1) == values(expected, 1)  # whole and unmarked


def test_an_interrupt_inside_the_handoff_to_tensorboard_never_hangs_the_event_file(
    tmp_path: Path,
) -> None:
    """A KeyboardInterrupt raised as a Python-level lock of the handoff to TensorBoard's writer
    thread was just taken (where a Ctrl-C lands, as `queue.Queue.put` takes its lock in
    `Condition.__enter__`) leaves no lock held: the next events, a flush and the close finish."""
    events = EventFile(str(tmp_path / "tb"), flush_seconds=60.0)
    missing = [MissingHistogram("0/call_0/output/tensor", "no finite entries")]

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code is threading.Condition.__enter__.__code__:
            return interrupt_on_return
        return None

    def interrupt_on_return(frame: FrameType, event: str, arg: object) -> Any:
        if event == "return":
            sys.settrace(None)
            raise KeyboardInterrupt
        return interrupt_on_return

    sys.settrace(trace)
    try:
        events.add_missing(missing, step=0)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    done = threading.Event()

    def go_on() -> None:
        events.add_missing(missing, step=1)
        events.flush()
        events.close()
        done.set()

    threading.Thread(target=go_on, daemon=True).start()
    assert done.wait(10.0)  # no hang
    (event_file,) = (tmp_path / "tb").iterdir()
    loaded = EventFileLoader(str(event_file)).Load()
    steps = [event.step for event in loaded if event.summary.value]
    assert 1 in steps


def test_more_than_20_cut_samples_are_all_counted_in_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x = model_and_input()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    original = Proxies.restore_layers
    calls, cuts = [0], [0]

    def restore_layers(self: Proxies, *holder: object) -> None:
        calls[0] += 1
        # each sampled forward's end (calls 1, 3, 5, ...) is cut; the heal at the next root
        # forward (calls 2, 4, ...) restores the layers for real
        if calls[0] % 2 and cuts[0] < 25:
            cuts[0] += 1
            raise KeyboardInterrupt
        original(self, *holder)

    monkeypatch.setattr(Proxies, "restore_layers", restore_layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(25):  # samples 0-24: each end cut, healed by the next root forward
            with pytest.raises(KeyboardInterrupt):
                model(x)
        model(x).sum().backward()  # sample 25: whole
        remove_observer(model)
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert history.filter(pl.col("metric") == "interrupted")["sample_id"].to_list() == list(
        range(25)
    )
    index = " ".join((tmp_path / "run" / "index.md").read_text(encoding="utf-8").split())
    listed = ", ".join(map(str, range(20)))
    assert f"cut the end of 25 sampled forwards ({listed} and 5 more) inside" in index
    assert "25 sample(s) are marked (the marks of the first 20 are listed)" in index


def test_a_ctrl_c_inside_a_samples_first_gradient_hook_marks_it_although_no_gradient_arrived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass reached sample 0's outputs (its first hook ran) and raised there, before that
    gradient was launched: nothing of sample 0 is pending, yet its backward was cut."""
    original = gradients_module.launch
    calls = [0]

    def launch(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt  # where a Ctrl-C lands inside the hook
        return original(*args, **kwargs)

    monkeypatch.setattr(gradients_module, "launch", launch)
    model, x = model_and_input()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    out = model(x)  # sample 0
    with pytest.raises(KeyboardInterrupt):
        out.sum().backward()
    model(x).sum().backward()  # sample 1, whole
    remove_observer(model)

    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    grads = history.filter(pl.col("signal") == "output_gradient")
    marker = grads.filter(pl.col("metric") == "interrupted")
    assert marker["sample_id"].to_list() == [0]
    assert marker["unavailable_reason"].to_list() == [reasons.BACKWARD_RAISED]
    assert (
        grads.filter((pl.col("sample_id") == 0) & (pl.col("metric") != "interrupted")).height == 0
    )
    expected = twin(tmp_path, 2)
    assert values(history, 1) == values(expected, 1)  # whole and unmarked


def test_a_pass_that_raised_before_reaching_a_sample_leaves_it_a_sample_without_backward(
    tmp_path: Path,
) -> None:
    """Decided (gradients.py): a hook on the loss raising before any gradient reached the
    model cuts none of the sample's rows; it reads, and is counted, as a sample no backward
    reached, and is not marked."""
    model, x = model_and_input()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    loss = model(x).sum()  # sample 0

    def interrupt(grad: torch.Tensor) -> None:
        raise KeyboardInterrupt

    loss.register_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        loss.backward()
    model(x).sum().backward()  # sample 1, whole
    remove_observer(model)

    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert history.filter(pl.col("metric") == "interrupted").height == 0
    sample_0 = history.filter(pl.col("sample_id") == 0)
    assert set(sample_0["signal"]) == {"output"}
    expected = twin(tmp_path, 2)
    assert values(history, 0) == {k: v for k, v in values(expected, 0).items() if k[0] == "output"}
    index = (tmp_path / "run" / "index.md").read_text("utf-8")
    assert "2 samples, 1 sample with output gradients" in index


def test_a_backward_that_raised_after_all_of_a_samples_gradients_leaves_it_whole(
    tmp_path: Path,
) -> None:
    model, x = model_and_input()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    leaf = x.clone().requires_grad_(True)

    def fail(grad: torch.Tensor) -> None:  # the input's gradient: after every layer's
        raise RuntimeError("a hook failed")

    leaf.register_hook(fail)
    with pytest.raises(RuntimeError, match="a hook failed"):
        model(leaf).sum().backward()  # sample 0: every gradient arrived, then the pass raised
    model(x).sum().backward()  # sample 1 writes sample 0's gradients
    remove_observer(model)
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert history.filter(pl.col("metric") == "interrupted").height == 0
    expected = twin(tmp_path, 2)
    assert values(history, 0) == values(expected, 0)
