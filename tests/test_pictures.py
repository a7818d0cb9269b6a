"""Heatmap and plot pictures that read without a legend hunt: framed panels (white "no row"
cells at an edge stay inside a visible panel), cells large enough for a laptop screen, nulls
marked on the plot's lines, and a default plot of a few panels instead of eighteen.

Values are checked on the PNG's pixels and on what the command reports, against the history
read with Polars.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from PIL import Image
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer, set_step
from torchinstruments.__main__ import main
from torchinstruments.cli import pictures
from torchinstruments.cli.heatmap import heatmap
from torchinstruments.cli.pictures import DPI, MAX_LABEL_CHARS, PANEL_WIDTH_IN, trend_figure
from torchinstruments.cli.pictures_grid import FRAME_COLOUR
from torchinstruments.cli.plot import DEFAULT_METRICS, plot, plot_catalog, plot_rows
from torchinstruments.cli.reader import read_facts
from torchinstruments.cli.selection import Selection

from conftest import read_heatmap

pytest.importorskip("matplotlib")


class Branch(nn.Module):
    """`side` is cut from the loss after two samples (its gradient rows stop); `head`'s output
    is NaN from the third sample on (its statistics over finite entries are null)."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(3, 3)
        self.head = nn.Linear(3, 3)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.side(x)
        if self.step >= 2:
            side = side.detach()
        out = self.head(x) + side
        self.step += 1
        return out * float("nan") if self.step > 3 else out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pictures") / "run"
    torch.manual_seed(0)
    model = Branch()
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(6):
        model(torch.randn(4, 3)).sum().backward()
    remove_observer(model)
    return directory


def test_heatmap_panels_are_framed_and_cells_read_on_a_laptop(run: Path, tmp_path: Path) -> None:
    (result,) = heatmap(run, tmp_path, Selection(metrics=("mean",)))
    pixels, meta = read_heatmap(result.path)
    history = pl.read_parquet(run / "history.parquet")
    columns = sorted(history["sample_id"].unique())
    for panel in meta["panels"]:
        top, left = panel["top"], panel["left"]
        bottom = top + panel["cell_height"] * len(meta["rows"])
        right = left + panel["cell_width"] * len(columns)
        frame = [
            *pixels[top - 1, left - 1 : right + 1],
            *pixels[bottom, left - 1 : right + 1],
            *pixels[top - 1 : bottom + 1, left - 1],
            *pixels[top - 1 : bottom + 1, right],
        ]
        assert {tuple(int(c) for c in p) for p in frame} == {FRAME_COLOUR}, panel["signal"]
        assert panel["cell_height"] >= 20  # a 10 pt row label's height
    # side's gradient has no row from sample 2: its cells are white, inside the frame
    gradient = next(p for p in meta["panels"] if p["signal"] == "output_gradient")
    row = [tuple(r[:3]) for r in meta["rows"]].index(("side", 0, ""))
    y = gradient["top"] + row * gradient["cell_height"] + gradient["cell_height"] // 2
    x = gradient["left"] + 4 * gradient["cell_width"] + gradient["cell_width"] // 2
    assert tuple(pixels[y, x]) == (255, 255, 255)


def test_plot_marks_null_values_and_draws_a_few_metrics_by_default(
    run: Path, tmp_path: Path
) -> None:
    result = plot(run, tmp_path / "trends.png", Selection())
    history = pl.read_parquet(run / "history.parquet").filter(pl.col("metric") != "interrupted")
    drawn = sorted({m for m, _ in result.panels})
    assert drawn == sorted(DEFAULT_METRICS)
    assert sorted(result.metrics_left_out) == sorted(set(history["metric"]) - set(DEFAULT_METRICS))
    nulls = history.filter(pl.col("metric").is_in(DEFAULT_METRICS), pl.col("value").is_null())
    assert nulls.height > 0
    assert result.null_marks == nulls.height  # one x per null value, in its line's colour
    assert result.height_px <= 1100  # 8 panels: fits a laptop screen, not 2,160 px
    image = np.asarray(Image.open(result.path))
    assert image.shape[0] == result.height_px

    every = plot(
        run, tmp_path / "all.png", Selection(metrics=tuple(sorted(set(history["metric"]))))
    )
    assert every.metrics_left_out == ()


PARTS = (
    "query_key_value_projection_with_rotary_embeddings",
    "cross_attention_block_number_eleven",
    "transformer_decoder_stack",
)
NESTED = "deep." + ".".join(reversed(PARTS))  # 116 characters
FLAT = "a_very_long_layer_name_" + "x" * 150  # 173 characters


class LongNames(nn.Module):
    """A Linear nested three ModuleDicts deep (a 116-character name) and a 173-character one."""

    def __init__(self) -> None:
        super().__init__()
        inner: nn.Module = nn.Linear(3, 3)
        for part in PARTS:
            inner = nn.ModuleDict({part: inner})
        self.deep = inner
        self.add_module(FLAT, nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.get_submodule(NESTED)
        return self.get_submodule(FLAT)(layer(x))


def test_plot_shortens_long_layer_names_in_the_legend_and_keeps_the_panels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Labels are cut to heatmap's MAX_LABEL_CHARS by its rule (`...` and the name's end), the
    panels keep their width, and the full names are in the PNG's metadata and on stderr."""
    assert (len(NESTED), len(FLAT)) == (116, 173)
    torch.manual_seed(0)
    model = LongNames()
    directory = tmp_path / "run"
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    png = tmp_path / "long.png"
    assert main(["plot", str(directory), "--metrics", "mean", "-o", str(png)]) == 0
    err = capsys.readouterr().err
    full = [f"{NESTED} (Linear)", f"{FLAT} (Tanh)"]
    short = ["..." + label[-(MAX_LABEL_CHARS - 3) :] for label in full]
    with Image.open(png) as image:
        description = json.loads(image.info["Description"])
    assert description["tensors"] == full
    assert description["legend"] == short
    assert all(f"{s} = {f}" in err for s, f in zip(short, full, strict=True))

    rows = plot_rows(directory, Selection(metrics=("mean",)), "sample_id")
    figure, _ = trend_figure(rows, read_facts(directory), "sample_id", 10)
    figure.canvas.draw()
    widths = [ax.get_window_extent().width for ax in figure.axes]
    assert len(widths) == 2
    assert min(widths) > 0.75 * PANEL_WIDTH_IN * DPI  # the legend takes no panel's width


def test_a_plot_of_many_tensors_keeps_its_lines_and_legend_readable_inside_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--max-tensors 12`: every line as wide as the widest of a 10-tensor plot (the first of
    3,000 was 1,000 points wide), and a legend of `LEGEND_TENSORS` entries (5 here), the last
    counting the others, inside the image it sizes (one entry per line ran off the image)."""
    monkeypatch.setattr(pictures, "LEGEND_TENSORS", 5)
    directory = tmp_path / "many"
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(12)])
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    model(torch.randn(1, 2))
    remove_observer(model)
    rows = plot_rows(directory, Selection(metrics=("mean",)), "sample_id")
    figure, result = trend_figure(rows, read_facts(directory), "sample_id", 12)
    figure.canvas.draw()
    assert len(result.legend) == 12  # the PNG's Description names each
    (legend,) = figure.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == [
        *(f"{i} (Linear)" for i in range(4)),
        "and 8 more\n(the PNG's Description\nnames each)",
    ]
    extent = legend.get_window_extent()
    assert extent.y0 >= 0
    assert extent.y1 <= figure.bbox.height
    lines = [line for ax in figure.axes for line in ax.get_lines()]
    assert len(lines) == 12
    assert max(line.get_linewidth() for line in lines) == pytest.approx(1 + 0.35 * 9)
    assert max(line.get_markersize() for line in lines) == pytest.approx(4 + 1.5 * 9)


def _observe(directory: Path, forwards: int, nan_first: bool = False) -> Path:
    """A Linear, ReLU, Linear run of `forwards` samples (the first Linear's weight NaN with
    `nan_first`: its output and the ReLU's are NaN at every sample, their statistics null)."""
    torch.manual_seed(0)
    first = nn.Linear(4, 8)
    if nan_first:
        nn.init.constant_(first.weight, float("nan"))
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(8, 2))
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning) if nan_first else contextlib.nullcontext():
        for _ in range(forwards):
            model(torch.randn(5, 4)).sum().backward()
    remove_observer(model)
    return directory


def _visible_xticks(ax: Any) -> list[float]:
    lo, hi = ax.get_xlim()
    return [float(t) for t in ax.get_xticks() if lo <= t <= hi]


def test_plot_ticks_whole_samples_and_a_single_sample_at_its_own_tick(
    run: Path, tmp_path: Path
) -> None:
    """One sample is drawn at sample_id 0 with a tick there alone, not among ticks at
    -0.04 .. 0.04; six samples get whole-number ticks only (never 0.25 of a sample)."""
    single = _observe(tmp_path / "single", forwards=1)
    for directory, samples in ((single, [0.0]), (run, None)):
        rows = plot_rows(directory, Selection(metrics=("mean",)), "sample_id")
        figure, _ = trend_figure(rows, read_facts(directory), "sample_id", 8)
        for ax in figure.axes:
            ticks = _visible_xticks(ax)
            assert ticks
            assert all(t == int(t) for t in ticks), ticks
            if samples is not None:
                assert ticks == samples


def test_plot_panel_without_a_finite_value_has_no_y_scale_and_says_so(tmp_path: Path) -> None:
    """The NaN tensors' mean of output is null at every sample: that panel has no y ticks
    (matplotlib's default -0.05 .. 0.05 would read as values near 0) and says it has no finite
    value; the gradient panel, with values, keeps its scale and says nothing of the kind."""
    from torchinstruments.cli.pictures import NO_VALUE

    directory = _observe(tmp_path / "nan", forwards=3, nan_first=True)
    history = pl.read_parquet(directory / "history.parquet").filter(pl.col("metric") == "mean")
    out = history.filter(pl.col("signal") == "output", pl.col("layer").is_in(["0", "1"]))
    assert out["value"].null_count() == out.height == 6
    rows = plot_rows(directory, Selection(layers="^[01]$", metrics=("mean",)), "sample_id")
    figure, result = trend_figure(rows, read_facts(directory), "sample_id", 8)
    assert result.panels == (("mean", "output"), ("mean", "output_gradient"))
    output, gradient = figure.axes
    assert list(output.get_yticks()) == []
    assert [t.get_text() for t in output.texts] == [NO_VALUE]
    assert len(gradient.get_yticks()) > 0
    assert len(gradient.texts) == 0


def test_heatmap_panel_without_a_finite_value_has_no_colour_scale_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A panel whose every cell is null has a colour bar without ticks (a 0 .. 1 bar would
    read as values there) and a title that says it has no finite values."""
    from matplotlib.figure import Figure

    from torchinstruments.cli.pictures_grid import NO_FINITE

    directory = _observe(tmp_path / "nan", forwards=3, nan_first=True)
    bars: list[Any] = []
    colorbar = Figure.colorbar

    def recording(self: Figure, *args: Any, **kwargs: Any) -> Any:
        bars.append(colorbar(self, *args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(Figure, "colorbar", recording)
    (result,) = heatmap(directory, tmp_path, Selection(layers="^[01]$", metrics=("mean",)))
    assert [p.signal for p in result.panels] == ["output", "output_gradient"]
    assert result.panels[0].vmin is None
    assert result.panels[1].vmin is not None
    output_bar, gradient_bar = bars
    assert list(output_bar.ax.get_yticks()) == []
    assert len(gradient_bar.ax.get_yticks()) > 0
    titles = [ax.get_title() for ax in output_bar.ax.figure.axes if ax.get_title()]
    assert titles == [f"output: {NO_FINITE}", "output_gradient"]


def test_heatmap_of_one_narrow_panel_keeps_its_whole_legend_inside_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One signal of one sample is a narrow panel: the image is still as wide as the legend of
    the three cell colours, whose last entry ("no row ...") a narrower image cut off."""
    from matplotlib.figure import Figure

    directory = _observe(tmp_path / "single", forwards=1)
    legends: list[Any] = []
    legend = Figure.legend

    def recording(self: Figure, *args: Any, **kwargs: Any) -> Any:
        legends.append(legend(self, *args, **kwargs))
        return legends[-1]

    monkeypatch.setattr(Figure, "legend", recording)
    selection = Selection(signals=("output",), metrics=("mean",))
    (result,) = heatmap(directory, tmp_path, selection)
    assert len(result.panels) == 1
    (drawn,) = legends
    assert [t.get_text() for t in drawn.get_texts()][-1].startswith("no row")
    extent = drawn.get_window_extent()
    assert extent.x0 >= 0
    assert extent.x1 <= result.width_px
    image = Image.open(result.path)
    assert image.size == (result.width_px, result.height_px)


def test_plot_reads_the_values_of_the_tensors_it_draws_only(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3,000-layer run's plot of 10 tensors must not hold 5.4 M rows: the values read are
    the drawn tensors, and the names that choose them are read a range of
    samples at a time (ranges of one or two samples here)."""
    from torchinstruments.cli import chunked

    history = pl.read_parquet(run / "history.parquet")
    per_sample = int(history.group_by("sample_id").len()["len"].max())  # type: ignore[arg-type]
    monkeypatch.setattr(chunked, "CHUNK_ROWS", per_sample)
    frames: list[pl.DataFrame] = []
    collect = pl.LazyFrame.collect

    def recorded(self: pl.LazyFrame, *args: Any, **kwargs: Any) -> Any:
        frame = collect(self, *args, **kwargs)
        frames.append(frame)
        return frame

    monkeypatch.setattr(pl.LazyFrame, "collect", recorded)
    result = plot(run, tmp_path / "one.png", Selection(), max_tensors=1)
    monkeypatch.undo()
    assert result.tensors == ("side (Linear)",)
    assert result.left_out == ("head (Linear)",)
    drawn = history.filter(pl.col("layer") == "side", pl.col("metric").is_in(DEFAULT_METRICS))
    with_values = [f for f in frames if "value" in f.columns]
    assert [f.height for f in with_values] == [drawn.height]
    assert set(with_values[0]["layer"]) == {"side"}
    # a range's rows at most: fewer than CHUNK_ROWS before its last sample's
    assert max(f.height for f in frames if "value" not in f.columns) < 2 * per_sample
    # and the picture is the one drawn from every row
    every = plot_rows(run, Selection(), "sample_id").filter(pl.col("metric").is_in(DEFAULT_METRICS))
    _, whole = trend_figure(every, read_facts(run), "sample_id", 1)
    assert (whole.panels, whole.tensors, whole.left_out) == (
        result.panels,
        result.tensors,
        result.left_out,
    )


@pytest.mark.parametrize("samples_per_range", [1, 2, 6])
def test_plot_catalog_is_every_name_the_selection_holds_whether_samples_differ_or_not(
    run: Path, monkeypatch: pytest.MonkeyPatch, samples_per_range: int
) -> None:
    """Where a range's samples hold the same names, only its first sample's are hashed (its
    outputs here); where they differ (side's gradient rows stop after two samples), every
    row's: the catalog is the selection's distinct names either way."""
    from torchinstruments.cli import chunked

    history = pl.read_parquet(run / "history.parquet")
    per_sample = int(history.group_by("sample_id").len()["len"].min())  # type: ignore[arg-type]
    monkeypatch.setattr(chunked, "CHUNK_ROWS", per_sample * samples_per_range)
    names = ["layer", "call_index", "signal", "tensor_path", "mode", "module_type", "metric"]
    for selection in (Selection(), Selection(signals=("output",)), Selection(layers="^si")):
        chosen = history.filter(
            pl.col("signal").is_in(list(selection.signals)),
            pl.col("layer").str.contains(selection.layers or ""),
        )
        catalog, xs = plot_catalog(run, selection, "forward_index")
        assert catalog.sort(names).equals(chosen.select(names).unique().sort(names))
        assert sorted(xs.to_list()) == sorted(chosen["forward_index"].unique().to_list())


def test_plot_over_step_draws_each_attempt_of_a_resumed_job_as_its_own_stretch(
    tmp_path: Path,
) -> None:
    """A job trains steps 0-3, is restarted from a checkpoint of step 2 and trains steps 2-4
    again (resume=True): over `step`, each attempt's samples are drawn in their order with a
    gap where the step goes back, never one line alternating between the attempts at steps 2
    and 3 (which would draw a trend neither attempt had)."""
    directory = tmp_path / "job"
    torch.manual_seed(0)
    for steps in (range(4), range(2, 5)):
        model = nn.Linear(3, 2)
        inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1), resume=True)
        for step in steps:
            set_step(model, step)
            model(torch.randn(4, 3)).sum().backward()
        remove_observer(model)
    history = pl.read_parquet(directory / "history.parquet").filter(
        pl.col("metric") == "mean", pl.col("signal") == "output"
    )
    rows = plot_rows(directory, Selection(metrics=("mean",)), "step")
    figure, _ = trend_figure(rows, read_facts(directory), "step", 8)
    (line,) = figure.axes[0].get_lines()
    xs = [float(x) for x in line.get_xdata()]
    ys = [float(y) for y in line.get_ydata()]
    gap = next(i for i, y in enumerate(ys) if math.isnan(y))
    assert xs[:gap] == [0, 1, 2, 3]
    assert xs[gap + 1 :] == [2, 3, 4]
    expected = history.sort("sample_id")["value"].to_list()
    assert ys[:gap] + ys[gap + 1 :] == expected
