"""Unavailable measurements end to end: null + reason in history.parquet, never a crash.

The design promises that a value is null exactly when `unavailable_reason` is set, that nothing
non-finite is ever stored, and that a tensor the statistics cannot handle (empty, no finite
entry, complex) or a custom reducer that raises costs the user's training loop nothing. Unit tests
of `statistics.py` cover the reductions; this file drives the same cases through
`inject_observer` / `remove_observer` on a model that actually trains, and reads the artifacts.

The probes hang off a side branch of the hidden activation: only the empty slice feeds the loss
(it adds 0, and makes an empty gradient flow back), so NaN and Inf never reach the loss and the
model still learns.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    AbsMax,
    EveryNForwardsSampler,
    inject_observer,
    remove_observer,
)
from torchinstruments.reasons import explain
from torchinstruments.records import MetricValue

from conftest import assert_matches_numpy, read_history, read_result, sgd_step

STEPS = 12
BOOM = "boom on purpose"
CUSTOM = ("boom", "nan_metric")
ALL_METRICS = (*DEFAULT_METRICS, *CUSTOM)
FINITE_METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75")
BOOM_REASON = f"reducer error: ValueError: {BOOM}"


class Boom:
    """A custom reducer that always raises."""

    metrics = ("boom",)

    def __call__(self, tensor: torch.Tensor) -> Mapping[str, float]:
        raise ValueError(BOOM)


class NanMetric:
    """A custom reducer that returns NaN, which must be stored as null, not as NaN."""

    metrics = ("nan_metric",)

    def __call__(self, tensor: torch.Tensor) -> Mapping[str, float]:
        return {"nan_metric": math.nan}


class EmptySlice(nn.Module):
    """An output with zero elements."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :0]


class AllNaN(nn.Module):
    """An output whose every entry is NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * math.nan


class PartlyNonFinite(nn.Module):
    """An output with one NaN, one +Inf and one -Inf; keeps a copy for the reference values."""

    def __init__(self) -> None:
        super().__init__()
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[0, 0] = math.nan
        y[0, 1] = math.inf
        y[1, 0] = -math.inf
        self.last = y.detach().clone()
        return y


class Spectrum(nn.Module):
    """A complex output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x)


class ArgMax(nn.Module):
    """An integer output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=1)


class Net(nn.Module):
    """A small regression MLP with the probes on a side branch of its hidden activation."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(5, 8)
        self.act = nn.Tanh()
        self.head = nn.Linear(8, 1)
        self.empty = EmptySlice()
        self.all_nan = AllNaN()
        self.partly = PartlyNonFinite()
        self.spectrum = Spectrum()
        self.argmax = ArgMax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.hidden(x))
        self.all_nan(h)
        self.partly(h)
        self.spectrum(h)
        self.argmax(h)
        return self.head(h) + self.empty(h).sum()  # adds 0; an empty gradient flows back


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Net, list[float]]:
    """Train Net for STEPS observed steps; returns the run directory, the model and the losses."""
    directory = tmp_path_factory.mktemp("unavailable") / "stats"
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(32, 5)
    y = x.sum(dim=1, keepdim=True)
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        reducers=[Boom(), NanMetric()],
    )
    losses = []
    try:
        for _ in range(STEPS):
            losses.append(sgd_step(model, x, y, 0.1))
    finally:
        remove_observer(model)
    return directory, model, losses


@pytest.fixture(scope="module")
def history(run: tuple[Path, Net, list[float]]) -> pl.DataFrame:
    return read_history(run[0])


def reasons(
    history: pl.DataFrame, layer: str, signal: str = "output"
) -> dict[str, set[str | None]]:
    """metric -> the set of reasons of that layer's rows (None for a stored value)."""
    rows = history.filter(layer=layer, signal=signal)
    assert rows.height == STEPS * len(ALL_METRICS), (layer, signal)
    return {
        metric: set(rows.filter(metric=metric)["unavailable_reason"].to_list())
        for metric in ALL_METRICS
    }


def test_every_reason_written_is_explained_in_index_md(run: tuple[Path, Net, list[float]]) -> None:
    written = read_history(run[0])["unavailable_reason"].drop_nulls().unique().to_list()
    assert written  # the run does produce unavailable values
    index = (run[0] / "index.md").read_text(encoding="utf-8")
    for reason in written:
        entry = explain(reason)
        assert entry is not None, reason
        assert f"`{entry.template}`" in index


def test_value_is_null_exactly_when_a_reason_is_given(history: pl.DataFrame) -> None:
    mismatched = history.filter(
        pl.col("value").is_null() != pl.col("unavailable_reason").is_not_null()
    )
    assert mismatched.height == 0
    assert history.filter(pl.col("value").is_nan() | pl.col("value").is_infinite()).height == 0
    assert history["unavailable_reason"].null_count() < history.height  # some values are stored


def test_training_was_not_disturbed(run: tuple[Path, Net, list[float]]) -> None:
    _, _, losses = run
    assert len(losses) == STEPS
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.5 * losses[0]


def test_every_layer_was_measured_at_every_step(history: pl.DataFrame) -> None:
    outputs = history.filter(signal="output")
    assert outputs["sample_id"].n_unique() == STEPS
    layers = set(outputs["layer"].unique().to_list())
    assert layers == {"hidden", "act", "head", "empty", "all_nan", "partly", "spectrum", "argmax"}


def test_failing_reducer_gives_null_with_its_error_and_nan_is_never_stored(
    history: pl.DataFrame,
) -> None:
    for metric, reason in (("boom", BOOM_REASON), ("nan_metric", "non-finite result")):
        rows = history.filter(metric=metric)
        assert rows.height == history.filter(metric="mean").height  # every tensor got a row
        assert rows["value"].null_count() == rows.height
        assert set(rows["unavailable_reason"].to_list()) == {reason}


def test_empty_tensor(history: pl.DataFrame) -> None:
    for signal in ("output", "output_gradient"):
        got = reasons(history, "empty", signal)
        expected = {metric: {"empty tensor"} for metric in DEFAULT_METRICS}
        assert got == {**expected, "boom": {BOOM_REASON}, "nan_metric": {"non-finite result"}}
    assert history.filter(layer="empty")["shape"].to_list()[0] == [32, 0]


def test_all_nan_tensor(history: pl.DataFrame) -> None:
    got = reasons(history, "all_nan")
    for metric in FINITE_METRICS:
        assert got[metric] == {"no finite entries"}, metric
    assert got["zero_fraction"] == {None}
    assert got["nonfinite_fraction"] == {None}
    rows = history.filter(layer="all_nan")
    assert set(rows.filter(metric="nonfinite_fraction")["value"].to_list()) == {1.0}
    assert set(rows.filter(metric="zero_fraction")["value"].to_list()) == {0.0}
    assert rows.filter(signal="output_gradient").height == 0  # its output feeds nothing


def test_partly_non_finite_tensor_is_measured_over_its_finite_entries(
    run: tuple[Path, Net, list[float]], history: pl.DataFrame
) -> None:
    _, model, _ = run
    got = reasons(history, "partly")
    assert all(got[metric] == {None} for metric in DEFAULT_METRICS)
    last = model.partly.last
    assert last is not None
    entries = last.double().numpy().ravel()
    finite = entries[np.isfinite(entries)]
    rows = history.filter(layer="partly", signal="output", sample_id=STEPS - 1)
    measured = dict(zip(rows["metric"].to_list(), rows["value"].to_list(), strict=True))
    assert measured["nonfinite_fraction"] == pytest.approx(3 / entries.size)
    assert measured["mean"] == pytest.approx(finite.mean(), rel=1e-12)
    assert measured["std"] == pytest.approx(finite.std(), rel=1e-9)
    assert measured["min"] == finite.min()
    assert measured["max"] == finite.max()
    assert measured["p50"] == pytest.approx(np.percentile(finite, 50), rel=1e-12)


def test_complex_tensor_is_unsupported(history: pl.DataFrame) -> None:
    got = reasons(history, "spectrum")
    for metric in DEFAULT_METRICS:
        assert got[metric] == {"unsupported dtype complex64"}, metric
    assert set(history.filter(layer="spectrum")["dtype"].to_list()) == {"complex64"}


def test_integer_tensor_is_measured(history: pl.DataFrame) -> None:
    got = reasons(history, "argmax")
    assert all(got[metric] == {None} for metric in DEFAULT_METRICS)
    rows = history.filter(layer="argmax")
    assert set(rows["dtype"].to_list()) == {"int64"}
    assert rows.filter(signal="output_gradient").height == 0  # integers carry no gradient
    assert all(0 <= v <= 7 for v in rows.filter(metric="max")["value"].to_list())


def test_result_json_is_strict_and_keeps_unavailable_as_null(
    run: tuple[Path, Net, list[float]],
) -> None:
    result = read_result(run[0])  # refuses NaN and Infinity
    by_layer = {entry["layer"]: entry for entry in result}
    [spectrum] = by_layer["spectrum"]["tensors"]
    mean = spectrum["metrics"]["mean"]
    assert spectrum["observations"] == STEPS
    assert "observations" not in mean  # the tensor's, not repeated per metric
    assert mean["valid"] == 0
    assert mean["latest"] is None
    assert spectrum["latest_sample_id"] == STEPS - 1
    assert mean["min"] == {"value": None, "sample_id": None}
    assert mean["recent"]["mean"] is None
    nonfinite = next(t for t in by_layer["all_nan"]["tensors"] if t["signal"] == "output")[
        "metrics"
    ]["nonfinite_fraction"]
    assert nonfinite["valid"] == STEPS
    assert nonfinite["latest"] == 1.0


def test_sparse_output_is_measured_as_the_dense_tensor_it_stands_for(tmp_path: Path) -> None:
    class Sparse(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.detach().relu().to_sparse()

    model = nn.Sequential(nn.Linear(3, 3), Sparse())
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    x = torch.randn(2, 3)
    model(x)
    remove_observer(model)
    rows = read_history(tmp_path / "s").filter(pl.col("layer") == "1")
    assert rows.height == 9
    assert rows["value"].null_count() == 0
    got = {r["metric"]: MetricValue(r["value"]) for r in rows.rows(named=True)}
    assert_matches_numpy(got, model[0](x).detach().relu().numpy())
    assert rows["shape"].to_list() == [[2, 3]] * 9


def test_a_sparse_output_too_large_to_densify_gets_null_rows_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchinstruments.measurement import tensors

    class Sparse(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.detach().to_sparse()

    monkeypatch.setattr(tensors, "DENSE_MAX", 5)
    model = nn.Sequential(nn.Linear(3, 3), Sparse())
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 3))
    remove_observer(model)
    rows = read_history(tmp_path / "s").filter(pl.col("layer") == "1")
    assert rows["value"].null_count() == 9
    assert set(rows["unavailable_reason"].to_list()) == {"unsupported layout torch.sparse_coo"}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_output_is_measured_over_its_components_entries(tmp_path: Path) -> None:
    class Ragged(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nested.nested_tensor([x[0, :2], x[0]])

    model = nn.Sequential(nn.Linear(3, 3), Ragged())
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    hidden = model[0](x := torch.randn(2, 3))  # not a root forward: not recorded
    model(x)
    remove_observer(model)
    rows = read_history(tmp_path / "s").filter(pl.col("layer") == "1")
    entries = np.concatenate([hidden[0, :2].detach().numpy(), hidden[0].detach().numpy()])
    got = {r["metric"]: r["value"] for r in rows.rows(named=True)}
    assert got["mean"] == pytest.approx(float(entries.astype(np.float64).mean()))
    assert got["max"] == pytest.approx(float(entries.max()))
    assert rows["shape"].to_list() == [None] * 9


class ShapeProbe(nn.Module):
    """Returns a tensor on the meta device (a shape and a dtype, no values), as a layer that
    works out an output's shape without computing it does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, device="meta")


class WithProbe(nn.Module):
    """A real model with a meta-device probe beside its real layers."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(5, 8)
        self.probe = ShapeProbe()
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        self.probe(h)
        return self.act(h)


META_REASON = "unsupported device meta"


@pytest.mark.parametrize("reducers", [None, [AbsMax()]], ids=["default", "custom"])
def test_a_meta_output_has_null_rows_and_the_other_tensors_of_its_sample_keep_theirs(
    tmp_path: Path, reducers: list[AbsMax] | None
) -> None:
    model = WithProbe()
    seen: dict[str, np.ndarray] = {}  # what each real layer returned, as a hook sees it

    def keep(module: nn.Module, args: object, output: torch.Tensor) -> None:
        seen["hidden" if module is model.hidden else "act"] = output.detach().numpy().copy()

    model.hidden.register_forward_hook(keep)
    model.act.register_forward_hook(keep)
    inject_observer(
        model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1), reducers=reducers
    )
    x = torch.randn(4, 5)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # no "recording a sample failed"
        model(x).sum().backward()
    assert not [w for w in said if "failed" in str(w.message)], [str(w.message) for w in said]
    remove_observer(model)
    history = read_history(tmp_path / "s")
    probe = history.filter(layer="probe")
    assert probe.height == 9 + (1 if reducers else 0)
    assert probe["value"].null_count() == probe.height
    assert set(probe["unavailable_reason"].to_list()) == {META_REASON}
    assert probe["shape"].to_list()[0] == [4, 8]
    assert set(probe["dtype"].to_list()) == {"float32"}
    for layer, values in seen.items():
        for signal in ("output", "output_gradient"):
            rows = history.filter(layer=layer, signal=signal)
            assert rows.filter(pl.col("metric").is_in(DEFAULT_METRICS)).height == 9
            if signal == "output":
                got = {r["metric"]: MetricValue(r["value"]) for r in rows.rows(named=True)}
                assert_matches_numpy(got, values)
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    assert "recording a sample failed" not in index
    assert "`unsupported device meta`" in index


def test_a_model_run_on_the_meta_device_has_null_rows_for_outputs_and_gradients(
    tmp_path: Path,
) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(4, 5, device="meta")).sum().backward()
    assert not [w for w in said if "failed" in str(w.message)], [str(w.message) for w in said]
    remove_observer(model)
    history = read_history(tmp_path / "s")
    assert history.height == 2 * 3 * 2 * 9  # samples x layers x signals x metrics
    assert history["value"].null_count() == history.height
    assert set(history["unavailable_reason"].to_list()) == {META_REASON}
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    assert "recording a sample failed" not in index
    assert "recording gradients failed" not in index
    assert "`unsupported device meta`" in index
