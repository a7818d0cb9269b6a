"""result.json: catalog at injection, summaries at removal checked against plain Python."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from torchinstruments.__main__ import main
from torchinstruments.records import LayerInfo, Measurement, MetricValue
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.summary import window_mean, write_catalog, write_result
from torchinstruments.rundir.writer import HistoryConfig, HistoryWriter

from conftest import strict_loads

LAYERS = (
    LayerInfo("", "Net"),
    LayerInfo("shared", "Linear"),
    LayerInfo("never", "Dropout"),
    LayerInfo("nulls", "ReLU"),
    LayerInfo("sparse", "Linear"),
)
WINDOW = 3


def m(sample: int, layer: str, values: dict[str, float | None], **kw: Any) -> Measurement:
    return Measurement(
        sample_id=sample,
        forward_index=sample * 2,
        timestamp_us=sample,
        rank=None,
        layer=layer,
        module_type=kw.get("module_type", "Linear"),
        call_index=kw.get("call", 0),
        signal=kw.get("signal", "output"),
        tensor_path=kw.get("path", ""),
        shape=kw.get("shape", (2, 3)),
        dtype=kw.get("dtype", "float32"),
        mode="train",
        grad_enabled=True,
        metrics=tuple(values),
        values=tuple(
            MetricValue(v) if v is not None else MetricValue(None, "no finite entries")
            for v in values.values()
        ),
    )


def make_history(directory: Path) -> None:
    """A run with a shared layer, gradients, an all-null layer, a sparse layer, ties."""
    rng = random.Random(7)
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=13, window=WINDOW))
    for s in range(40):
        batch = [m(s, "", {"mean": rng.gauss(0, 1), "std": 1.0}, module_type="Net")]
        for call in (0, 1):
            maybe = None if rng.random() < 0.3 else rng.gauss(0, 1)
            batch.append(
                m(
                    s,
                    "shared",
                    {"mean": maybe, "max": round(rng.random(), 1)},
                    call=call,
                    path="['k']" if call else "",
                    shape=(s % 4 + 1, 2),
                )
            )
        batch.append(m(s, "nulls", {"mean": None}))
        if s < 2 or s == 39:
            batch.append(m(s, "sparse", {"mean": float(s)}))
        writer.append(batch)
        if s % 2 == 0:  # gradients only on even samples; appended after the forward, like backward
            writer.append(
                [
                    m(
                        s,
                        "shared",
                        {"mean": rng.gauss(0, 1e-3)},
                        call=1,
                        path="['k']",
                        signal="output_gradient",
                        dtype="bfloat16",
                    )
                ]
            )
    writer.close()
    merge_history(directory)


def reference(history: Path, layers: tuple[LayerInfo, ...], window: int) -> list[dict]:
    """result.json computed in plain Python from the rows of history.parquet."""
    rows = pl.read_parquet(history).to_dicts()
    series: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:  # history.parquet is sorted by sample_id: row order is history order
        series[(r["layer"], r["call_index"], r["signal"], r["tensor_path"], r["metric"])].append(r)

    def at(r: dict) -> dict:
        return {"value": r["value"], "sample_id": r["sample_id"]}

    def extreme(obs: list[dict], pick: Any) -> dict:
        finite = [r for r in obs if r["value"] is not None and math.isfinite(r["value"])]
        if not finite:
            return {"value": None, "sample_id": None}
        best = pick(r["value"] for r in finite)
        return {
            "value": best,
            "sample_id": min(r["sample_id"] for r in finite if r["value"] == best),
        }

    def win(obs: list[dict], samples: list[int]) -> dict:
        inside = [r for r in obs if r["sample_id"] in samples]
        vals = [r["value"] for r in inside if r["value"] is not None]
        return {
            "mean": sum(vals) / len(vals) if vals else None,
            "actual": len(samples),
            "valid": len(vals),
            "first_sample_id": min(samples) if samples else None,
            "last_sample_id": max(samples) if samples else None,
        }

    out = []
    for layer in layers:
        tensors: dict[tuple, dict] = {}
        for key in sorted(k for k in series if k[0] == layer.name):
            obs = series[key]
            tkey = key[1:4]
            if tkey not in tensors:
                last = [
                    r
                    for r in rows
                    if (r["layer"], r["call_index"], r["signal"], r["tensor_path"]) == key[:4]
                ][-1]
                tensors[tkey] = {
                    "call_index": key[1],
                    "signal": key[2],
                    "tensor_path": key[3],
                    "shape": last["shape"],
                    "dtype": last["dtype"],
                    "metrics": {},
                }
            distinct = sorted({r["sample_id"] for r in obs}, reverse=True)
            tensors[tkey]["metrics"][key[4]] = {
                "observations": len(obs),
                "valid": sum(r["value"] is not None for r in obs),
                "first": at(obs[0]),
                "latest": at(obs[-1]),
                "min": extreme(obs, min),
                "max": extreme(obs, max),
                "previous": win(obs, distinct[window : 2 * window]),
                "recent": win(obs, distinct[:window]),
            }
        out.append(
            {
                "layer": layer.name,
                "module_type": layer.module_type,
                "sampled_forwards": len(
                    {
                        r["sample_id"]
                        for r in rows
                        if r["layer"] == layer.name and r["signal"] == "output"
                    }
                ),
                "tensors": [tensors[k] for k in sorted(tensors)],
            }
        )
    return out


def assert_close(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, float):
        assert isinstance(actual, float), where
        assert actual == pytest.approx(expected, rel=1e-12, abs=1e-15), where
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for k in expected:
            assert_close(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def test_catalog_lists_every_layer_in_order(tmp_path: Path) -> None:
    write_catalog(tmp_path, LAYERS)
    data = strict_loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert data == [
        {"layer": li.name, "module_type": li.module_type, "sampled_forwards": None, "tensors": []}
        for li in LAYERS
    ]


@pytest.fixture(scope="module")
def summarized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    directory = tmp_path_factory.mktemp("run")
    make_history(directory)
    write_result(directory, LAYERS, WINDOW)
    text = (directory / "result.json").read_text(encoding="utf-8")
    return directory, strict_loads(text)


def test_every_field_matches_plain_python(summarized: tuple[Path, list[dict]]) -> None:
    directory, data = summarized
    expected = reference(directory / "history.parquet", LAYERS, WINDOW)
    assert_close(data, expected, "result")


def test_layout_cases_are_present(summarized: tuple[Path, list[dict]]) -> None:
    _, data = summarized
    by_layer = {d["layer"]: d for d in data}
    assert [d["layer"] for d in data] == [li.name for li in LAYERS]
    assert by_layer["never"]["tensors"] == []
    shared = [
        (t["call_index"], t["signal"], t["tensor_path"]) for t in by_layer["shared"]["tensors"]
    ]
    assert shared == [(0, "output", ""), (1, "output", "['k']"), (1, "output_gradient", "['k']")]
    nulls = by_layer["nulls"]["tensors"][0]["metrics"]["mean"]
    assert nulls["valid"] == 0
    assert nulls["min"] == {"value": None, "sample_id": None}
    assert nulls["recent"]["mean"] is None
    assert nulls["recent"]["actual"] == WINDOW
    sparse = by_layer["sparse"]["tensors"][0]["metrics"]["mean"]
    assert sparse["recent"]["actual"] == 3  # samples 0, 1, 39: reached by widening the tail scan
    assert sparse["previous"]["actual"] == 0
    assert sparse["recent"]["mean"] == pytest.approx(40 / 3)


def test_short_run_has_partial_windows(tmp_path: Path) -> None:
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=2))
    for s in range(4):
        writer.append([m(s, "x", {"mean": float(s)})])
    writer.close()
    merge_history(tmp_path)
    write_result(tmp_path, (LayerInfo("x", "Linear"),), 3)
    got = strict_loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    metric = got[0]["tensors"][0]["metrics"]["mean"]
    assert metric["recent"] == {
        "mean": 2.0,
        "actual": 3,
        "valid": 3,
        "first_sample_id": 1,
        "last_sample_id": 3,
    }
    assert metric["previous"] == {
        "mean": 0.0,
        "actual": 1,
        "valid": 1,
        "first_sample_id": 0,
        "last_sample_id": 0,
    }


def test_empty_history_lists_layers_without_tensors(tmp_path: Path) -> None:
    HistoryWriter(tmp_path, HistoryConfig()).close()
    merge_history(tmp_path)
    write_result(tmp_path, LAYERS, WINDOW)
    got = strict_loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert got == [
        {"layer": li.name, "module_type": li.module_type, "sampled_forwards": 0, "tensors": []}
        for li in LAYERS
    ]


def test_missing_history_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="finalize"):
        write_result(tmp_path, LAYERS, WINDOW)


# Per sample, two rows of one series; summed left to right, 1e16 + 1.0 is 1e16 (the 1.0 is lost).
CANCELLING = ((5.0, 7.0), (1e16, 1.0), (-1e16, 3.0), (1e-3, 2.0**-30))


def test_show_and_result_json_give_the_same_window_means_to_the_last_bit(tmp_path: Path) -> None:
    """`torchinstruments show` and result.json share one window summary (`window_summaries`),
    whose mean is exact: equal to `math.fsum`, whatever order the rows come in."""
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=3, window=WINDOW))
    for s, pair in enumerate(CANCELLING):
        writer.append([m(s, "a", {"mean": value}) for value in pair])
    writer.close()
    merge_history(tmp_path)
    write_result(tmp_path, (LayerInfo("a", "Linear"),), WINDOW)
    result = strict_loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    recent = result[0]["tensors"][0]["metrics"]["mean"]["recent"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["show", str(tmp_path), "--window", str(WINDOW), "--format", "json"]) == 0
    (row,) = json.loads(out.getvalue())["rows"]
    values = [value for pair in CANCELLING[-WINDOW:] for value in pair]
    exact = math.fsum(values) / len(values)
    assert sum(values) / len(values) != exact  # the data tells an ordered sum from an exact one
    assert recent["mean"] == exact
    assert row["window_mean"] == recent["mean"]  # to the bit, not approximately
    assert (row["window_samples"], recent["actual"]) == (WINDOW, WINDOW)


def test_window_mean_is_exact_and_never_overflows() -> None:
    assert window_mean([1e308, 1e308, 1e308]) == 1e308  # the sum overflows, the mean does not
    assert window_mean([0.1] * 10) == math.fsum([0.1] * 10) / 10
    assert window_mean([]) is None
