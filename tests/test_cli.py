"""`torchinstruments show / compare / plot` on real run directories.

Each command runs as a user runs it (`python -m torchinstruments ...` in a subprocess) on a
finished run, on a live run (parts only, the observer still attached in a real training process),
on the same run after a SIGKILL, and after `finalize`. Numbers in the `--format json` output are
checked against plain Polars queries on the Parquet files, written here without the reader's code:
latest = the value at the series' largest sample_id, window mean = the mean over the series'
latest `window` sample_ids.

The child training process is this file itself (`python tests/test_cli.py DIR`): it trains
SAMPLES steps with one part per sample (the first sample's forward and backward rows are each a
part, written at once), then sleeps with the observer attached until it is killed.
Its directory name holds glob characters (`exp[lr=0.1]`), which must be read literally.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from PIL import Image
from torch import nn

from torchinstruments import (
    DEFAULT_METRICS,
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.__main__ import main
from torchinstruments.cli.pictures import DPI, LEGEND_WIDTH_IN, PANEL_HEIGHT_IN, PANEL_WIDTH_IN
from torchinstruments.cli.plot import DEFAULT_METRICS as PLOT_DEFAULT_METRICS
from torchinstruments.rundir.layout import list_parts

from conftest import check_heatmap, run_cli, sgd_step, wait_for_rows

SAMPLES = 7
WINDOW = 3
LAYERS_WITH_GRADIENT = 4  # fc1, act, shared (called twice): 4 tensors receive gradients
OUTPUT_TENSORS = 5  # fc1, act, shared x2, empty
ROWS_PER_SAMPLE = (OUTPUT_TENSORS + LAYERS_WITH_GRADIENT) * len(DEFAULT_METRICS)
WAIT_S = 120.0
CHILD_LIFETIME_S = 300.0
SERIES = ["layer", "call_index", "signal", "tensor_path", "metric"]
TENSORS = [("fc1", 0, ""), ("act", 0, ""), ("shared", 0, ""), ("shared", 1, ""), ("empty", 0, "")]


class Empty(nn.Module):
    """Returns an empty slice: its values are null with reason "empty tensor"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:0]


class Net(nn.Module):
    """A layer called twice (call_index 0 and 1) and a layer whose output has no elements."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.Tanh()
        self.shared = nn.Linear(8, 8)
        self.empty = Empty()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.shared(self.act(self.fc1(x))))
        self.empty(h)
        return self.head(h)


def build(scale: float = 1.0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A seeded model and data; `scale` multiplies the inputs (a controlled difference)."""
    torch.manual_seed(7)
    model = Net()
    x = torch.randn(32, 6) * scale
    y = x.sum(dim=1, keepdim=True)
    return model, x, y


def observe(directory: Path, model: nn.Module) -> None:
    """Inject with every forward sampled, the head left out (so rows per sample are known)."""
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        selector=lambda name, module: name in {"fc1", "act", "shared", "empty"},
        history_config=HistoryConfig(buffer_rows=ROWS_PER_SAMPLE, window=WINDOW),
    )


def train_run(directory: Path, steps: int = SAMPLES, scale_from: int | None = None) -> Path:
    """A finished run; from step `scale_from` on, the inputs are doubled."""
    model, x, y = build()
    observe(directory, model)
    for step in range(steps):
        factor = 2.0 if scale_from is not None and step >= scale_from else 1.0
        sgd_step(model, x * factor, y, 0.05)
    remove_observer(model)
    return directory


def child_main(directory: Path) -> None:
    """The live run: SAMPLES steps, then the observer stays attached until the process dies."""
    torch.set_num_threads(1)
    model, x, y = build()
    observe(directory, model)
    for _ in range(SAMPLES):
        sgd_step(model, x, y, 0.05)
    print("trained", flush=True)
    deadline = time.monotonic() + CHILD_LIFETIME_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`torchinstruments ARGS` in this process (the entry point the script calls)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def cli_json(*args: str | Path) -> dict[str, Any]:
    """The `--format json` payload, checked compact: `{"run":...,"rows":[`, then each row
    alone on its line with no indentation, then `]}` (what `jq` and line tools read)."""
    result = cli(*args, "--format", "json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    lines = result.stdout.rstrip("\n").split("\n")
    compact = {"separators": (",", ":"), "ensure_ascii": False}
    assert lines[0] == '{"run":' + json.dumps(payload["run"], **compact) + ',"rows":['
    assert lines[1:-1] == [json.dumps(row, **compact) + "," for row in payload["rows"][:-1]] + [
        json.dumps(row, **compact) for row in payload["rows"][-1:]
    ]
    assert lines[-1] == "]}"
    return payload


def expected_summary(files: list[Path], window: int) -> dict[tuple, dict[str, Any]]:
    """Latest value and window mean per series, from the Parquet files, in plain Python."""
    frame = pl.concat([pl.read_parquet(f, glob=False) for f in files]).sort("sample_id")
    out: dict[tuple, dict[str, Any]] = {}
    for key, rows in frame.group_by(SERIES):
        samples = sorted(set(rows["sample_id"].to_list()))
        last = rows.filter(pl.col("sample_id") == samples[-1])
        in_window = rows.filter(pl.col("sample_id").is_in(samples[-window:]))
        finite = [v for v in in_window["value"].to_list() if v is not None and math.isfinite(v)]
        out[tuple(key)] = {
            "latest_value": last["value"].to_list()[-1],
            "latest_sample_id": samples[-1],
            "latest_reason": last["unavailable_reason"].to_list()[-1],
            "window_mean": sum(finite) / len(finite) if finite else None,
            "window_samples": len(samples[-window:]),
        }
    return out


def check_show(directory: Path, files: list[Path]) -> dict[str, Any]:
    """`show --format json` equals the plain computation on `files`; returns the payload."""
    payload = cli_json("show", directory)
    expected = expected_summary(files, WINDOW)
    got = {tuple(row[k] for k in SERIES): row for row in payload["rows"]}
    assert set(got) == set(expected)
    for key, want in expected.items():
        row = got[key]
        assert row["latest_sample_id"] == want["latest_sample_id"], key
        assert row["latest_reason"] == want["latest_reason"], key
        assert row["window_samples"] == want["window_samples"], key
        for name in ("latest_value", "window_mean"):
            if want[name] is None:
                assert row[name] is None, (key, name)
            else:
                assert row[name] == pytest.approx(want[name], rel=1e-12, abs=1e-300), (key, name)
    return payload


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_run(tmp_path_factory.mktemp("finished") / "stats")


# -- show -------------------------------------------------------------------------------------


def test_show_finished_run_matches_history(finished: Path) -> None:
    payload = check_show(finished, [finished / "history.parquet"])
    rows = payload["rows"]
    assert payload["run"]["state"] == "complete"
    assert payload["run"]["window"] == WINDOW
    assert len(rows) == ROWS_PER_SAMPLE  # one row per series
    empty = [r for r in rows if r["layer"] == "empty"]
    assert {r["latest_reason"] for r in empty} == {"empty tensor"}
    assert {(r["layer"], r["call_index"]) for r in rows if r["layer"] == "shared"} == {
        ("shared", 0),
        ("shared", 1),
    }
    # traversal order of layers, output before output_gradient within a layer
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    assert layers == ["fc1", "act", "shared", "empty"]


def test_show_filters_and_formats(finished: Path) -> None:
    payload = cli_json(
        "show", finished, "--layers", "^sh", "--signal", "output_gradient", "--metrics", "p50,max"
    )
    keys = {(r["layer"], r["call_index"], r["signal"], r["metric"]) for r in payload["rows"]}
    assert keys == {("shared", c, "output_gradient", m) for c in (0, 1) for m in ("p50", "max")}
    csv = cli("show", finished, "--metrics", "std", "--format", "csv")
    assert csv.returncode == 0, csv.stderr
    frame = pl.read_csv(csv.stdout.encode())
    assert frame.height == 9  # 5 output tensors + 4 gradients, one metric
    history = pl.read_parquet(finished / "history.parquet")
    want = history.filter(
        pl.col("layer") == "fc1",
        pl.col("signal") == "output",
        pl.col("metric") == "std",
        pl.col("sample_id") == SAMPLES - 1,
    )["value"].item()
    got = frame.filter(pl.col("layer") == "fc1", pl.col("signal") == "output")["latest_value"]
    assert got.item() == want
    md = cli("show", finished, "--metrics", "mean", "--format", "markdown")
    assert md.stdout.splitlines()[0].startswith("| layer | module_type |")
    assert len(md.stdout.splitlines()) == 2 + 9


def test_show_text_fits_80_columns_for_30_layers(tmp_path: Path) -> None:
    model = nn.Sequential(*[m for i in range(15) for m in (nn.Linear(8, 8), nn.ReLU())])
    inject_observer(model, output_dir=tmp_path / "deep", sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
    remove_observer(model)
    result = cli("show", tmp_path / "deep")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    for metric in DEFAULT_METRICS:
        assert f"{metric}:" in lines
    # every one of the 30 layers has a row in the std table
    start = lines.index("std:")
    rows = lines[start + 3 : start + 3 + 30]
    assert [row.split()[0] for row in rows] == [str(i) for i in range(30)]


def test_show_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    result = cli("show", tmp_path)
    assert result.returncode == 1
    assert "holds no run" in result.stderr
    for rank in range(2):
        train_run(tmp_path / "ranks" / f"rank-{rank:03d}", steps=2)
    result = cli("show", tmp_path / "ranks")  # a parent of rank runs is read as one run
    assert result.returncode == 0, result.stderr
    assert "rank 0-1: complete" in result.stdout


def test_show_does_not_import_torch(finished: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['tensorboard'] = None\n"
        "from torchinstruments.__main__ import main\n"
        "args = sys.argv[1:]\n"
        "for command in (['show', args[0]], ['compare', args[0], args[0]]):\n"
        "    assert main(command) == 0\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(finished)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr


# -- live, crashed, finalized -----------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A training process that has written SAMPLES parts and still has its observer attached."""
    directory = tmp_path_factory.mktemp("live") / "exp[lr=0.1]"
    child = subprocess.Popen(
        [sys.executable, __file__, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while len(list_parts(directory)) < SAMPLES + 1:  # the first sample is two parts
            assert child.poll() is None, f"training child exited early: {child.stdout}"
            assert time.monotonic() < deadline, f"no {SAMPLES} parts after {WAIT_S} s"
            time.sleep(0.05)
        yield directory, child
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()


def test_live_crashed_and_finalized_runs(
    live: tuple[Path, subprocess.Popen[str]], finished: Path, tmp_path: Path
) -> None:
    directory, child = live
    parts = list_parts(directory)
    assert len(parts) == SAMPLES + 1  # the first sample's forward and backward: a part each
    assert not (directory / "history.parquet").exists()

    # live: the observer is attached (the process holds the run lock)
    assert child.poll() is None
    payload = check_show(directory, parts)
    assert payload["run"]["state"].startswith("in progress (a live process holds the run's lock")
    assert payload["run"]["history_files"] == [str(p) for p in parts]
    text = run_cli("show", directory, "--metrics", "mean")
    assert text.returncode == 0, text.stderr
    assert f"{len(parts)} parts in history.parts/" in text.stdout

    # the same training as `finished`: compare finds no difference at all
    comparison = cli_json("compare", finished, directory)
    assert comparison["rows"], comparison
    assert all(r["first_difference"] is None for r in comparison["rows"])
    assert all(r["matched_samples"] == SAMPLES for r in comparison["rows"])

    png = tmp_path / "live.png"
    result = cli("plot", directory, "-o", png, "--metrics", "mean")
    assert result.returncode == 0, result.stderr
    assert Image.open(png).size[0] > 300

    heatmaps = [heatmap_of(directory, tmp_path / "live", parts)]

    # crashed: SIGKILL, the parts stay, the commands still read them
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert list_parts(directory) == parts
    crashed = check_show(directory, parts)
    assert crashed["rows"] == payload["rows"]
    # before: "in progress, or interrupted", the same as while it lived; nothing holds the lock
    assert crashed["run"]["state"].startswith("interrupted: not finished, and no process holds")
    heatmaps.append(heatmap_of(directory, tmp_path / "crashed", parts))

    # finalized: history.parquet replaces the parts, same numbers
    result = run_cli("finalize", directory)
    assert result.returncode == 0, result.stderr
    assert list_parts(directory) == []
    final = check_show(directory, [directory / "history.parquet"])
    assert final["rows"] == payload["rows"]
    assert final["run"]["counts"].startswith("counts (rebuilt from history")
    assert "at least 7 root forwards" in final["run"]["counts"]
    heatmaps.append(heatmap_of(directory, tmp_path / "final", [directory / "history.parquet"]))
    assert all(np.array_equal(heatmaps[0], other) for other in heatmaps[1:])


def heatmap_of(directory: Path, out: Path, files: list[Path]) -> np.ndarray:
    """`heatmap --metrics mean` of `directory`, its cells checked against `files`; the pixels."""
    out.mkdir()
    result = cli("heatmap", directory, "--metrics", "mean", "-o", out)
    assert result.returncode == 0, result.stderr
    history = pl.concat([pl.read_parquet(f, glob=False) for f in files])
    pixels, _ = check_heatmap(out / "heatmap-mean.png", history, "mean", TENSORS, "sample_id")
    return pixels


def test_a_merge_between_listing_and_reading_is_retried(tmp_path: Path) -> None:
    """A live run may merge its parts while a command reads them: the read lists files again."""
    from torchinstruments.cli.reader import read_history
    from torchinstruments.rundir.merge import merge_history

    crashed = tmp_path / "crashed"
    model, x, y = build()
    observe(crashed, model)
    for _ in range(3):
        sgd_step(model, x, y, 0.05)
    wait_for_rows(crashed, 3 * ROWS_PER_SAMPLE)  # a later sample's rows are one chunk
    shutil.copytree(crashed / "history.parts", tmp_path / "parts")
    remove_observer(model)
    (crashed / "history.parquet").unlink()
    shutil.copytree(tmp_path / "parts", crashed / "history.parts")  # as a SIGKILL leaves it

    seen: list[int] = []

    def merge_then_count(lf: pl.LazyFrame) -> pl.LazyFrame:
        seen.append(len(list_parts(crashed)))
        if len(seen) == 1:
            merge_history(crashed)  # the parts this scan was built on are gone now
        return lf.select(pl.len())

    rows = read_history(crashed, merge_then_count).item()
    assert seen == [4, 0]  # first over the 4 parts (sample 0 is two), then history.parquet
    assert rows == pl.read_parquet(crashed / "history.parquet").height == 3 * ROWS_PER_SAMPLE


# -- compare ----------------------------------------------------------------------------------


def test_compare_reports_window_means_differences_and_first_differing_sample(
    finished: Path, tmp_path: Path
) -> None:
    changed = train_run(tmp_path / "changed", scale_from=4)
    payload = cli_json("compare", finished, changed, "--tolerance", "1e-9")
    a = pl.read_parquet(finished / "history.parquet")
    b = pl.read_parquet(changed / "history.parquet")
    joined = a.join(b, on=[*SERIES, "sample_id"], suffix="_b")
    expected_a = expected_summary([finished / "history.parquet"], WINDOW)
    expected_b = expected_summary([changed / "history.parquet"], WINDOW)
    rows = {tuple(r[k] for k in SERIES): r for r in payload["rows"]}
    assert set(rows) == set(expected_a)
    firsts = set()
    for key, row in rows.items():
        series = joined.filter(*(pl.col(k) == v for k, v in zip(SERIES, key, strict=True)))
        differ = series.filter(
            (pl.col("value").is_null() != pl.col("value_b").is_null())
            | ((pl.col("value_b") - pl.col("value")).abs() > 1e-9)
        )
        want_first = differ["sample_id"].min() if differ.height else None
        assert row["first_difference"] == want_first, key
        assert row["matched_samples"] == SAMPLES
        mean_a, mean_b = expected_a[key]["window_mean"], expected_b[key]["window_mean"]
        if mean_a is None:
            assert row["mean_a"] is None
            assert row["difference"] is None
            continue
        assert row["mean_a"] == pytest.approx(mean_a, rel=1e-12, abs=1e-300)
        assert row["mean_b"] == pytest.approx(mean_b, rel=1e-12, abs=1e-300)
        assert row["difference"] == pytest.approx(mean_b - mean_a, rel=1e-9, abs=1e-15)
        firsts.add(row["first_difference"])
    assert 4 in firsts  # the inputs change at step 4: outputs differ from that sample on
    assert min(f for f in firsts if f is not None) == 4

    text = cli("compare", finished, changed, "--metrics", "mean", "--tolerance", "1e-9")
    assert text.returncode == 0, text.stderr
    assert max(len(line) for line in text.stdout.splitlines()) <= 80
    assert "B - A" in text.stdout


def test_compare_rank_directories_by_forward_index(tmp_path: Path) -> None:
    for rank in range(2):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        inject_observer(
            model,
            output_dir=tmp_path / "stats" / f"rank-{rank:03d}",
            sampler=EveryNForwardsSampler(1 + rank),  # rank 1 samples every other forward
        )
        torch.manual_seed(100)
        for _ in range(4):
            model(torch.randn(2, 4))
        remove_observer(model)
    payload = cli_json(
        "compare",
        tmp_path / "stats" / "rank-000",
        tmp_path / "stats" / "rank-001",
        "--x",
        "forward_index",
        "--metrics",
        "max",
    )
    for row in payload["rows"]:
        assert row["matched_samples"] == 2  # forward_index 0 and 2
        assert row["first_difference"] == 0  # different weights from the first forward


# -- plot -------------------------------------------------------------------------------------


def test_plot_writes_a_png_with_the_panels_and_axis_it_says(finished: Path, tmp_path: Path) -> None:
    png = tmp_path / "trends.png"
    result = cli(
        "plot", finished, "-o", png, "--metrics", "mean,std,zero_fraction", "--x", "forward_index"
    )
    assert result.returncode == 0, result.stderr
    image = Image.open(png)
    assert image.format == "PNG"
    width, height = image.size
    assert f"({width}x{height} px)" in result.stdout
    # 3 metric rows x 2 signal columns, plus the legend column and the title row
    assert width == round((2 * PANEL_WIDTH_IN + LEGEND_WIDTH_IN) * DPI)
    assert height == round((3 * PANEL_HEIGHT_IN + 0.9) * DPI)
    description = json.loads(image.text["Description"])  # type: ignore[attr-defined]
    assert description["x"] == "forward_index"
    assert description["panels"] == [
        [m, s] for m in ("mean", "std", "zero_fraction") for s in ("output", "output_gradient")
    ]
    assert description["tensors"] == [
        "fc1 (Linear)",
        "act (Tanh)",
        "shared#0 (Linear)",
        "shared#1 (Linear)",
        "empty (Empty)",
    ]


def test_plot_figure_lines_are_the_history_values(finished: Path) -> None:
    from torchinstruments.cli.pictures import X_LABELS, trend_figure
    from torchinstruments.cli.plot import plot_rows
    from torchinstruments.cli.reader import read_facts
    from torchinstruments.cli.selection import Selection

    rows = plot_rows(finished, Selection(metrics=("std",)), "sample_id")
    figure, result = trend_figure(rows, read_facts(finished), "sample_id", max_tensors=2)
    assert result.left_out == ("shared#0 (Linear)", "shared#1 (Linear)", "empty (Empty)")
    output, gradient = figure.axes
    assert output.get_title() == "std of output"
    assert gradient.get_xlabel() == X_LABELS["sample_id"]
    history = pl.read_parquet(finished / "history.parquet")
    for line, layer in zip(output.get_lines(), ("fc1", "act"), strict=True):
        want = history.filter(
            pl.col("layer") == layer, pl.col("signal") == "output", pl.col("metric") == "std"
        ).sort("sample_id")
        assert list(line.get_xdata()) == want["sample_id"].to_list()
        assert list(line.get_ydata()) == want["value"].to_list()


@pytest.mark.parametrize("command", ["plot", "heatmap"])
def test_drawing_help_sends_no_one_to_the_package_index(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pip install torchinstruments[plot]` fetches an unrelated project of that name from the
    package index (README, Install), so the help must not send a user there."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "torchinstruments[plot]" not in text
    assert "pip install matplotlib" in text


def test_plot_description_names_every_x_axis(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    description = " ".join(capsys.readouterr().out.split()).partition("positional arguments")[0]
    assert "over sample_id, forward_index or step (--x)" in description


def test_heatmap_description_says_what_a_null_value_is_drawn_as_and_no_nonfinite_colour(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The library's histories hold no NaN or Inf: the colours that matter are a null value's
    (grey, `pictures_grid.NULL_COLOUR`) and a missing row's (white)."""
    with pytest.raises(SystemExit):
        main(["heatmap", "--help"])
    description = " ".join(capsys.readouterr().out.split()).partition("positional arguments")[0]
    assert "A null value (no value: its reason is in unavailable_reason" in description
    assert "is grey, and a tensor without a row at a sample is white" in description
    assert "nonfinite" not in description


def test_plot_help_names_the_metrics_plot_draws_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    metrics_help = text.split("--metrics M1,M2 comma", 1)[1].split(" --x ", 1)[0]
    default = metrics_help.split("(default: ", 1)[1]
    assert not default.startswith("all metrics in the run")
    assert all(metric in default for metric in PLOT_DEFAULT_METRICS), default


def test_plot_without_matplotlib_says_how_to_install(finished: Path, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "from torchinstruments.__main__ import main\n"
        "sys.exit(main(['plot', sys.argv[1], '-o', sys.argv[2]]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(finished), str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 3
    assert "pip install matplotlib" in result.stderr
    assert "torchinstruments[plot]" not in result.stderr  # the index's is another project
    assert not (tmp_path / "x.png").exists()


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
