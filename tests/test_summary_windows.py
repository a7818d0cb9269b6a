"""result.json's windows: exact means, equal to the bit to what every command prints, and taken
from one implementation (`rundir.windows`), checked against plain Python."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import shutil
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from torchinstruments.__main__ import main
from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import INTERRUPTED, LayerInfo
from torchinstruments.rundir import windows as windows_module
from torchinstruments.rundir.merge import merge_history
from torchinstruments.rundir.summary import write_result
from torchinstruments.rundir.windows import SERIES_KEY, TENSOR_KEY, window_mean
from torchinstruments.rundir.writer import HistoryWriter

from _summary_rows import WINDOW, m
from conftest import strict_loads

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
    tensor = result[0]["tensors"][0]
    recent = tensor["metrics"]["mean"]["recent"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["show", str(tmp_path), "--window", str(WINDOW), "--format", "json"]) == 0
    (row,) = json.loads(out.getvalue())["rows"]
    values = [value for pair in CANCELLING[-WINDOW:] for value in pair]
    exact = math.fsum(values) / len(values)
    assert sum(values) / len(values) != exact  # the data tells an ordered sum from an exact one
    assert recent["mean"] == exact
    assert row["window_mean"] == recent["mean"]  # to the bit, not approximately
    assert (row["window_samples"], tensor["recent"]["actual"]) == (WINDOW, WINDOW)


def test_window_mean_is_exact_and_never_overflows() -> None:
    assert window_mean([1e308, 1e308, 1e308]) == 1e308  # the sum overflows, the mean does not
    assert window_mean([0.1] * 10) == math.fsum([0.1] * 10) / 10
    assert window_mean([]) is None


def uneven_history(directory: Path, seed: int = 3) -> None:
    """Samples with gaps in their ids, a layer in some samples only, nulls and infinities,
    gradients of some samples only, eval samples, two interrupted samples (marker rows), and
    with an even seed a layer that stops early."""
    rng = random.Random(seed)
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=11, window=WINDOW))
    samples = [0, 1, 2, 5, 6, 9, 14, 15, 16, 23, 24, 31, 40, 41]
    for s in samples[: len(samples) - seed % 2]:  # the runs' latest samples differ
        mode = "eval" if s in (9, 24) else "train"
        batch = [m(s, "dense", {"mean": rng.gauss(0, 1), "std": rng.random()}, mode=mode)]
        if s % 3 != seed % 3:
            batch.append(m(s, "sparse", {"mean": rng.gauss(0, 1)}))
        nullable = rng.choice([None, None, math.inf, rng.gauss(0, 1), rng.gauss(0, 1)])
        batch.append(m(s, "nulls", {"mean": nullable, "std": None}))
        if s % 2:
            batch.append(m(s, "dense", {"mean": rng.gauss(0, 1)}, signal="output_gradient"))
        if s in (6, 31):
            batch.append(m(s, "dense", {INTERRUPTED: None}, call=1))
        if seed % 2 == 0 and s < 10:  # a layer of one run only, that stops early
            batch.append(m(s, "stops", {"mean": rng.gauss(0, 1)}))
        writer.append(batch)
    writer.close()
    merge_history(directory)


UNEVEN_LAYERS = (
    LayerInfo("dense", "Linear"),
    LayerInfo("sparse", "Linear"),
    LayerInfo("nulls", "ReLU"),
    LayerInfo("stops", "Linear"),
)


def plain_windows(history: Path, window: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Every series' windows, (*series key, "recent" | "previous") -> facts, in plain Python from
    history's rows: a series' own distinct samples newest first (marker rows are no series'
    rows), the latest `window` and the `window` before; the mean of the finite values."""
    by_series: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in pl.read_parquet(history).to_dicts():
        if row["metric"] != INTERRUPTED:
            by_series[tuple(row[k] for k in SERIES_KEY)].append(row)
    out = {}
    for key, rows in by_series.items():
        distinct = sorted({r["sample_id"] for r in rows}, reverse=True)
        for name, samples in (("recent", distinct[:window]), ("previous", distinct[window:])):
            samples = samples[:window]
            if not samples:
                continue
            values = [r["value"] for r in rows if r["sample_id"] in samples]
            valid = [v for v in values if v is not None]
            finite = [v for v in valid if math.isfinite(v)]
            out[(*key, name)] = {
                "actual": len(samples),
                "valid": len(valid),
                "mean": math.fsum(finite) / len(finite) if finite else None,
                "first_sample_id": min(samples),
                "last_sample_id": max(samples),
            }
    return out


def result_json_windows(directory: Path) -> dict[tuple[Any, ...], dict[str, Any]]:
    """result.json's windows as `plain_windows` keys them (a metric's own facts win)."""
    out = {}
    for layer in strict_loads((directory / "result.json").read_text(encoding="utf-8")):
        for tensor in layer["tensors"]:
            key = (layer["layer"], *(tensor[k] for k in TENSOR_KEY[1:]))
            for metric, facts in tensor["metrics"].items():
                for name in ("recent", "previous"):
                    window = {**tensor[name], **facts.get(name, {})}
                    if window["actual"]:
                        out[(*key, metric, name)] = window
    return out


def command_json(*args: str) -> dict[str, Any]:
    """A command's `--format json` output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--window", str(WINDOW), "--format", "json"]) == 0
    return json.loads(out.getvalue())


def test_result_json_and_every_command_take_their_windows_from_one_implementation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """result.json's `recent` and `previous` windows equal plain Python's on runs with nulls,
    infinities, interrupted samples, eval samples and uneven sample spacing; `show`, `compare`
    and a rank parent's `show` print the same recent windows (samples, valid values, mean to the
    bit, sample range); and each of them got its windows from `rundir.windows`' one
    implementation: a spy on the step that forms windows sees every window they print, so a
    second selection of window samples anywhere else fails here."""
    formed: set[tuple[Any, ...]] = set()
    original = windows_module._aggregate

    def spy(rows: pl.DataFrame, window: int) -> pl.DataFrame:
        frame = original(rows, window)
        for row in frame.iter_rows(named=True):
            formed.add((*(row[k] for k in SERIES_KEY), ("recent", "previous")[row["which"]]))
        return frame

    def through_the_one_implementation(keys: Iterable[tuple[Any, ...]]) -> None:
        keys = set(keys)
        assert keys, "nothing to check"
        assert keys <= formed, sorted(keys - formed)[:3]
        formed.clear()

    monkeypatch.setattr(windows_module, "_aggregate", spy)
    runs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    expected = {}
    for name, directory in runs.items():
        uneven_history(directory, seed=3 if name == "a" else 4)
        write_result(directory, UNEVEN_LAYERS, WINDOW)
        from_json = result_json_windows(directory)
        through_the_one_implementation(from_json)
        assert from_json == plain_windows(directory / "history.parquet", WINDOW)
        expected[name] = from_json
    every = {k for run in expected.values() for k in run}
    assert {k[2] for k in every} == {"output", "output_gradient"}
    assert {k[4] for k in every} == {"train", "eval"}
    assert any(w["valid"] < w["actual"] for w in expected["a"].values())  # nulls
    assert any(w["mean"] is None and w["valid"] for w in expected["a"].values())  # only inf
    assert expected["a"].keys() != expected["b"].keys()  # series one run lacks

    def recent(run: str, row: dict[str, Any]) -> dict[str, Any] | None:
        return expected[run].get((*(row[k] for k in SERIES_KEY), "recent"))

    for name, directory in runs.items():
        shown = command_json("show", str(directory))["rows"]
        through_the_one_implementation((*(r[k] for k in SERIES_KEY), "recent") for r in shown)
        assert {(*(r[k] for k in SERIES_KEY), "recent") for r in shown} == {
            k for k in expected[name] if k[-1] == "recent"
        }
        for row in shown:
            window = recent(name, row)
            assert window is not None
            assert (row["window_samples"], row["window_valid"]) == (
                window["actual"],
                window["valid"],
            )
            assert row["window_mean"] == window["mean"]  # to the bit
            assert (row["window_first_sample_id"], row["window_last_sample_id"]) == (
                window["first_sample_id"],
                window["last_sample_id"],
            )

    compared = command_json("compare", str(runs["a"]), str(runs["b"]))["rows"]
    through_the_one_implementation(
        (*(r[k] for k in SERIES_KEY), "recent")
        for r in compared
        if r["samples_a"] and r["samples_b"]
    )
    for row in compared:
        for run in ("a", "b"):
            window = recent(run, row)
            if window is None:
                assert (row[f"mean_{run}"], row[f"window_{run}"]) == (None, None)
                continue
            assert row[f"mean_{run}"] == window["mean"]
            assert row[f"window_{run}"] == f"{window['first_sample_id']}-{window['last_sample_id']}"

    parent = tmp_path / "parent"
    for rank, run in enumerate(("a", "b")):
        shutil.copytree(runs[run], parent / f"rank-{rank:03d}")
    spread = [r for r in command_json("show", str(parent))["rows"] if r["at"] == "window"]
    through_the_one_implementation((*(r[k] for k in SERIES_KEY), "recent") for r in spread)
    for row in spread:
        windows = [w for w in (recent("a", row), recent("b", row)) if w is not None]
        means = [w["mean"] for w in windows if w["mean"] is not None]
        assert row["ranks"] == len(means)
        assert (row["min"], row["max"]) == ((min(means), max(means)) if means else (None, None))
        lasts = [w["last_sample_id"] for w in windows]
        assert (row["first_sample_id"], row["last_sample_id"]) == (min(lasts), max(lasts))
