"""result.json: catalog at injection, summaries at removal checked against plain Python."""

from __future__ import annotations

import math
import random
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import LayerInfo
from torchinstruments.rundir import series_stats
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.summary import write_catalog, write_result
from torchinstruments.rundir.writer import HistoryWriter

from _summary_rows import WINDOW, m
from conftest import strict_loads

LAYERS = (
    LayerInfo("", "Net"),
    LayerInfo("shared", "Linear"),
    LayerInfo("never", "Dropout"),
    LayerInfo("nulls", "ReLU"),
    LayerInfo("sparse", "Linear"),
    LayerInfo("partial", "Tanh"),
)


def make_history(directory: Path) -> None:
    """A run with a shared layer, gradients, an all-null layer, a sparse layer, ties, and eval
    samples (every fifth sample of the root and the shared layer: a series of their own)."""
    rng = random.Random(7)
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=13, window=WINDOW))
    for s in range(40):
        mode = "eval" if s % 5 == 4 else "train"
        batch = [m(s, "", {"mean": rng.gauss(0, 1), "std": 1.0}, module_type="Net", mode=mode)]
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
                    mode=mode,
                )
            )
        batch.append(m(s, "nulls", {"mean": None}, module_type="ReLU"))
        if s < 2 or s == 39:
            batch.append(m(s, "sparse", {"mean": float(s)}))
        # As if history had lost rows: from sample 30 on, `std` of `partial` has none.
        partial: dict[str, float | None] = {"mean": rng.gauss(0, 1), "std": rng.random()}
        if s >= 30:
            partial = {"mean": 0.5}
        batch.append(m(s, "partial", partial, module_type="Tanh"))
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
        key = (r["layer"], r["call_index"], r["signal"], r["tensor_path"], r["mode"], r["metric"])
        series[key].append(r)

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

    def full(obs: list[dict]) -> dict:
        """Every field of one tensor-metric, as if nothing were shared with its tensor."""
        distinct = sorted({r["sample_id"] for r in obs}, reverse=True)
        return {
            "observations": len(obs),
            "first_sample_id": obs[0]["sample_id"],
            "latest_sample_id": obs[-1]["sample_id"],
            "valid": sum(r["value"] is not None for r in obs),
            "first": obs[0]["value"],
            "latest": obs[-1]["value"],
            "min": extreme(obs, min),
            "max": extreme(obs, max),
            "previous": win(obs, distinct[window : 2 * window]),
            "recent": win(obs, distinct[:window]),
        }

    sample_facts = ("observations", "first_sample_id", "latest_sample_id")
    window_facts = ("actual", "first_sample_id", "last_sample_id")
    out = []
    for layer in layers:
        tensors: dict[tuple, dict] = {}
        keys = sorted(k for k in series if k[0] == layer.name)
        for tkey in dict.fromkeys(k[1:5] for k in keys):
            metrics = {k[5]: full(series[k]) for k in keys if k[1:5] == tkey}
            # The tensor holds the sample facts of its most observed metric (first on ties);
            # a metric repeats a fact only where its own differs.
            best = max(metrics.values(), key=lambda e: e["observations"])
            last = [
                r
                for r in rows
                if (r["layer"], r["call_index"], r["signal"], r["tensor_path"], r["mode"])
                == (layer.name, *tkey)
            ][-1]
            tensor = {
                "call_index": tkey[0],
                "signal": tkey[1],
                "tensor_path": tkey[2],
                "mode": tkey[3],
                "shape": last["shape"],
                "dtype": last["dtype"],
                **{f: best[f] for f in sample_facts},
                **{w: {f: best[w][f] for f in window_facts} for w in ("previous", "recent")},
                "metrics": {},
            }
            for name, entry in metrics.items():
                compact = {f: entry[f] for f in sample_facts if entry[f] != best[f]}
                compact |= {f: entry[f] for f in ("valid", "first", "latest", "min", "max")}
                for w in ("previous", "recent"):
                    own = {f: entry[w][f] for f in window_facts if entry[w][f] != best[w][f]}
                    compact[w] = {"mean": entry[w]["mean"], "valid": entry[w]["valid"], **own}
                tensor["metrics"][name] = compact
            tensors[tkey] = tensor
        out.append(
            {
                "layer": layer.name,
                # the class when last measured (a lazy module's changes), else the catalog's
                "module_type": next(
                    (r["module_type"] for r in reversed(rows) if r["layer"] == layer.name),
                    layer.module_type,
                ),
                "sampled_forwards": len(
                    {
                        r["sample_id"]
                        for r in rows
                        if r["layer"] == layer.name and r["signal"] == "output"
                    }
                ),
                # train before eval for one tensor
                "tensors": [
                    tensors[k] for k in sorted(tensors, key=lambda k: (*k[:3], k[3] != "train"))
                ],
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


def test_chunked_summary_equals_one_chunk(
    summarized: tuple[Path, list[dict]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, _ = summarized
    shutil.copy(directory / "history.parquet", tmp_path / "history.parquet")
    # 7 rows at a time: aggregates combined across chunks, windows read back from the end
    # (the sparse layer's reach sample 0), samples split between chunks.
    monkeypatch.setattr(series_stats, "SUMMARY_CHUNK_ROWS", 7)
    write_result(tmp_path, LAYERS, WINDOW)
    chunked = (tmp_path / "result.json").read_text(encoding="utf-8")
    assert chunked == (directory / "result.json").read_text(encoding="utf-8")


def test_result_json_is_one_compact_line_per_layer(summarized: tuple[Path, list[dict]]) -> None:
    directory, data = summarized
    lines = (directory / "result.json").read_text(encoding="utf-8").splitlines()
    assert (lines[0], lines[-1]) == ("[", "]")
    assert [strict_loads(line.rstrip(",")) for line in lines[1:-1]] == data
    assert all(": " not in line and ", " not in line for line in lines[1:-1])


def test_result_json_of_a_large_model_stays_compact(tmp_path: Path) -> None:
    """About 300 bytes per tensor-metric with full-precision values: a 3,000-layer run (output
    and gradient, 9 metrics) is about 16 MB; the indented layout with every fact per metric took
    about 670 bytes (36 MB)."""
    rng = random.Random(3)
    metrics = ("mean", "std", "min", "max", "p25", "p50", "p75", "zero_fraction", "nonfinite")
    layers = [
        LayerInfo(f"blocks.{i // 3}.{('fc', 'act', 'norm')[i % 3]}", "Linear") for i in range(300)
    ]
    writer = HistoryWriter(tmp_path, HistoryConfig())
    for s in range(12):
        for signal in ("output", "output_gradient"):
            writer.append(
                [
                    m(s, li.name, {k: rng.gauss(0, 1) for k in metrics}, signal=signal)
                    for li in layers
                ]
            )
    writer.close()
    merge_history(tmp_path)
    write_result(tmp_path, tuple(layers), 10)
    size = (tmp_path / "result.json").stat().st_size
    assert size / (len(layers) * 2 * len(metrics)) < 320


def test_layout_cases_are_present(summarized: tuple[Path, list[dict]]) -> None:
    _, data = summarized
    by_layer = {d["layer"]: d for d in data}
    assert [d["layer"] for d in data] == [li.name for li in LAYERS]
    assert by_layer["never"]["tensors"] == []
    shared = [
        (t["call_index"], t["signal"], t["tensor_path"], t["mode"])
        for t in by_layer["shared"]["tensors"]
    ]
    assert shared == [
        *((0, "output", "", "train"), (0, "output", "", "eval")),
        *((1, "output", "['k']", "train"), (1, "output", "['k']", "eval")),
        (1, "output_gradient", "['k']", "train"),
    ]
    # An eval sample is never in a train series: each entry's samples are of its own mode.
    for tensor in by_layer["shared"]["tensors"]:
        eval_sample = tensor["latest_sample_id"] % 5 == 4
        assert eval_sample == (tensor["mode"] == "eval"), tensor
    [nulls_tensor] = by_layer["nulls"]["tensors"]
    nulls = nulls_tensor["metrics"]["mean"]
    assert nulls["valid"] == 0
    assert nulls["min"] == {"value": None, "sample_id": None}
    assert nulls["recent"] == {"mean": None, "valid": 0}  # sample facts are the tensor's
    assert nulls_tensor["recent"]["actual"] == WINDOW
    [sparse_tensor] = by_layer["sparse"]["tensors"]
    # samples 0, 1, 39: reached by widening the tail scan
    assert sparse_tensor["recent"] == {"actual": 3, "first_sample_id": 0, "last_sample_id": 39}
    assert sparse_tensor["previous"]["actual"] == 0
    assert sparse_tensor["metrics"]["mean"]["recent"]["mean"] == pytest.approx(40 / 3)
    [partial] = by_layer["partial"]["tensors"]
    assert partial["observations"] == 40
    assert "observations" not in partial["metrics"]["mean"]
    std = partial["metrics"]["std"]  # lost rows: its own sample facts, which differ
    assert (std["observations"], std["latest_sample_id"]) == (30, 29)
    assert std["recent"]["last_sample_id"] == 29


def test_short_run_has_partial_windows(tmp_path: Path) -> None:
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=2))
    for s in range(4):
        writer.append([m(s, "x", {"mean": float(s)})])
    writer.close()
    merge_history(tmp_path)
    write_result(tmp_path, (LayerInfo("x", "Linear"),), 3)
    got = strict_loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    tensor = got[0]["tensors"][0]
    assert tensor["recent"] == {"actual": 3, "first_sample_id": 1, "last_sample_id": 3}
    assert tensor["previous"] == {"actual": 1, "first_sample_id": 0, "last_sample_id": 0}
    metric = tensor["metrics"]["mean"]
    assert metric["recent"] == {"mean": 2.0, "valid": 3}
    assert metric["previous"] == {"mean": 0.0, "valid": 1}


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


# Equal values of either sign, negative values, ties, and values that are not finite.
EXTREMES = (0.0, -0.0, -1.5, 2.5, -1.5, 2.5, math.inf, -math.inf, math.nan, None)


@pytest.mark.parametrize("chunk_rows", [7, 250_000])
def test_min_and_max_are_the_earliest_sample_holding_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_rows: int
) -> None:
    """0.0 and -0.0 are equal values; infinities and NaN are not finite and never the min or
    max; chunks of 7 rows split the ties between chunks."""
    monkeypatch.setattr(series_stats, "SUMMARY_CHUNK_ROWS", chunk_rows)
    rng = random.Random(11)
    names = [f"m{k}" for k in range(12)]
    observed: dict[str, list[tuple[int, float | None]]] = defaultdict(list)
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=5))
    for s in range(30):
        values = {name: rng.choice(EXTREMES) for name in names}
        values["zeros"] = 0.0 if s < 10 else -0.0  # the min and max is 0.0 (= -0.0) at 0
        values["signed_zeros"] = -0.0 if s < 10 else 0.0
        for name, value in values.items():
            observed[name].append((s, value))
        writer.append([m(s, "x", values)])
    writer.close()
    merge_history(tmp_path)
    write_result(tmp_path, (LayerInfo("x", "Linear"),), WINDOW)
    [layer] = strict_loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    metrics = layer["tensors"][0]["metrics"]
    for name, pairs in observed.items():
        finite = [(s, v) for s, v in pairs if v is not None and math.isfinite(v)]
        for pick in (min, max):
            got = metrics[name][pick.__name__]
            if not finite:
                assert got == {"value": None, "sample_id": None}, name
                continue
            best = pick(v for _, v in finite)
            assert got["value"] == best, name
            assert got["sample_id"] == min(s for s, v in finite if v == best), name


ODD_NAMES = ('q"uote', "back\\slash", "new\nline", "tab\t", "\x01control", "é ü 中", "\u2028")


def test_odd_tensor_paths_metrics_and_dtypes_read_back_as_written(tmp_path: Path) -> None:
    """result.json's text is assembled column-wise; every string is escaped as JSON requires."""
    writer = HistoryWriter(tmp_path, HistoryConfig())
    for s in range(3):
        writer.append([m(s, "odd", {name: float(s)}, path=name, dtype=name) for name in ODD_NAMES])
    writer.close()
    merge_history(tmp_path)
    write_result(tmp_path, (LayerInfo("odd", "Linear"),), WINDOW)
    [layer] = strict_loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    got = {t["tensor_path"]: t for t in layer["tensors"]}
    assert set(got) == set(ODD_NAMES)
    for name, tensor in got.items():
        assert tensor["dtype"] == name
        assert tensor["metrics"][name]["latest"] == 2.0
        assert tensor["shape"] == [2, 3]
