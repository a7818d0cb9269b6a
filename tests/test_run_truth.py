"""The run directory never lies: odd tensors, failing artifacts, lost rows, and leaf hooks.

- A tensor that cannot be described (a jagged nested tensor has no fixed shape) gets a null
  shape, never a lost run; a record the writer cannot store becomes null cells with a reason;
  every other row is written and history.parquet exists.
- A failing result.json or TensorBoard step never prevents history.parquet (index.md then says
  what is missing: the directory is not complete).
- index.md says "complete" only when history.parquet holds every row the run recorded; otherwise
  it says how many rows were lost and why.
- Hooks kept on leaf outputs stay bounded in loops that never run a backward.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.tensorboard.writer import FileWriter

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    Measurement,
    MetricValue,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.writer import HistoryWriter

from conftest import read_result, run_cli, run_status

METRICS = len(DEFAULT_METRICS)


class Jagged(nn.Module):
    """Returns a jagged nested tensor built from its input's rows (lengths 2 and 3)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor([h[0, :2], h[1, :3]], layout=torch.jagged)


class WithJagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.jag = Jagged()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.jag(h)
        return self.out(h)


def index_text(directory: Path) -> str:
    return (directory / "index.md").read_text("utf-8")


def small_run(directory: Path, steps: int = 3) -> nn.Module:
    """Inject into a Linear+Tanh model and train `steps` steps (left injected)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(steps):
        model(torch.randn(2, 3)).sum().backward()
    return model


ROWS_SMALL = 2 * METRICS * 2  # two layers, two signals


def test_jagged_nested_tensor_next_to_ordinary_layers(run_dir: Path) -> None:
    """A jagged nested tensor (symbolic ragged size) never costs the run its history: its rows
    hold the statistics of its components' entries with a null shape, and every other row is
    there, with the real values."""
    torch.manual_seed(0)
    model = WithJagged()
    inputs = [torch.randn(2, 4) for _ in range(3)]
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for x in inputs:
        model(x).sum().backward()
    remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet")
    jag = history.filter(pl.col("layer") == "jag")
    assert jag.height == 3 * METRICS  # its output, every sample; no gradient reaches it
    assert jag["shape"].to_list() == [None] * jag.height  # no fixed shape: null, not a crash
    for layer in ("lin", "out"):
        for signal in ("output", "output_gradient"):
            rows = history.filter((pl.col("layer") == layer) & (pl.col("signal") == signal))
            assert rows.height == 3 * METRICS, (layer, signal)
            assert rows["value"].null_count() == 0
    # values checked against an independent computation on the same weights
    torch.manual_seed(0)
    reference = WithJagged()
    with torch.no_grad():
        hidden = [reference.lin(x) for x in inputs]
    entries = [np.concatenate([h[0, :2].numpy(), h[1, :3].numpy()]) for h in hidden]

    def metric(layer: str, name: str) -> list[float]:
        rows = history.filter(
            (pl.col("layer") == layer) & (pl.col("signal") == "output") & (pl.col("metric") == name)
        )
        return rows.sort("sample_id")["value"].to_list()

    assert metric("lin", "mean") == pytest.approx([h.mean().item() for h in hidden], rel=1e-6)
    assert metric("jag", "mean") == pytest.approx([e.mean() for e in entries], rel=1e-6)
    assert metric("jag", "std") == pytest.approx([e.std() for e in entries], rel=1e-6)
    assert metric("jag", "max") == pytest.approx([e.max() for e in entries], rel=1e-6)
    assert run_status(run_dir) == "complete"
    assert [layer["layer"] for layer in read_result(run_dir)] == ["lin", "jag", "out"]


def test_a_record_that_cannot_be_stored_never_stops_the_writer(tmp_path: Path) -> None:
    """The writer's own guard: a record with a symbolic shape and a value that is not a number
    (what a broken custom sink or reducer path could hand it) becomes null cells with a reason;
    the rows around it are written unchanged."""
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)

    def record(sample: int, shape: object, value: object) -> Measurement:
        return Measurement(
            sample, sample, 1_700_000_000_000_000, None, "a", "Linear", 0, "output", "",
            shape, "float32", "train", True, ("mean",), (MetricValue(value),),  # type: ignore[arg-type]
        )  # fmt: skip

    writer = HistoryWriter(tmp_path, HistoryConfig())
    writer.append([record(0, (2, 3), 1.5), record(1, tuple(nested.shape), 2.5)])
    writer.append([record(2, (2, 3), "not a number"), record(3, (4,), 4.5)])
    assert writer.close()
    rows = pl.read_parquet(tmp_path / "history.parts" / "part-000000000.parquet")
    assert rows["shape"].to_list() == [[2, 3], None, [2, 3], [4]]
    assert rows["value"].to_list() == [1.5, 2.5, None, 4.5]
    assert rows["unavailable_reason"].to_list() == [
        None,
        None,
        "record error: value of type str is not a number",
        None,
    ]


def test_failing_result_json_never_prevents_history(run_dir: Path) -> None:
    model = small_run(run_dir)
    (run_dir / "result.json").unlink()
    (run_dir / "result.json").mkdir()  # a directory with content: result.json cannot be replaced
    (run_dir / "result.json" / "keep").write_text("x")
    with pytest.warns(RuntimeWarning, match="result.json"):
        remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history.height == 3 * ROWS_SMALL
    index = index_text(run_dir)
    assert "result.json could not be written" in index
    assert run_status(run_dir) == "incomplete"


def test_failing_tensorboard_never_prevents_history(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("event file gone")

    monkeypatch.setattr(FileWriter, "add_summary", broken)  # the run directory's event writer
    monkeypatch.setattr(FileWriter, "close", broken)
    with pytest.warns(RuntimeWarning, match="TensorBoard"):
        model = small_run(run_dir)  # warned once, at the first failing histogram
    remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history.height == 3 * ROWS_SMALL
    index = index_text(run_dir)
    assert "TensorBoard events" in index
    assert run_status(run_dir) == "incomplete"


def test_tensorboard_path_taken_by_a_file_never_prevents_history(run_dir: Path) -> None:
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="TensorBoard"):
        model = small_run(run_dir)  # warned at inject: the event file cannot be created
    remove_observer(model)
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history.height == 3 * ROWS_SMALL
    assert "TensorBoard events" in index_text(run_dir)


def test_index_says_how_many_rows_were_lost_and_why(run_dir: Path) -> None:
    model = small_run(run_dir, steps=0)
    shutil.rmtree(run_dir / "history.parts")
    (run_dir / "history.parts").write_text("a file where the parts go")
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
    with pytest.warns(RuntimeWarning, match="history"):
        remove_observer(model)
    index = index_text(run_dir)
    assert run_status(run_dir) == "incomplete"
    lost = 3 * ROWS_SMALL
    assert f"{lost} rows of samples 0-2 were recorded but not written: not written at" in index
    assert "Not a directory" in index  # the write error itself
    # whatever could be written is: history.parquet exists (here with no rows)
    assert pl.read_parquet(run_dir / "history.parquet").height == 0


def test_failed_merge_is_incomplete_until_finalize_completes_it(run_dir: Path) -> None:
    model = small_run(run_dir)
    (run_dir / "history.parquet").mkdir()  # blocks the merged file
    (run_dir / "history.parquet" / "keep").write_text("x")
    with pytest.warns(RuntimeWarning, match="finalize"):
        remove_observer(model)
    index = index_text(run_dir)
    assert run_status(run_dir) == "incomplete"
    assert "history.parts" in index
    shutil.rmtree(run_dir / "history.parquet")
    done = subprocess.run(
        [sys.executable, "-m", "torchinstruments", "finalize", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "state: complete" in done.stdout
    assert pl.read_parquet(run_dir / "history.parquet").height == 3 * ROWS_SMALL
    assert run_status(run_dir) == "complete"  # every row the run recorded is there now


@pytest.mark.parametrize(
    "error", [MemoryError("no memory"), pl.exceptions.PanicException("a Polars panic")]
)
def test_a_merge_that_raised_otherwise_is_incomplete_too(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """Before: the exception left the finish, the state and index.md stayed "in progress" after
    remove_observer returned, and `show` then called the run one whose process died."""
    from torchinstruments.rundir import finish

    model = small_run(run_dir)

    def failing(directory: Path) -> None:
        raise error

    monkeypatch.setattr(finish, "merge_history", failing)
    with pytest.warns(RuntimeWarning, match="finalize"):
        assert remove_observer(model) == run_dir
    assert run_status(run_dir) == "incomplete"
    assert f"failed ({type(error).__name__}: {error})" in index_text(run_dir)
    monkeypatch.undo()
    done = run_cli("finalize", run_dir)
    assert done.returncode == 0, done.stderr
    assert pl.read_parquet(run_dir / "history.parquet").height == 3 * ROWS_SMALL
    assert run_status(run_dir) == "complete"


class PassThrough(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x  # its (leaf) input itself: a hook on it outlives any graph


def live_handles() -> int:
    gc.collect()
    return sum(type(o) is RemovableHandle for o in gc.get_objects())


def test_leaf_hooks_stay_bounded_without_backward(run_dir: Path) -> None:
    model = nn.Sequential(PassThrough())
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=1 << 20),
    )
    try:
        for _ in range(1500):
            model(torch.randn(2, requires_grad=True))  # each input dropped after its forward
        after_1500 = live_handles()
        for _ in range(1500):
            model(torch.randn(2, requires_grad=True))
        assert live_handles() == after_1500
    finally:
        remove_observer(model)


def test_leaf_hooks_on_kept_tensors_stay_bounded(run_dir: Path) -> None:
    model = nn.Sequential(PassThrough())
    kept: list[torch.Tensor] = []
    at_1500 = -1
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=1 << 20),
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3000):
                kept.append(model(torch.randn(2, requires_grad=True)))
                if len(kept) == 1500:
                    at_1500 = sum(len(t._backward_hooks or {}) for t in kept)  # type: ignore[attr-defined]
        at_3000 = sum(len(t._backward_hooks or {}) for t in kept)  # type: ignore[attr-defined]
        assert at_3000 == at_1500 < 1500
        dropped = [w for w in caught if "leaf tensors" in str(w.message)]
        assert len(dropped) == 1  # never silent, and said once
        kept[-1].sum().backward()  # the newest one still records its gradient
    finally:
        remove_observer(model)
    assert sum(len(t._backward_hooks or {}) for t in kept) == 0  # type: ignore[attr-defined]
    history = pl.read_parquet(run_dir / "history.parquet")
    grads = history.filter(pl.col("signal") == "output_gradient")
    assert grads["sample_id"].unique().to_list() == [2999]


def test_a_run_directory_removed_mid_run_is_said_gone_with_what_was_lost(run_dir: Path) -> None:
    """`rm -rf` of the run directory while the run goes on: removal says the directory is gone
    and how much the run lost, and never advises finalizing a directory that does not exist."""
    model = small_run(run_dir)
    while run_dir.exists():  # as `rm -rf` again: the run's writer threads may add a file meanwhile
        shutil.rmtree(run_dir, ignore_errors=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
        remove_observer(model)
    said = [str(w.message) for w in caught]
    gone = [s for s in said if "no longer exists" in s]
    assert len(gone) == 1
    assert f"{run_dir} no longer exists" in gone[0]
    assert f"5 samples ({5 * ROWS_SMALL} rows) are lost" in gone[0]
    assert not [s for s in said if "finalize" in s and "Nothing is left to finalize" not in s]
    assert not run_dir.exists()  # nothing was written back
