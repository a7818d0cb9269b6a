"""Fast paths hand over: what the NumPy path cannot take (or fails on) is measured by the
general path, and a failure stays in its own tensor's rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.measurement import histograms, numerics
from torchinstruments.measurement.histograms import DEFAULT_BINS
from torchinstruments.measurement.reducers import Measurer, PendingReduction
from torchinstruments.records import LayerInfo, MetricValue, TensorKey

from conftest import Wrapped, assert_matches_numpy, read_history


def resolved(measurer: Measurer, reduction: PendingReduction) -> dict[str, MetricValue]:
    """The metric values of one launched reduction."""
    vector = reduction.device_vector
    values = reduction.resolve([] if vector is None else vector.tolist())
    return dict(zip(measurer.metrics, values, strict=True))


def test_a_subclass_among_small_tensors_leaves_the_plain_ones_measured() -> None:
    measurer = Measurer(None)
    plain = [torch.randn(50 + index) * (index + 1) for index in range(5)]
    wrapped = Wrapped(torch.randn(40))
    launched = [measurer.launch(t) for t in [*plain, wrapped]]
    for tensor, reduction in zip(plain, launched[:-1], strict=True):
        assert_matches_numpy(resolved(measurer, reduction), tensor.numpy())
    # a subclass is measured by the general path, through its own dispatch
    assert_matches_numpy(resolved(measurer, launched[-1]), wrapped.plain.numpy())


def test_the_sort_path_hands_what_it_fails_on_to_the_general_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("sort path broke")

    monkeypatch.setattr(numerics, "measure_on_cpu", broken)
    measurer = Measurer(None)
    tensor = torch.randn(3000).relu()
    reduction, histogram = measurer.launch_with_histogram(tensor)
    assert_matches_numpy(resolved(measurer, reduction), tensor.numpy())
    assert isinstance(histogram, torch.Tensor)  # counted by the general path
    key = TensorKey(0, 0, LayerInfo("x", "Identity"), 0, "output", "", "train", True)
    record = histograms.record(histogram.tolist(), DEFAULT_BINS, key, "output")
    assert record is not None
    edges = np.array([record.min, *record.bucket_limits])
    want, _ = np.histogram(tensor.numpy().astype(np.float64), bins=edges)
    assert list(record.bucket_counts) == want.astype(float).tolist()


class Twin(nn.Module):
    """Returns its input wrapped in a tensor subclass (as tensor-parallel layers return DTensors)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Wrapped(x)


def test_a_layer_returning_a_subclass_does_not_null_the_layers_around_it(tmp_path: Path) -> None:
    """The subclass's rows are measured and the plain small outputs reduced in the same sample
    keep their values (before: one failure in the batch nulled every tensor in it)."""
    model = nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), Twin()
    )
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    x = torch.randn(3, 6)
    with torch.no_grad():
        model(x)
    remove_observer(model)
    rows = read_history(tmp_path / "s")
    assert rows["value"].null_count() == 0
    hidden = x
    for index, layer in enumerate(model[:5]):
        hidden = layer(hidden)
        got = {
            r["metric"]: MetricValue(r["value"])
            for r in rows.filter(pl.col("layer") == str(index)).rows(named=True)
        }
        assert_matches_numpy(got, hidden.detach().numpy())
    twin = {
        r["metric"]: MetricValue(r["value"])
        for r in rows.filter(pl.col("layer") == "5").rows(named=True)
    }
    assert_matches_numpy(twin, hidden.detach().numpy())


def test_an_output_and_a_gradient_the_host_path_fails_on_are_measured_by_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain CPU tensor too large for the lane is measured as it is launched; when the NumPy
    path raises there, the general path measures it (values, then its histogram)."""

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("host path broke")

    monkeypatch.setattr(numerics, "measure_on_cpu", broken)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    x = torch.randn(32, 64)  # 2,048 entries: past the lane
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    out = model(x)
    out.sum().backward()
    remove_observer(model)
    rows = read_history(tmp_path / "s")
    assert rows["value"].null_count() == 0
    hidden = model[0](x).detach()
    for layer, signal, values in [
        ("0", "output", hidden),
        ("1", "output", hidden.relu()),
        ("1", "output_gradient", torch.ones(32, 64)),
        ("0", "output_gradient", (hidden > 0).float()),
    ]:
        chosen = rows.filter((pl.col("layer") == layer) & (pl.col("signal") == signal))
        got = {r["metric"]: MetricValue(r["value"]) for r in chosen.rows(named=True)}
        assert_matches_numpy(got, values.numpy())
