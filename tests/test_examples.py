"""The examples and the documented code run, and show what they claim in the files they write.

Why: the examples are the first code a newcomer runs, and the README's claims about faults rest
on examples/find_problems.py. Each script runs as a user runs it (a subprocess with this
interpreter, a temporary output directory). Assertions read the artifacts (history.parquet, PNG
files, TensorBoard event files), never the printed text, so a script that prints the right words
over wrong data fails.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import cast

import matplotlib.image
import polars as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    EventAccumulator,
)
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.__main__ import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HEALTHY = range(4)  # sample_ids 0-3 are healthy in every find_problems run
FAST_SAMPLES = 8  # find_problems.py --fast: 8 samples, the fault on from sample 4


def run_script(*args: str | Path, timeout: float = 240) -> None:
    """Run an example with this interpreter; on failure, show the end of its output."""
    result = subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # one torch thread, as in-process tests
    )
    assert result.returncode == 0, (
        f"{args[0]} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```python fenced blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


def quick_start_block() -> str:
    """The first ```python block after the README's "Quick start" heading."""
    readme = (ROOT / "README.md").read_text("utf-8")
    heading = re.search(r"^#+\s*Quick start\b.*$", readme, flags=re.MULTILINE | re.IGNORECASE)
    assert heading is not None, "README.md has no 'Quick start' heading"
    blocks = python_blocks(readme[heading.end() :])
    assert blocks, "README.md has no ```python block after 'Quick start'"
    return blocks[0]


# -- find_problems.py -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faults_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `find_problems.py --fast` run, shared by the fault tests."""
    output = tmp_path_factory.mktemp("find_problems") / "output"
    run_script(EXAMPLES / "find_problems.py", "--fast", "--output-dir", output)
    return output


def series(
    faults_dir: Path, fault: str, variant: str, layer: str, signal: str, metric: str
) -> dict[int, float]:
    """`{sample_id: value}` of one layer's signal and metric in one run (no nulls expected)."""
    frame = pl.read_parquet(faults_dir / fault / variant / "history.parquet").filter(
        pl.col("layer") == layer, pl.col("signal") == signal, pl.col("metric") == metric
    )
    assert frame["sample_id"].is_unique().all(), "one row per sample expected"
    assert frame["value"].null_count() == 0, frame.filter(pl.col("value").is_null())
    return dict(zip(frame["sample_id"].to_list(), frame["value"].to_list(), strict=True))


def after_onset(values: dict[int, float]) -> list[float]:
    """Values of the samples taken after the fault switched on (sample_id >= 4)."""
    return [value for sample_id, value in sorted(values.items()) if sample_id >= len(HEALTHY)]


def healthy(values: dict[int, float]) -> list[float]:
    """Values of samples 0-3."""
    return [values[sample_id] for sample_id in HEALTHY]


def test_every_run_has_every_sample(faults_dir: Path) -> None:
    for fault_dir in sorted(p for p in faults_dir.iterdir() if p.is_dir()):
        for variant in ("baseline", "broken", "fixed"):
            history = pl.read_parquet(fault_dir / variant / "history.parquet")
            assert sorted(history["sample_id"].unique()) == list(range(FAST_SAMPLES))
            assert (fault_dir / variant / "result.json").is_file()


def test_broken_matches_baseline_until_the_fault(faults_dir: Path) -> None:
    """Same seed, same batches: broken and baseline rows are identical for samples 0-3."""
    for fault_dir in sorted(p for p in faults_dir.iterdir() if p.is_dir()):
        frames = [
            pl.read_parquet(fault_dir / variant / "history.parquet")
            .filter(pl.col("sample_id") < len(HEALTHY))
            .select("sample_id", "layer", "signal", "tensor_path", "metric", "value")
            .sort("sample_id", "layer", "signal", "tensor_path", "metric")
            for variant in ("baseline", "broken")
        ]
        assert frames[0].equals(frames[1]), fault_dir.name


def test_dying_relu_zero_fraction_rises_only_in_broken(faults_dir: Path) -> None:
    runs = {
        v: series(faults_dir, "dying_relu", v, "act1", "output", "zero_fraction")
        for v in ("baseline", "broken", "fixed")
    }
    broken = runs["broken"]
    assert max(healthy(broken)) < 0.6
    assert min(after_onset(broken)) > 0.9
    for variant in ("baseline", "fixed"):
        assert max(runs[variant].values()) < 0.6, variant


def test_sigmoid_saturation_pins_quartiles_only_in_broken(faults_dir: Path) -> None:
    def quartiles(variant: str) -> tuple[dict[int, float], dict[int, float]]:
        return (
            series(faults_dir, "sigmoid_saturation", variant, "act1", "output", "p25"),
            series(faults_dir, "sigmoid_saturation", variant, "act1", "output", "p75"),
        )

    p25, p75 = quartiles("broken")
    assert all(0.2 < v < 0.8 for v in healthy(p25) + healthy(p75))
    assert all(v < 0.01 for v in after_onset(p25))
    assert all(v > 0.99 for v in after_onset(p75))
    for variant in ("baseline", "fixed"):
        p25, p75 = quartiles(variant)
        assert all(v > 0.2 for v in p25.values()), variant
        assert all(v < 0.8 for v in p75.values()), variant


def test_growing_scale_std_grows_only_in_broken(faults_dir: Path) -> None:
    runs = {
        v: series(faults_dir, "growing_scale", v, "fc1", "output", "std")
        for v in ("baseline", "broken", "fixed")
    }
    last = FAST_SAMPLES - 1
    broken = runs["broken"]
    assert broken[last] > 3 * broken[3]
    assert broken[last] > 3 * runs["baseline"][last]
    for variant in ("baseline", "fixed"):
        assert runs[variant][last] < 2 * runs[variant][3], variant


def test_invalid_arithmetic_nonfinite_only_in_broken(faults_dir: Path) -> None:
    broken = series(
        faults_dir, "invalid_arithmetic", "broken", "prep", "output", "nonfinite_fraction"
    )
    assert healthy(broken) == [0.0] * len(HEALTHY)
    assert all(v > 0 for v in after_onset(broken))
    for variant in ("baseline", "fixed"):
        history = pl.read_parquet(faults_dir / "invalid_arithmetic" / variant / "history.parquet")
        nonfinite = history.filter(pl.col("metric") == "nonfinite_fraction")["value"]
        assert nonfinite.null_count() == 0, variant
        assert nonfinite.max() == 0.0, variant


def test_detached_branch_loses_its_gradient_rows_only_in_broken(faults_dir: Path) -> None:
    def gradient_samples(variant: str, layer: str) -> list[int]:
        history = pl.read_parquet(faults_dir / "detached_branch" / variant / "history.parquet")
        rows = history.filter(pl.col("layer") == layer, pl.col("signal") == "output_gradient")
        return sorted(rows["sample_id"].unique())

    every_sample = list(range(FAST_SAMPLES))
    for layer in ("side", "side_act"):
        assert gradient_samples("broken", layer) == list(HEALTHY), layer
        assert gradient_samples("baseline", layer) == every_sample, layer
        assert gradient_samples("fixed", layer) == every_sample, layer
    assert gradient_samples("broken", "trunk") == every_sample  # the rest still trains


def test_each_fault_has_a_comparison_plot(faults_dir: Path) -> None:
    fault_dirs = sorted(p for p in faults_dir.iterdir() if p.is_dir())
    assert len(fault_dirs) == 5
    for fault_dir in fault_dirs:
        png = fault_dir / f"{fault_dir.name}.png"
        assert png.read_bytes()[:8] == PNG_SIGNATURE, png
        assert png.stat().st_size > 10_000, png
        height, width, _ = matplotlib.image.imread(png).shape
        assert height > 200, png
        assert width > 300, png


def test_detached_branch_plot_shows_the_missing_values_outside_the_legend(
    faults_dir: Path,
) -> None:
    script = runpy.run_path(str(EXAMPLES / "find_problems.py"))  # not __main__: nothing runs
    figure = script["fault_figure"](
        script["FAULTS"]["detached_branch"],
        faults_dir / "detached_branch",
        script["Schedule"](period=10, samples=FAST_SAMPLES),
    )
    figure.canvas.draw()
    (axes,) = figure.axes
    assert axes.get_legend() is None  # the legend is the figure's, outside the axes
    (legend,) = figure.legends
    legend_box = legend.get_window_extent()
    assert not legend_box.overlaps(axes.get_window_extent())
    # the broken run's missing gradient rows are marked at each missing sample, in its colour
    marks = [line for line in axes.get_lines() if line.get_marker() == "x"]
    assert [list(line.get_xdata()) for line in marks] == [list(range(4, FAST_SAMPLES))]
    labels = {text.get_text(): text for text in axes.texts}
    assert "broken: no value (x)" in labels
    fault_label = next(t for t in labels.values() if t.get_text().startswith(" fault on"))
    assert not fault_label.get_window_extent().overlaps(legend_box)


# -- lightning_mnist.py -----------------------------------------------------------------------


def test_lightning_example_writes_logger_histograms_and_run_directory(tmp_path: Path) -> None:
    run_script(EXAMPLES / "lightning_mnist.py", "--fast", "--output-dir", tmp_path)

    events = EventAccumulator(
        str(tmp_path / "lightning_logs" / "version_0"), size_guidance={HISTOGRAMS: 0}
    ).Reload()
    tags = cast(dict[str, list[str]], events.Tags())
    assert "train_loss" in tags["scalars"]  # Lightning's own logging still works
    assert "net.0/call_0/output/tensor" in tags["histograms"]
    assert "net.0/call_0/output_gradient/tensor" in tags["histograms"]
    stats = tmp_path / "lightning_logs" / "version_0" / "torchinstruments"
    for name in ("history.parquet", "result.json", "index.md"):
        assert (stats / name).is_file(), name
    history = pl.read_parquet(stats / "history.parquet")
    assert sorted(history["sample_id"].unique()) == list(range(8))
    assert set(history["signal"].unique()) == {"output", "output_gradient"}

    # --fast: 40 steps, one sample in 5. Histograms sit on the trainer's global_step (the step
    # at which the sampled forward ran: its forward_index, as the example has no validation),
    # the same axis as Lightning's scalars.
    sampled_steps = sorted(history["forward_index"].unique())
    assert sampled_steps == list(range(0, 40, 5))
    for tag in ("net.0/call_0/output/tensor", "net.0/call_0/output_gradient/tensor"):
        assert [event.step for event in events.Histograms(tag)] == sampled_steps, tag
    loss_steps = [event.step for event in events.Scalars("train_loss")]
    assert loss_steps
    assert max(loss_steps) < 40


# -- README quick start and basic_training.py -------------------------------------------------


def test_basic_training_is_the_readme_quick_start() -> None:
    source = (EXAMPLES / "basic_training.py").read_text("utf-8")
    assert quick_start_block().strip() in source


@pytest.mark.usefixtures("one_thread")
def test_basic_training_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """basic_training.py contains the README's quick start (checked above), so this runs both."""
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLES / "basic_training.py"), run_name="__main__")
    (run_dir,) = (tmp_path / "stats").iterdir()
    history = pl.read_parquet(run_dir / "history.parquet")
    assert sorted(history["sample_id"].unique()) == list(range(6))  # 300 steps, one in 50


# The user's guide: README.md and the pages it sends readers to for the details.
GUIDES = ("README.md", "docs/command-line.md")


def guides() -> str:
    """The text of every guide page, one after the other."""
    return "\n".join((ROOT / name).read_text("utf-8") for name in GUIDES)


def readme_python_blocks() -> list[str]:
    """Every ```python block of the README (indented ones, inside lists, too), dedented."""
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", guides(), flags=re.MULTILINE | re.DOTALL)
    return [
        textwrap.dedent("\n".join(line[len(indent) :] for line in body.splitlines()))
        for indent, body in blocks
    ]


def test_every_readme_python_block_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = readme_python_blocks()
    assert len(blocks) >= 2
    for number, block in enumerate(blocks):
        workdir = tmp_path / f"block-{number}"
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        exec(compile(block, f"README.md:block-{number}", "exec"), {"__name__": "__main__"})
    assert blocks[0].strip() == quick_start_block().strip()
    (run_dir,) = (tmp_path / "block-0" / "stats").iterdir()
    quick_start = pl.read_parquet(run_dir / "history.parquet")
    assert sorted(quick_start["sample_id"].unique()) == list(range(6))  # 300 steps, one in 50
    (reducers,) = [n for n, block in enumerate(blocks) if '"stats/reducers"' in block]
    history = pl.read_parquet(
        tmp_path / f"block-{reducers}" / "stats" / "reducers" / "history.parquet"
    )
    output = history.filter(pl.col("signal") == "output", pl.col("layer") == "0")
    for metric in ("abs_max", "l2_norm", "peak_to_peak", "numel"):
        assert output.filter(pl.col("metric") == metric)["value"].null_count() == 0, metric
    assert output.filter(pl.col("metric") == "numel")["value"].to_list() == [32.0]


README_PREFIX = "$ uv run torchinstruments "  # run as typed in the checkout's environment


def readme_command_lines() -> list[tuple[str, list[str]]]:
    """(command, printed lines) of each `$ uv run torchinstruments ...` in the README's console
    blocks (the part after `torchinstruments`)."""
    found = []
    for block in re.findall(r"^```console\n(.*?)^```", guides(), flags=re.MULTILINE | re.DOTALL):
        lines = block.splitlines()
        assert lines[0].startswith(README_PREFIX), lines[0]
        found.append((lines[0][len(README_PREFIX) :], lines[1:]))
    return found


def machine_independent(lines: list[str]) -> list[str]:
    """The output with its one machine-dependent part, the `model:` line (torch version, start
    time; wrapped onto indented lines), replaced, as the README says."""
    kept, in_model_line = [], False
    for line in lines:
        if line.startswith("model: "):
            kept.append("model: <versions and start time of the machine>")
            in_model_line = True
        elif not (in_model_line and line.startswith("  ")):
            kept.append(line)
            in_model_line = False
    return kept


def test_readme_command_lines_print_what_the_readme_shows(
    faults_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's outputs are those of `find_problems.py --fast` with one thread, which is
    `faults_dir`: every printed line is compared, all but the `model:` line as they are."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")  # a terminal's width would change the text layout
    output = tmp_path / "find_problems_output"  # the runs linked in; the PNGs land beside them
    output.mkdir()
    for fault_dir in faults_dir.iterdir():
        (output / fault_dir.name).symlink_to(fault_dir)
    commands = readme_command_lines()
    assert [c.split()[0] for c, _ in commands] == ["show", "compare", "plot", "heatmap"]
    for command, shown in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(shlex.split(command)) == 0, command
        printed = out.getvalue().splitlines()
        if command.startswith(("show", "compare")):  # tables; plot and heatmap print one line
            assert max(len(line) for line in printed) <= 80, command
        assert machine_independent(printed) == machine_independent(shown), command
    for command, _ in commands:  # pictures go beside the example's runs, never over the repo's
        words = shlex.split(command)
        if "-o" in words:
            target = Path(words[words.index("-o") + 1])
            assert target.parts[0] == "find_problems_output", command
            assert not (ROOT / target).exists(), command
    for image in ("plot.png", "heatmap-zero_fraction.png"):
        written = matplotlib.image.imread(output / image).shape
        assert matplotlib.image.imread(ROOT / "docs" / image).shape == written, image


def test_readme_commands_run_as_typed_with_only_uv_on_path(
    faults_dir: Path, tmp_path: Path
) -> None:
    """Each README command line, pasted into a fresh `bash -c` whose PATH holds only uv (no
    activated environment, no `torchinstruments` script): `uv run` finds the checkout's
    environment (`UV_PROJECT`, as a shell in the checkout would) and the command succeeds."""
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (the README's commands are its `uv run` form)")
    output = tmp_path / "find_problems_output"
    output.mkdir()
    for fault_dir in faults_dir.iterdir():
        (output / fault_dir.name).symlink_to(fault_dir)
    env = {
        "PATH": str(Path(uv).parent),
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "UV_PROJECT": str(ROOT),
        "UV_NO_SYNC": "1",  # the environment as it is; nothing installed by the test
        "OMP_NUM_THREADS": "1",
    }
    assert (
        subprocess.run(
            ["/bin/bash", "-c", "torchinstruments --help"],
            env=env,
            check=False,
            capture_output=True,
        ).returncode
        == 127
    )  # not on this PATH
    for command, _ in readme_command_lines():
        typed = README_PREFIX.removeprefix("$ ") + command
        result = subprocess.run(
            ["/bin/bash", "-c", typed],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert result.returncode == 0, (typed, result.stderr[-2000:])


# -- docs/research-workflows.md ---------------------------------------------------------------


def make_rank_directories(tmp_path: Path) -> None:
    """`stats/rank-000/` and `stats/rank-001/`, as `rank_policy="all"` would leave them."""
    for rank in range(2):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        inject_observer(
            model,
            output_dir=tmp_path / "stats" / f"rank-{rank:03d}",
            sampler=EveryNForwardsSampler(2),
        )
        for _ in range(6):
            model(torch.randn(4, 8)).sum().backward()
        remove_observer(model)


@pytest.mark.usefixtures("one_thread")
def test_research_workflow_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the page says: in order, from an empty directory; rank directories only for section 4."""
    monkeypatch.chdir(tmp_path)
    assert not any(tmp_path.iterdir())
    blocks = python_blocks((ROOT / "docs" / "research-workflows.md").read_text("utf-8"))
    assert len(blocks) >= 6
    namespace: dict[str, object] = {"__name__": "__main__"}
    for number, block in enumerate(blocks):
        if "rank-*" in block:
            make_rank_directories(tmp_path)
        exec(compile(block, f"research-workflows.md:block-{number}", "exec"), namespace)

    trend = namespace["trend"]
    assert isinstance(trend, pl.DataFrame)
    assert trend.height == 2 * 10
    paired = namespace["paired"]
    assert isinstance(paired, pl.DataFrame)
    assert paired["difference"].null_count() == 0
    probes = namespace["probes"]
    assert isinstance(probes, pl.DataFrame)
    assert set(probes["mode"]) == {"eval"}
    assert set(probes["grad_enabled"]) == {False}
    by_rank = namespace["by_rank"]
    assert isinstance(by_rank, pl.DataFrame)
    assert by_rank["file"].n_unique() == 2
    pooled = namespace["pooled"]
    assert isinstance(pooled, pl.DataFrame)
    assert pooled["pooled_std"][0] >= pooled["mean_of_stds"][0] * 0.999  # total variance

    # the command lines the page shows run on the directories its blocks wrote
    text = (ROOT / "docs" / "research-workflows.md").read_text("utf-8")
    commands = re.findall(r"`torchinstruments ((?:show|compare|plot) [^`]+)`", text)
    assert len(commands) >= 2
    for command in commands:
        assert cli_main(shlex.split(command)) == 0, command
