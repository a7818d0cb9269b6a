"""`torchinstruments heatmap`: the PNG's cells are the history's values, nulls and gaps.

The images are read back with PIL (`conftest.check_heatmap`): where a cell lies is computed from
the panel box the PNG's metadata states (left, top, cell size), after checking that the rows and
columns are the ones the test expects (traversal order, sample_ids); each cell's centre pixel must
have the colour computed from history.parquet with Polars and matplotlib's colour map (min..max of
the panel's finite values), without the heatmap code: a measured value in viridis, a null in the
null colour, no row in the absent colour. test_cli runs it on a live, crashed and finalized run.

The faulty run: `act`'s input bias is pushed to -1e3 from sample FAULT_AT on, so `act` (a ReLU)
outputs only zeros (zero_fraction exactly 1, the top of the scale); `side`'s output is used by
the loss only before FAULT_AT (a branch detached later: its gradient series stops); `empty`
returns no elements (null values with a reason).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from _state_decodes import count_state_decodes
from matplotlib import colormaps
from matplotlib.colors import LogNorm
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.cli.pictures_grid import (
    ABSENT_COLOUR,
    LABEL_ROWS,
    NULL_COLOUR,
    Grid,
    ordinal,
    row_ticks,
)

from conftest import check_heatmap, heatmap_cell, read_heatmap, sgd_step
from conftest import cli_in_process as cli

STEPS = 9
FAULT_AT = 5
LAYERS = ["fc", "act", "side", "empty"]
TOP = tuple(int(v) for v in colormaps["viridis"](1.0, bytes=True)[:3])


class Empty(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:0]


class Faulty(nn.Module):
    """`act` dies at FAULT_AT (zero_fraction 1); `side`'s gradient stops there; `empty` is null."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 16)
        self.act = nn.ReLU()
        self.side = nn.Linear(6, 1)
        self.empty = Empty()
        self.head = nn.Linear(16, 1)
        self.detached = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        self.empty(h)
        side = self.side(x)
        if self.detached:
            side = side.detach()
        return self.head(h) + side


def faulty_run(directory: Path) -> Path:
    torch.manual_seed(3)
    model = Faulty()
    x = torch.randn(32, 6)
    y = x.sum(dim=1, keepdim=True)
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        selector=lambda name, module: name in LAYERS,
        history_config=HistoryConfig(window=3),
    )
    for step in range(STEPS):
        if step == FAULT_AT:
            with torch.no_grad():
                model.fc.bias.fill_(-1e3)
            model.detached = True
        sgd_step(model, x, y, 0.01)
    remove_observer(model)
    return directory


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return faulty_run(tmp_path_factory.mktemp("faulty") / "stats")


def test_a_dead_layer_is_the_top_colour_from_its_sample_and_nulls_are_grey(
    faulty: Path, tmp_path: Path
) -> None:
    result = cli("heatmap", faulty, "--metrics", "zero_fraction", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    png = tmp_path / "heatmap-zero_fraction.png"
    assert f"wrote {png}" in result.stdout
    history = pl.read_parquet(faulty / "history.parquet")
    tensors = [(name, 0, "") for name in LAYERS]
    pixels, meta = check_heatmap(png, history, "zero_fraction", tensors, "sample_id")
    assert meta["columns"] == list(range(STEPS))
    output, gradient = meta["panels"]
    assert (output["signal"], gradient["signal"]) == ("output", "output_gradient")
    act, side, empty = LAYERS.index("act"), LAYERS.index("side"), LAYERS.index("empty")
    for column in range(STEPS):
        dead = tuple(pixels[heatmap_cell(output, act, column)])
        assert (dead == TOP) == (column >= FAULT_AT), column  # zero_fraction is 1 exactly there
        assert tuple(pixels[heatmap_cell(output, empty, column)]) == NULL_COLOUR
        assert tuple(pixels[heatmap_cell(gradient, empty, column)]) == ABSENT_COLOUR  # no gradient
        stopped = tuple(pixels[heatmap_cell(gradient, side, column)]) == ABSENT_COLOUR
        assert stopped == (column >= FAULT_AT), column  # the detached branch's series stops


def test_drawing_commands_decode_the_run_state_once(
    faulty: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`heatmap` and `plot` say the run's state and read its facts from one decode of it."""
    decoded = count_state_decodes(monkeypatch)
    for args in (("heatmap", "--metrics", "std", "-o", tmp_path),
                 ("plot", "--metrics", "std", "-o", tmp_path / "p.png")):  # fmt: skip
        decoded.clear()
        result = cli(args[0], faulty, *args[1:])
        assert result.returncode == 0, result.stderr
        assert decoded == [faulty], args[0]


def test_layers_regex_forward_index_and_scales(faulty: Path, tmp_path: Path) -> None:
    history = pl.read_parquet(faulty / "history.parquet").filter(pl.col("layer").is_in(["fc"]))
    result = cli("heatmap", faulty, "--layers", "^fc$", "--metrics", "std,max", "--x",
                 "forward_index", "-o", tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    for metric in ("std", "max"):
        check_heatmap(tmp_path / f"heatmap-{metric}.png", history, metric, [("fc", 0, "")],
                    "forward_index")  # fmt: skip
    # log10 when every value is positive: fc's output std, cell by cell
    result = cli("heatmap", faulty, "--layers", "^fc$", "--metrics", "std", "--scale", "log",
                 "-o", tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    pixels, meta = read_heatmap(tmp_path / "heatmap-std.png")
    output = meta["panels"][0]
    assert output["scale"] == "log10"
    stds = history.filter(pl.col("metric") == "std", pl.col("signal") == "output")
    stds = stds.sort("sample_id")["value"].to_numpy()
    norm = LogNorm(stds.min(), stds.max())
    for column, value in enumerate(stds):
        want = colormaps["viridis"](norm(value), bytes=True)[:3]
        assert tuple(pixels[heatmap_cell(output, 0, column)]) == pytest.approx(tuple(want), abs=1)
    # zeros (dead act's std) make it symmetric log; robust clips; nulls stay null at any scale
    for scale, name in (("log", "symlog"), ("robust", "robust")):
        result = cli("heatmap", faulty, "--metrics", "std", "--scale", scale, "-o", tmp_path)
        assert result.returncode == 0, result.stderr
        pixels, meta = read_heatmap(tmp_path / "heatmap-std.png")
        output = meta["panels"][0]
        assert output["scale"].startswith(name)
        if scale == "robust":
            assert output["scale"] == "robust: 2nd to 98th percentile"  # it said "2th"
        empty = LAYERS.index("empty")
        assert {tuple(pixels[heatmap_cell(output, empty, c)]) for c in range(STEPS)} == {
            NULL_COLOUR
        }
    refused = cli("heatmap", faulty, "--metrics", "std,nope", "-o", tmp_path)
    assert refused.returncode == 1
    assert "nope" in refused.stderr
    assert "its metrics: max, mean" in refused.stderr


def _grid(names: list[str]) -> Grid:
    n = len(names)
    return Grid(
        metric="mean",
        x="sample_id",
        signals=("output",),
        tensors=tuple((name, 0, "", "train") for name in names),
        module_types=("Linear",) * n,
        columns=(0,),
        values=np.zeros((1, n, 1)),
        cells=np.ones((1, n, 1), dtype=np.uint8),
    )


def test_row_labels_every_tensor_then_blocks() -> None:
    names = [f"blocks.{b}.{s}" for b in range(20) for s in ("attn", "mlp", "norm")]
    ticks, labels, _ = row_ticks(_grid(names))
    assert len(names) == LABEL_ROWS
    assert labels == [f"{name} (Linear)" for name in names]
    assert ticks == [i + 0.5 for i in range(LABEL_ROWS)]

    names = [f"model.layers.{b}.{s}.{p}" for b in range(32) for s in ("attn", "mlp")
             for p in ("0", "1")]  # fmt: skip
    ticks, labels, _ = row_ticks(_grid(names))
    assert labels == [f"model.layers.{b}" for b in range(32)]
    assert ticks == [4.0 * b for b in range(32)]

    names = [f"{b}.{s}" for b in range(1000) for s in range(3)]  # a flat Sequential of blocks
    ticks, labels, what = row_ticks(_grid(names))
    assert labels == [str(b) for b in range(0, 1000, 17)]
    assert ticks == [3.0 * b for b in range(0, 1000, 17)]
    assert "every 17th block" in what

    names = [str(b) for b in range(100)]  # a flat Sequential of 100 layers: every 2nd
    ticks, labels, what = row_ticks(_grid(names))
    assert labels == [str(b) for b in range(0, 100, 2)]
    assert what == "the first row of every 2nd block"
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st",
        "111th", "112th",
    ]  # fmt: skip


def test_heatmap_without_matplotlib_says_how_to_install(faulty: Path, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "from torchinstruments.__main__ import main\n"
        "sys.exit(main(['heatmap', sys.argv[1], '-o', sys.argv[2]]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(faulty), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 3
    assert "pip install matplotlib" in result.stderr
    assert "torchinstruments[plot]" not in result.stderr  # the index's is another project
    assert list(tmp_path.iterdir()) == []


def test_a_nonfinite_value_is_magenta_and_never_a_scale_end(tmp_path: Path) -> None:
    """Histories the library writes hold no NaN or Inf; one written by other tools may."""
    from torchinstruments.cli.pictures_grid import NONFINITE_COLOUR
    from torchinstruments.rundir.layout import HISTORY_SCHEMA

    values = [0.0, float("inf"), 1.0, float("nan")]
    frame = pl.DataFrame(
        {
            "sample_id": [0, 1, 2, 3],
            "forward_index": [0, 1, 2, 3],
            "layer": ["fc"] * 4,
            "module_type": ["Linear"] * 4,
            "call_index": [0] * 4,
            "signal": ["output"] * 4,
            "tensor_path": [""] * 4,
            "metric": ["mean"] * 4,
            "value": values,
        }
    )
    run = tmp_path / "foreign"
    run.mkdir()
    others = [
        pl.lit(None, dtype).alias(name)
        for name, dtype in HISTORY_SCHEMA.items()
        if name not in frame.columns
    ]
    history = frame.with_columns(others).select(list(HISTORY_SCHEMA)).cast(HISTORY_SCHEMA)
    history.write_parquet(run / "history.parquet")
    result = cli("heatmap", run, "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    pixels, meta = read_heatmap(tmp_path / "heatmap-mean.png")
    (panel,) = meta["panels"]
    assert (panel["vmin"], panel["vmax"]) == (0.0, 1.0)  # the finite values only
    got = [tuple(pixels[heatmap_cell(panel, 0, c)]) for c in range(4)]
    assert got[1] == got[3] == NONFINITE_COLOUR
    assert got[2] == TOP


def test_metrics_whose_names_clean_alike_get_files_of_their_own(tmp_path: Path) -> None:
    """`p/q` and `p_q` both clean to `heatmap-p_q.png`: each metric has its own file, and the
    line that says so names the metric and its file."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    reducers = {"p/q": lambda t: t.abs().max(), "p_q": lambda t: -t.abs().max()}
    run = tmp_path / "run"
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1), reducers=[reducers])
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    out = tmp_path / "images"
    out.mkdir()
    done = cli("heatmap", run, "--metrics", "p/q,p_q", "-o", out)
    assert done.returncode == 0, done.stderr
    wrote = {
        line.split(": ")[1].split(",")[0]: line.split()[1] for line in done.stdout.splitlines()
    }
    assert wrote == {"p/q": str(out / "heatmap-p_q-2.png"), "p_q": str(out / "heatmap-p_q.png")}
    assert sorted(p.name for p in out.iterdir()) == ["heatmap-p_q-2.png", "heatmap-p_q.png"]
    for metric, path in wrote.items():
        _, description = read_heatmap(Path(path))
        assert description["metric"] == metric
