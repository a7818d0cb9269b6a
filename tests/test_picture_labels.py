"""Names in `plot` and `heatmap` pictures are drawn as written: matplotlib reads text between
two `$` as a formula (mathtext), so a layer (a `nn.ModuleDict` key), tensor path, custom metric
or run directory holding `$` must still draw literally, and never make the command fail.

The reference for "drawn literally" is matplotlib itself: the same string drawn with math
parsing turned off has the same rendered size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.cli.pictures import trend_figure
from torchinstruments.cli.plot import plot_rows
from torchinstruments.cli.reader import read_facts
from torchinstruments.cli.selection import Selection

from conftest import cli_in_process as cli
from conftest import read_heatmap

pytest.importorskip("matplotlib")

# A formula matplotlib cannot parse (`\frac{`), one it can (`$5$`), an odd `$`, a backslash.
NAMES = ("$\\frac{$", "cost$5$", "x$y", "a\\$b")


class Dollars(nn.Module):
    """One Linear per name in NAMES, chained."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.ModuleDict({name: nn.Linear(3, 3) for name in NAMES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.d.values():
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("labels") / "run $x$"
    torch.manual_seed(0)
    model = Dollars()
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    return directory


def test_plot_and_heatmap_of_layers_named_with_dollars_succeed(run: Path, tmp_path: Path) -> None:
    png = tmp_path / "trends.png"
    result = cli("plot", run, "--metrics", "mean", "-o", png)
    assert result.returncode == 0, result.stderr
    with Image.open(png) as image:
        tensors = json.loads(image.info["Description"])["tensors"]
    assert tensors == [f"d.{name} (Linear)" for name in NAMES]
    result = cli("heatmap", run, "--metrics", "mean", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    _, description = read_heatmap(tmp_path / "heatmap-mean.png")
    assert [row[0] for row in description["rows"]] == [f"d.{name}" for name in NAMES]


def test_plot_legend_and_titles_draw_names_literally(run: Path) -> None:
    from matplotlib.text import Text

    rows = plot_rows(run, Selection(metrics=("mean",)), "sample_id")
    figure, result = trend_figure(rows, read_facts(run), "sample_id", 10)
    renderer = figure.canvas.get_renderer()
    figure.canvas.draw()
    legend = figure.legends[0].get_texts()
    assert [t.get_text().replace("\\$", "$") for t in legend] == list(result.legend)
    title = figure.get_suptitle().replace("\\$", "$")
    assert title == f"{run.parent.name}/{run.name}: {len(NAMES)} tensors"
    for text, written in zip(legend, result.legend, strict=True):
        plain = Text(text=written, fontproperties=text.get_fontproperties(), parse_math=False)
        plain.set_figure(figure)
        assert text.get_window_extent(renderer).width == pytest.approx(
            plain.get_window_extent(renderer).width
        ), written
