"""index.md as the only guide: bounded at any model size, and its queries answer from files alone.

- Size: a 3,000-layer run's index.md (state and history written by the library's own writers;
  a real 3,000-layer training run costs minutes on CI's 2 cores) stays within 64 KB, lists every
  layer that never ran, and every query block runs on its history after the setup block. An
  adversarial catalog (12,000 layers with long names, 60 module types, every other one never
  ran) stays within the bound too, and counts the never-ran layers it did not name and says
  where they are.
- Comparison: on a baseline/broken pair of real training runs (the broken one detaches its
  `side` branch from step DETACH_AT: its gradient series stop), the printed comparison query,
  pointed at the baseline, finds per series the first differing sample that a plain-Python
  walk over both history.parquet files finds, and its first row is the series that departs
  first; the "series that stop" query names the detached branch.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.__main__ import main
from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import LayerInfo, Measurement, MetricValue, RunCounts, RunInfo
from torchinstruments.rundir.index_page import write_index
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.page_queries import OTHER_RUN_LINE
from torchinstruments.rundir.state import RunState, write_state
from torchinstruments.rundir.writer import HistoryWriter

from conftest import sgd_step

LIMIT = 64 * 1024
BLOCKS = 900  # x (Linear, ReLU, LayerNorm) + 300 layers that never run = 3,000 layers
UNUSED = 300
SAMPLES = 3
METRICS = ("mean", "std")
STEPS = 7
DETACH_AT = 4
SERIES = ("layer", "call_index", "signal", "tensor_path", "metric")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def run_info(directory: Path, layers: tuple[LayerInfo, ...]) -> RunInfo:
    return RunInfo(
        output_dir=directory,
        library_version="0.1.0",
        torch_version="2.15.0",
        model_class="Big",
        layers=layers,
        focus_layers=tuple(li.name for li in layers[:8]),
        sampler="EveryNForwardsSampler(n=1)",
        metrics=METRICS,
        rank=None,
        world_size=None,
        rank_policy="rank0",
        capture_direct_forwards=True,
        history=HistoryConfig(buffer_rows=8192, window=10, flush_seconds=60.0),
        started_at="2026-01-01T00:00:00+00:00",
    )


def measurement(sample: int, layer: LayerInfo, signal: str, k: int) -> Measurement:
    """One tensor's rows at one sample: a mean that differs per layer and sample, a null std."""
    return Measurement(
        sample_id=sample,
        forward_index=sample,
        timestamp_us=sample,
        rank=None,
        layer=layer.name,
        module_type=layer.module_type,
        call_index=0,
        signal=signal,
        tensor_path="",
        shape=(2, 4),
        dtype="float32",
        mode="train",
        grad_enabled=True,
        metrics=METRICS,
        values=(MetricValue(sample + k / 1000), MetricValue(None, "empty tensor")),
    )


def big_run(directory: Path) -> tuple[RunState, pl.DataFrame]:
    """A 3,000-layer run's state, index.md and history.parquet (the last ReLU's gradient stops)."""
    types = ("Linear", "ReLU", "LayerNorm")
    ran = [LayerInfo(f"blocks.{b}.{i}", types[i]) for b in range(BLOCKS) for i in range(3)]
    unused = [LayerInfo(f"unused.{i}", "Linear") for i in range(UNUSED)]
    stops = ran[-2].name
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=8192))
    for s in range(SAMPLES):
        for signal in ("output", "output_gradient"):
            writer.append(
                [
                    measurement(s, li, signal, k)
                    for k, li in enumerate(ran)
                    if not (signal == "output_gradient" and li.name == stops and s > 0)
                ]
            )
    writer.flush()
    writer.close()
    merge_history(directory)
    counts = RunCounts(SAMPLES, SAMPLES, SAMPLES, {li.name: SAMPLES for li in ran})
    state = RunState(run_info(directory, (*ran, *unused)), counts, rows_recorded=0)
    write_state(directory, state)
    write_index(directory, state)
    return state, pl.read_parquet(directory / "history.parquet", glob=False)


def execute(text: str, replace: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """Run the setup block, then each other block in a copy of its namespace; their namespaces
    merged and each block's stdout."""
    setup, *blocks = python_blocks(text)
    base: dict = {}
    exec(compile(setup, "index.md:setup", "exec"), base)
    found, printed = dict(base), []
    for number, code in enumerate(blocks):
        for old, new in (replace or {}).items():
            code = code.replace(old, new)
        session, out = dict(base), io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"index.md:block-{number}", "exec"), session)
        found.update(session)
        printed.append(out.getvalue())
    return found, printed


def test_index_of_3000_layers_is_bounded_and_its_queries_run(tmp_path: Path) -> None:
    directory = tmp_path / "big[3000]"
    state, history = big_run(directory)
    assert len(state.run.layers) == 3000
    text = (directory / "index.md").read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= LIMIT
    assert (
        f"Never ran in a sampled forward ({UNUSED}): `unused.0` .. `unused.299` (300 layers)"
        in text
    )
    assert "| Linear | 1200 | 0 .. 3 | `blocks.0.0` | `unused.299` |" in text
    assert "| ReLU | 900 | 3 .. 3 | `blocks.0.1` | `blocks.899.1` |" in text
    found, printed = execute(text)
    assert found["never"] == [f"unused.{i}" for i in range(UNUSED)]
    assert found["written"]["rows"].item() == history.height
    latest = found["latest"]
    assert latest.height == BLOCKS * 3  # every layer at the latest sample: no row hidden
    assert len(printed[3].splitlines()) == 1 + BLOCKS * 3  # header + every row, as CSV
    stopped = found["stopped"]
    assert stopped.select("layer", "signal", "last_sample").rows() == [
        (f"blocks.{BLOCKS - 1}.1", "output_gradient", 0)
    ]
    assert found["first"].height == 0  # as printed: the run against itself


def test_index_stays_bounded_for_any_catalog(tmp_path: Path) -> None:
    long = "encoder.transformer_stack.residual_attention_block_with_a_long_name"
    layers = tuple(LayerInfo(f"{long}.{i}.p{i % 7}", f"Type{i % 60}") for i in range(12000))
    ran = {li.name: 5 for li in layers[::2]}  # every other layer ran: 6,000 runs of one
    state = RunState(run_info(tmp_path, layers), RunCounts(5, 5, 5, ran))
    write_index(tmp_path, state)
    text = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= LIMIT
    listed = re.search(r"Never ran in a sampled forward \(6000\): (.*)", text)
    assert listed is not None
    named = re.findall(r"`([^`]+)`", listed.group(1).split(", and ")[0])
    assert named == [li.name for li in layers[1::2][: len(named)]]  # in traversal order
    more = re.search(r", and (\d+) more \(every layer by name: `.state.json`", listed.group(1))
    assert more is not None
    assert len(named) + int(more.group(1)) == 6000  # counted, never dropped silently
    assert "| (20 more types) | 4000 | | | |" in text


def test_index_of_200_long_layer_names_is_bounded_by_grouping_them(tmp_path: Path) -> None:
    """Up to 200 layers are each named twice (Run, Layers); names of 80 characters took the
    page to 87 KB, so it groups them by module type, and says why."""
    long = "transformer_encoder_stack_layers.{}.self_attention_query_projection_with_rotary"
    layers = tuple(LayerInfo(long.format(i), "Linear") for i in range(200))
    state = RunState(run_info(tmp_path, layers), RunCounts(5, 5, 5, {li.name: 5 for li in layers}))
    write_index(tmp_path, state)
    text = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= LIMIT
    assert long.format(57) not in text  # no layer in the middle is named
    assert "200 layers, one row per module type (every layer by name would take this page " in text
    assert f"| Linear | 200 | 5 .. 5 | `{long.format(0)}` | `{long.format(199)}` |" in text
    short = tuple(LayerInfo(f"blocks.{i}", "Linear") for i in range(200))
    write_index(tmp_path, RunState(run_info(tmp_path, short), RunCounts(5, 5, 5, {})))
    assert "| `blocks.57` | Linear | 0 |" in (tmp_path / "index.md").read_text(encoding="utf-8")


class Branchy(nn.Module):
    """A trunk and a side branch; `detached` cuts the side branch off the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.trunk_act = nn.Tanh()
        self.side = nn.Linear(6, 8)
        self.head = nn.Linear(8, 1)
        self.detached = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.side(x)
        if self.detached:
            side = side.detach()
        return self.head(self.trunk_act(self.trunk(x)) + side)


def train(directory: Path, detach_at: int | None) -> Path:
    torch.manual_seed(11)
    model = Branchy()
    x = torch.randn(16, 6)
    y = x[:, :1] * 2
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for step in range(STEPS):
        model.detached = detach_at is not None and step >= detach_at
        sgd_step(model, x, y, 0.05)
    remove_observer(model)
    return directory


def first_differences(mine: pl.DataFrame, theirs: pl.DataFrame) -> dict[tuple, int]:
    """Per series, the first common sample where the runs differ (a value, or a row in one only)."""

    def table(frame: pl.DataFrame) -> dict[tuple, float | None]:
        return {row[:-1]: row[-1] for row in frame.select(*SERIES, "sample_id", "value").rows()}

    a, b = table(mine), table(theirs)
    common = set(mine["sample_id"].to_list()) & set(theirs["sample_id"].to_list())
    out: dict[tuple, int] = {}
    for key in set(a) | set(b):
        if key[-1] not in common:
            continue
        va, vb = a.get(key), b.get(key)
        if (va is None) != (vb is None) or (va is not None and vb is not None and va != vb):
            series = key[:-1]
            out[series] = min(out.get(series, key[-1]), key[-1])
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_comparison_query_finds_the_first_differing_sample(tmp_path: Path) -> None:
    baseline = train(tmp_path / "baseline", detach_at=None)
    broken = train(tmp_path / "broken", detach_at=DETACH_AT)
    text = (broken / "index.md").read_text(encoding="utf-8")
    assert OTHER_RUN_LINE in text
    found, printed = execute(
        text, {OTHER_RUN_LINE: f"other_run = Path({json.dumps(str(baseline))})"}
    )
    mine = pl.read_parquet(broken / "history.parquet")
    theirs = pl.read_parquet(baseline / "history.parquet")
    want = first_differences(mine, theirs)
    first = found["first"]
    got = {row[:-1]: row[-1] for row in first.select(*SERIES, "first_sample").rows()}
    assert got == want
    assert min(want.values()) == DETACH_AT
    # the first row departs first: the detached branch's gradient, absent in this run
    top = first.row(0, named=True)
    assert (top["layer"], top["signal"], top["first_sample"]) == (
        "side",
        "output_gradient",
        DETACH_AT,
    )
    assert top["value"] is None  # no row in this run: value and reason are both null
    assert top["reason"] is None
    assert top["value_other"] is not None
    assert f"{len(want)} series differ" in printed[-1]
    # the series that stop: side's gradient ends at the sample before the detach
    stopped = found["stopped"].select("layer", "signal", "last_sample").rows()
    assert stopped == [("side", "output_gradient", DETACH_AT - 1)]


class EmptyOutput(nn.Module):
    """Returns an empty tensor: every value of its rows is null, with a reason."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :0] * 1.0


class WithEmpty(nn.Module):
    """A linear layer and an empty-output layer that stops running after `stop` forwards."""

    def __init__(self, stop: int | None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.empty = EmptyOutput()
        self.stop = stop
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(x)
        self.forwards += 1
        if self.stop is None or self.forwards <= self.stop:
            hidden = hidden + self.empty(hidden).sum()
        return hidden.sum()


def run_with_empty(directory: Path, stop: int | None) -> Path:
    torch.manual_seed(0)
    model = WithEmpty(stop)
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(5):
        model(torch.randn(2, 4)).backward()
    remove_observer(model)
    return directory


def test_comparison_query_agrees_with_compare_on_a_series_of_nulls_that_stops(
    tmp_path: Path,
) -> None:
    """A series whose values are all null (an empty tensor) and whose rows stop in the other
    run differs from the sample it stops at, in the printed query as in `compare`."""
    mine = run_with_empty(tmp_path / "a", None)
    other = run_with_empty(tmp_path / "b", 2)
    found, _ = execute(
        (mine / "index.md").read_text(encoding="utf-8"),
        {OTHER_RUN_LINE: f"other_run = Path({json.dumps(str(other))})"},
    )
    key = (*SERIES[:-1], "mode", "metric")
    query = {row[:-1]: row[-1] for row in found["first"].select(*key, "first_sample").rows()}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["compare", str(mine), str(other), "--format", "json"]) == 0
    rows = json.loads(out.getvalue())["rows"]
    cli = {tuple(r[k] for k in key): r["first_difference"] for r in rows}
    assert {k: v for k, v in cli.items() if v is not None} == query
    empty = {k: v for k, v in query.items() if k[0] == "empty"}
    assert len(empty) == len([r for r in rows if r["layer"] == "empty"]) > 0
    assert set(empty.values()) == {2}  # b's empty layer has no row from its third sample on


class RaisesOnce(nn.Module):
    """Doubles its input, and raises in the forward number `raise_at` (from 0)."""

    def __init__(self, raise_at: int) -> None:
        super().__init__()
        self.raise_at = raise_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.raise_at:
            raise ValueError("raised inside the layer")
        return x * 2


# The schedule: sample 0 train, 1 eval (no_grad), 2 train, 3 train whose forward raises in `boom`
# after `fc` returned (an `interrupted` marker row; `boom` and `head` have no row there).
MODES = ("train", "eval", "train", "train")
RAISED_AT = 3


def run_with_eval_and_interrupt(directory: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4))
    model.add_module("boom", RaisesOnce(RAISED_AT))
    model.add_module("head", nn.Linear(4, 1))
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for mode in MODES:
        model.train(mode == "train")
        with torch.set_grad_enabled(mode == "train"):
            try:
                out = model(torch.randn(2, 4)).sum()
            except ValueError:
                continue
            if mode == "train":
                out.backward()
    remove_observer(model)
    return directory


def test_queries_keep_eval_samples_apart_and_leave_marker_rows_out(tmp_path: Path) -> None:
    """The trend and side-by-side queries carry `mode`, train first; "series that stop" judges
    a series by the latest sample of its own mode and signal, without the `interrupted` marker
    rows."""
    directory = run_with_eval_and_interrupt(tmp_path / "run")
    marker = pl.read_parquet(directory / "history.parquet").filter(
        pl.col("metric") == "interrupted"
    )
    assert marker["sample_id"].to_list() == [RAISED_AT]
    found, _ = execute((directory / "index.md").read_text(encoding="utf-8"))
    train = [s for s, mode in enumerate(MODES) if mode == "train"]
    evaluation = [s for s, mode in enumerate(MODES) if mode == "eval"]
    for name in ("trend", "both"):
        rows = found[name].select("mode", "sample_id").rows()
        assert rows == [("train", s) for s in train] + [("eval", s) for s in evaluation], name
    # train's latest sample is RAISED_AT (fc returned there), eval's is 1: only the train output
    # series of boom and head, whose rows end at the sample before, stop; no backward followed
    # the raise, so no gradient series stops (their latest is the last sample a backward
    # reached); boom's output has 2 observations, its marker row none
    stopped = found["stopped"].select("layer", "signal", "mode", "last_sample", "samples")
    before = RAISED_AT - 1
    assert sorted(stopped.rows()) == [
        ("boom", "output", "train", before, 2),
        ("head", "output", "train", before, 2),
    ]
