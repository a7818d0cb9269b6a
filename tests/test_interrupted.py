"""A sampled root forward that raised is a marked sample, never an ordinary-looking partial one.

A layer raising a ValueError the user catches, and a KeyboardInterrupt raised between layers:
the history holds one marker row (metric `interrupted`) naming the exception and the layer, the
Layers counts leave out the calls that did not return, and every later sample is exactly what
an uninterrupted twin run records. After a real SIGKILL, `finalize` marks the sample whose rows
were only partly written, and `show` flags the latest values that come from it.
"""

from __future__ import annotations

import copy
import errno
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import (
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    reasons,
    remove_observer,
)
from torchinstruments.__main__ import main as cli_main
from torchinstruments.registry import add_run_note
from torchinstruments.rundir import writer as writer_module
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.state import Status, read_state

from conftest import cli_in_process, kill_when_ready, sgd_step, wait_for_rows

MARK = pl.col("metric") == "interrupted"


class Boom(nn.Module):
    """tanh, or a ValueError while armed."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("bad <b>input\x1b[2J")
        return torch.tanh(x)


def boom_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), Boom(), nn.Linear(8, 1))


def history(directory: Path) -> pl.DataFrame:
    return pl.read_parquet(directory / "history.parquet")


def layers_table(directory: Path) -> dict[str, str]:
    """index.md's Layers table: layer -> sampled forwards."""
    text = (directory / "index.md").read_text("utf-8")
    rows = {}
    for line in text.split("## Layers", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def comparable(frame: pl.DataFrame) -> pl.DataFrame:
    """Rows without the measurement time, in one order."""
    return frame.drop("timestamp").sort("sample_id", "signal", "layer", "call_index", "metric")


def test_a_layer_raising_marks_the_sample_and_later_samples_are_exact(
    tmp_path: Path, one_thread: None
) -> None:
    model = boom_model()
    twin = copy.deepcopy(model)
    boom = model[1]
    assert isinstance(boom, Boom)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    inject_observer(model, output_dir=tmp_path / "a", sampler=EveryNForwardsSampler(1))
    inject_observer(twin, output_dir=tmp_path / "b", sampler=EveryNForwardsSampler(1))
    for step in range(7):
        if step == 3:
            boom.armed = True
            with pytest.raises(ValueError, match="bad <b>input"):
                sgd_step(model, x, y, 0.1)
            boom.armed = False
            assert "forward" not in boom.__dict__  # the layer proxies are gone again
            continue
        sgd_step(model, x, y, 0.1)
        sgd_step(twin, x, y, 0.1)
    remove_observer(model)
    remove_observer(twin)
    a, b = tmp_path / "a", tmp_path / "b"
    marks = history(a).filter(MARK)
    assert marks.select("sample_id", "layer", "module_type", "call_index").rows() == [
        (3, "1", "Boom", 0)
    ]
    assert marks["value"].to_list() == [None]
    assert marks["unavailable_reason"].to_list() == [
        reasons.interrupted(ValueError("bad <b>input\x1b[2J"), "1", 0)
    ]
    partial = history(a).filter(pl.col("sample_id") == 3, ~MARK)
    assert set(partial.select("layer", "signal").unique().rows()) == {("0", "output")}
    # every other sample is the twin's, which never met the exception
    later = (
        history(a)
        .filter(pl.col("sample_id") != 3)
        .with_columns(
            pl.when(pl.col("sample_id") > 3).then(pl.col(c) - 1).otherwise(pl.col(c)).alias(c)
            for c in ("sample_id", "forward_index")
        )
    )
    assert comparable(later).equals(comparable(history(b)))
    # the Layers table counts only the calls that returned
    assert layers_table(a) == {"0": "7", "1": "6", "2": "6"}
    state = read_state(a)
    assert state.counts is not None
    assert dict(state.counts.layer_samples) == {"0": 7, "1": 6, "2": 6}
    result = json.loads((a / "result.json").read_text("utf-8"))
    assert [r["sampled_forwards"] for r in result] == [7, 6, 6]
    assert all(t["metrics"].keys() != {"interrupted"} for r in result for t in r["tensors"])
    assert state.status is Status.COMPLETE
    assert state.marks_total == 1
    index = (a / "index.md").read_text("utf-8")
    assert "## Interrupted samples" in index
    # the reason (the user's message, `'1'`) as code, by its literal: no tag, no escape
    assert f"- sample 3: `{marks['unavailable_reason'][0]!r}`\n" in index
    assert "\x1b" not in index
    shown = cli_in_process("show", a, "--width", "400").stdout
    assert 'marked samples: 1, partial, not ordinary ones (sample 3: "interrupted: the' in shown
    assert "\x1b" not in shown


class Stoppable(nn.Module):
    """Two layers, with the model's own code between them (where the interrupt lands)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 1)
        self.stop = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.stop:
            raise KeyboardInterrupt
        return self.second(h)


def test_keyboard_interrupt_between_layers_marks_the_sample(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Stoppable()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    x = torch.randn(2, 3)
    model(x).sum().backward()
    model.stop = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    model.stop = False
    model(x).sum().backward()
    remove_observer(model)
    marks = history(run_dir).filter(MARK)
    assert marks.select("sample_id", "layer", "module_type").rows() == [(1, "", "Stoppable")]
    assert marks["unavailable_reason"].to_list() == [
        "interrupted: the root forward raised KeyboardInterrupt: (no message) outside the "
        "selected layers"
    ]
    assert layers_table(run_dir) == {"first": "3", "second": "2"}
    # sample 2 is whole: both layers, both signals
    last = history(run_dir).filter(pl.col("sample_id") == 2)
    assert last.height == 2 * 2 * 9
    assert cli_main(["show", str(run_dir), "--metrics", "mean"]) == 0
    shown = capsys.readouterr().out
    assert "marked samples: 1" in shown
    assert "KeyboardInterrupt" in shown
    assert "!" not in shown.split("mean:", 1)[1]  # the latest values are all from sample 2
    assert cli_main(["compare", str(run_dir), str(run_dir), "--metrics", "mean"]) == 0
    compared = " ".join(capsys.readouterr().out.split())
    assert "A: marked samples: 1" in compared
    assert "B: marked samples: 1" in compared


ROWS_PER_SAMPLE = 3 * 9 * 2  # Linear, Tanh, Linear; default metrics; output and gradient
BUFFER_ROWS = 40  # parts end at rows 40, 80, ...: inside a sample's rows
STEPS = 5


def child_main(directory: Path) -> None:
    """Train STEPS steps (parts written by size only), say so, and wait to be killed."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=BUFFER_ROWS, flush_seconds=600.0),
    )
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(STEPS):
        sgd_step(model, x, y, 0.01)
    # sample 0's rows at once, then the full 40-row chunks the flush thread writes
    later = (STEPS - 1) * ROWS_PER_SAMPLE // BUFFER_ROWS * BUFFER_ROWS
    wait_for_rows(directory, ROWS_PER_SAMPLE + later)
    print("ready", flush=True)
    time.sleep(120)


@pytest.mark.timeout(150)
def test_after_sigkill_finalize_marks_the_partly_written_sample(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kill_when_ready(__file__, "ready", run_dir)
    # 270 rows recorded; sample 0's 54 at once (two parts), then 40-row parts: 254 in parts, the
    # last ending 11 rows into sample 4's backward
    finalize(run_dir)
    rows = history(run_dir)
    assert rows.filter(~MARK).height == 254
    marks = rows.filter(MARK)
    assert marks.select("sample_id", "signal").rows() == [(4, "output_gradient")]
    partly = reasons.partly_written("output_gradient", 11, 27)
    assert marks["unavailable_reason"].to_list() == [partly]
    state = read_state(run_dir)
    assert state.status is Status.INTERRUPTED
    assert state.marks_total == 1
    index = (run_dir / "index.md").read_text("utf-8")
    assert f"- sample 4: `{partly}`" in index
    finalize(run_dir)  # again: nothing new to mark
    assert history(run_dir).filter(MARK).height == 1
    assert cli_main(["show", str(run_dir), "--metrics", "mean"]) == 0
    shown = capsys.readouterr().out
    assert "marked samples: 1" in shown
    table = shown.split("mean:", 1)[1]
    first_layer = next(line for line in table.splitlines() if line.startswith("0 "))
    assert "!" in first_layer.split()[2]  # its latest output value is from sample 4
    assert "from a marked sample" in " ".join(table.split())


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))


class RemovesInside(nn.Module):
    """A layer whose forward removes the observer of `root` once `armed`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.root: nn.Module | None = None
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and self.root is not None:
            self.armed = False
            remove_observer(self.root)
        return self.fc(x)


def test_removal_inside_a_sampled_forward_marks_that_sample_and_says_so_in_index(
    run_dir: Path,
) -> None:
    inner = RemovesInside()
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.ReLU())
    inner.root = model
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 4)).sum().backward()
    inner.armed = True
    model(torch.randn(2, 4)).sum().backward()  # removed during this forward
    assert all("forward" not in m.__dict__ for m in model.modules())
    history = pl.read_parquet(run_dir / "history.parquet")
    marks = history.filter(pl.col("metric") == "interrupted")
    assert marks.select("sample_id", "signal", "layer").rows() == [(1, "output", "")]
    assert marks["unavailable_reason"][0].startswith(
        "interrupted: remove_observer was called during this sample's forward"
    )
    assert set(history.filter(pl.col("sample_id") == 1)["layer"]) == {"", "0"}  # before removal
    index = (run_dir / "index.md").read_text()
    assert "**State: complete, removed while a sample was in flight.**" in index
    assert "during the forward of sample 1" in index
    assert "**State: complete.**" not in index


@pytest.mark.filterwarnings("ignore:torchinstruments. 1 of 3 selected layers never ran")
def test_show_says_a_run_removed_in_flight_is_not_plainly_complete(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inner = RemovesInside()
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.ReLU())
    inner.root = model
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    inner.armed = True
    model(torch.randn(2, 4))  # removed during sample 0's forward
    assert cli_main(["show", str(run_dir), "--metrics", "mean"]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # `show` wraps long lines
    assert (
        "state: complete, removed while a sample was in flight (sample 0 is partial and marked)"
        in shown
    )


def test_removal_inside_a_backward_marks_that_sample_and_says_so_in_index(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    y = model(torch.randn(2, 4))

    def remove(grad: torch.Tensor) -> None:  # runs after the last layer's gradient hook
        remove_observer(model)

    y.register_hook(remove)
    y.sum().backward()
    history = pl.read_parquet(run_dir / "history.parquet")
    marks = history.filter(pl.col("metric") == "interrupted")
    assert marks.select("sample_id", "signal", "layer").rows() == [(0, "output_gradient", "")]
    assert marks["unavailable_reason"][0].startswith(
        "interrupted: remove_observer was called during this sample's backward"
    )
    gradients = history.filter(pl.col("signal") == "output_gradient", pl.col("metric") == "mean")
    assert gradients["layer"].to_list() == ["2"]  # the one gradient that arrived before
    index = (run_dir / "index.md").read_text()
    assert "**State: complete, removed while a sample was in flight.**" in index
    assert "during the backward of sample 0" in index


def test_removal_in_a_backward_before_any_gradient_arrived_marks_that_sample(
    run_dir: Path,
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    loss = model(torch.randn(2, 4)).sum()

    def remove(grad: torch.Tensor) -> None:  # on the loss: before any layer's gradient
        remove_observer(model)

    loss.register_hook(remove)
    loss.backward()
    history = pl.read_parquet(run_dir / "history.parquet")
    marks = history.filter(MARK)
    assert marks.select("sample_id", "signal", "layer").rows() == [(0, "output_gradient", "")]
    assert marks["unavailable_reason"][0] == reasons.removed_during("backward")
    assert history.filter(pl.col("signal") == "output_gradient", ~MARK).height == 0
    index = (run_dir / "index.md").read_text("utf-8")
    assert "**State: complete, removed while a sample was in flight.**" in index
    assert "during the backward of sample 0" in index


def test_removal_in_a_backward_marks_only_the_samples_still_awaiting_gradients(
    run_dir: Path,
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    first = model(torch.randn(2, 4)).sum()  # sample 0
    second = model(torch.randn(2, 4)).sum()  # sample 1: its nodes are newer, so they run first

    def remove(grad: torch.Tensor) -> None:  # once sample 1's gradients have all arrived
        remove_observer(model)

    first.register_hook(remove)
    (first + second).backward()
    history = pl.read_parquet(run_dir / "history.parquet")
    marks = history.filter(MARK)
    assert marks.select("sample_id", "signal").rows() == [(0, "output_gradient")]
    gradients = history.filter(pl.col("signal") == "output_gradient", ~MARK)
    assert gradients.group_by("sample_id").len().rows() == [(1, 27)]  # whole: not marked
    assert read_state(run_dir).removed_in_flight == (0,)
    index = (run_dir / "index.md").read_text("utf-8")
    assert "during the backward of sample 0." in index


def test_removal_in_the_backward_of_an_unsampled_forward_marks_nothing(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2))
    model(torch.randn(2, 4)).sum().backward()  # sample 0, whole
    model(torch.randn(2, 4)).sum().backward()  # not sampled
    model(torch.randn(2, 4))  # sample 1: its graph is dropped without a backward
    loss = model(torch.randn(2, 4)).sum()  # not sampled

    def remove(grad: torch.Tensor) -> None:
        remove_observer(model)

    loss.register_hook(remove)
    loss.backward()
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history.filter(MARK).height == 0
    gradients = history.filter(pl.col("signal") == "output_gradient")
    assert gradients["sample_id"].unique().to_list() == [0]
    index = (run_dir / "index.md").read_text("utf-8")
    assert "**State: complete.**" in index


def test_the_in_flight_state_comes_from_the_samples_in_flight_not_from_note_text(
    run_dir: Path,
) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 4)).sum().backward()
    add_run_note(model, f"a user's note quoting the library: {reasons.REMOVED_IN_FLIGHT}")
    remove_observer(model)
    state = read_state(run_dir)
    assert state.removed_in_flight == ()
    index = (run_dir / "index.md").read_text("utf-8")
    assert "**State: complete.**" in index
    assert "removed while a sample was in flight" not in index


@pytest.mark.filterwarnings("ignore:torchinstruments. 1 of 3 selected layers never ran")
def test_more_than_20_marked_samples_are_all_counted_and_a_removal_among_them_is_said(
    run_dir: Path,
) -> None:
    inner = RemovesInside()
    model = nn.Sequential(nn.Linear(4, 4), boom := Boom(), inner)
    inner.root = model
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    boom.armed = True
    for _ in range(25):  # samples 0-24 raise
        with pytest.raises(ValueError, match="bad <b>input"):
            model(torch.randn(2, 4))
    boom.armed = False
    inner.armed = True
    model(torch.randn(2, 4))  # sample 25: removed during its forward, past the listed marks
    state = read_state(run_dir)
    assert state.removed_in_flight == (25,)
    assert state.marks_total == 26
    assert len(state.marks) == 20
    index = (run_dir / "index.md").read_text("utf-8")
    assert "**State: complete, removed while a sample was in flight" in index
    assert "26 sample(s) are marked (the marks of the first 20 are listed)" in index
    assert index.count("\n- sample ") == 20


def test_a_removal_in_flight_stays_said_when_the_run_is_continued_and_finalized(
    run_dir: Path,
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    loss = model(torch.randn(2, 4)).sum()

    def remove(grad: torch.Tensor) -> None:
        remove_observer(model)

    loss.register_hook(remove)
    loss.backward()  # attempt 0 removed during sample 0's backward
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), resume=True)
    model(torch.randn(2, 4)).sum().backward()  # sample 1, whole
    remove_observer(model)
    for _ in ("after removal", "after finalize"):
        assert read_state(run_dir).removed_in_flight == (0,)
        index = (run_dir / "index.md").read_text("utf-8")
        assert "removed while a sample was in flight" in index
        assert "sample 0 is partial" in index
        finalize(run_dir)
    marks = pl.read_parquet(run_dir / "history.parquet").filter(MARK)
    assert marks.select("sample_id", "attempt").rows() == [(0, 0)]


def test_a_removal_in_flight_after_a_killed_attempt_is_said_in_the_state_line(
    run_dir: Path,
) -> None:
    killed = (
        "import os, sys, torch\n"
        "from torch import nn\n"
        "from torchinstruments import EveryNForwardsSampler, inject_observer\n"
        "class Inner(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
        "model = nn.Sequential(nn.Linear(4, 4), Inner(), nn.ReLU())\n"
        "inject_observer(model, output_dir=sys.argv[1], sampler=EveryNForwardsSampler(1))\n"
        "model(torch.randn(2, 4)).sum().backward()\n"
        "os._exit(0)  # no removal: ends like a killed job\n"
    )
    subprocess.run([sys.executable, "-c", killed, str(run_dir)], check=True, timeout=120)
    inner = RemovesInside()
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.ReLU())  # the same layer names and types
    inner.root = model
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), resume=True)
    inner.armed = True
    with pytest.warns(RuntimeWarning, match="never ran"):
        model(torch.randn(2, 4))  # removed during the continued run's first sample
    state = read_state(run_dir)
    assert state.status is Status.INTERRUPTED
    (sample_id,) = state.removed_in_flight
    index = " ".join((run_dir / "index.md").read_text("utf-8").split())
    assert "the last attempt was removed." in index
    assert (
        "Also, remove_observer was called while a sample was in flight: "
        f"sample {sample_id} is partial (see the note below)."
    ) in index


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # failing part writes warn: expected
def test_an_incomplete_run_removed_in_flight_lists_the_partial_sample_too(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "write_parquet_atomic", full)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    loss = model(torch.randn(2, 4)).sum()

    def remove(grad: torch.Tensor) -> None:
        remove_observer(model)

    loss.register_hook(remove)
    loss.backward()  # no row reaches the disk, the marker row neither
    assert pl.read_parquet(run_dir / "history.parquet").height == 0
    index = (run_dir / "index.md").read_text("utf-8")
    assert "**State: INCOMPLETE.**" in index
    assert (
        "- remove_observer was called while a sample was in flight: sample 0 is partial "
        "(see the note below)\n"
    ) in index


def test_an_ordinary_removal_is_plainly_complete(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    index = (run_dir / "index.md").read_text()
    assert "**State: complete.**" in index
    assert "interrupted" not in set(pl.read_parquet(run_dir / "history.parquet")["metric"])


class Gate(nn.Module):
    """Doubles its input; while `gating`, the two threads' calls meet here, "a" goes on first."""

    def __init__(self) -> None:
        super().__init__()
        self.gating = True
        self.met = threading.Barrier(2)
        self.a_done = threading.Event()
        self.outputs: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = threading.current_thread().name
        if self.gating:
            self.met.wait(timeout=30)
        if self.gating and name == "b":
            assert self.a_done.wait(timeout=30)
        self.outputs[name] = out = x * 2
        return out


def test_a_backward_that_raised_marks_a_sample_hooked_on_two_threads_at_once(
    run_dir: Path,
) -> None:
    gate = Gate()
    model = nn.Sequential(nn.Linear(4, 4), gate, nn.Linear(4, 1))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    losses: dict[str, torch.Tensor] = {}

    def step(name: str) -> None:
        losses[name] = model(torch.randn(2, 4)).sum()
        if name == "a":
            gate.a_done.set()

    threads = [threading.Thread(target=step, args=(name,), name=name) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    gate.gating = False
    losses["a"].backward()  # whole

    def fail(grad: torch.Tensor) -> None:  # after b's last two gradients, before its first
        raise RuntimeError("a hook failed")

    gate.outputs["b"].register_hook(fail)
    with pytest.raises(RuntimeError, match="a hook failed"):
        losses["b"].backward()
    model(torch.randn(2, 4)).sum().backward()  # writes b's gradients, marked
    remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet")
    marks = history.filter(MARK)
    assert marks["unavailable_reason"].to_list() == [reasons.BACKWARD_RAISED]
    b = history.filter(pl.col("sample_id") == marks["sample_id"][0])
    gradients = b.filter(pl.col("signal") == "output_gradient", ~MARK)
    assert sorted(gradients["layer"].unique()) == ["1", "2"]  # not "0": it never arrived
