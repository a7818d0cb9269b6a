"""The command line's edges: a selection that matches nothing is refused, listing what the run
holds; counts agree with index.md; plurals and metric names print whole; `plot` keeps lines
that share values visible and offers log and symlog axes."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

import torchinstruments.cli as command_line
from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.__main__ import main
from torchinstruments.cli import CLOSED_PIPE

METRICS = "max, mean, min, nonfinite_fraction, p25, p50, p75, std, zero_fraction"


def cli(*args: str | Path) -> tuple[int, str, str]:
    """`torchinstruments ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def make_run(directory: Path, steps: int, every: int, backward: bool = True, window: int = 10):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(every),
        history_config=HistoryConfig(window=window),
    )
    for _ in range(steps):
        out = model(torch.randn(3, 4))
        if backward:
            out.sum().backward()
    remove_observer(model)
    return directory


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 root forwards, one sampled in 50 (the Quick start's schedule)."""
    return make_run(tmp_path_factory.mktemp("cli-edges") / "run", 300, 50)


@pytest.mark.parametrize("command", ["show", "plot", "heatmap"])
def test_an_unknown_metric_exits_non_zero_listing_the_metrics(run: Path, command: str) -> None:
    code, out, err = cli(command, run, "--metrics", "zero_frac,mean")
    assert (code, out) == (1, "")
    assert err == (
        f"torchinstruments {command}: --metrics: 'zero_frac' is not a metric of this run; its "
        f"metrics: {METRICS}\n"
    )


@pytest.mark.parametrize("command", ["show", "compare", "plot", "heatmap"])
@pytest.mark.parametrize("given", ["", " , "])
def test_metrics_that_name_no_metric_exit_non_zero_listing_the_metrics(
    run: Path, command: str, given: str
) -> None:
    """`--metrics "$METRICS"` with the variable unset is a mistake, not a selection of nothing."""
    runs = (run, run) if command == "compare" else (run,)
    code, out, err = cli(command, *runs, "--metrics", given)
    assert (code, out) == (1, "")
    these = "these runs" if command == "compare" else "this run"
    assert err == (
        f"torchinstruments {command}: --metrics names no metric (it is empty): name one or "
        f"more, comma-separated; the metrics of {these}: {METRICS}\n"
    )


def test_a_layer_pattern_that_matches_nothing_exits_non_zero_listing_the_layers(
    run: Path,
) -> None:
    code, out, err = cli("show", run, "--layers", "zzz", "--metrics", "bogus")
    assert (code, out) == (1, "")
    assert err == (
        "torchinstruments show: --layers 'zzz' matches no layer with rows in this run; its "
        "layers with rows: '0', '1', '2' (a selected layer that never ran in a sampled forward "
        "has none: index.md's Layers section lists every one); --metrics: 'bogus' is not a "
        f"metric of this run; its metrics: {METRICS}\n"
    )


class WithUnused(nn.Module):
    """`used` runs in every forward; `unused` is selected and never called."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_layer_that_never_ran_is_not_said_to_be_no_layer_of_the_run(tmp_path: Path) -> None:
    """A selected layer without rows is still a layer of the run (index.md and result.json list
    it): the refusal names the layers with rows, and says why one may have none."""
    model = WithUnused()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 4))
    with pytest.warns(RuntimeWarning, match="never ran"):
        remove_observer(model)
    code, _, err = cli("show", tmp_path / "run", "--layers", "^unused$")
    assert code == 1
    assert "matches no layer of this run" not in err
    assert "matches no layer with rows in this run; its layers with rows: 'used'" in err


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("^(?!0).*2$", "look-around, including look-ahead and look-behind, is not supported"),
        ("(1)\\1", "backreferences are not supported"),
    ],
)
@pytest.mark.parametrize("command", ["show", "compare", "plot", "heatmap"])
def test_a_layer_pattern_that_polars_cannot_run_is_a_usage_error(
    run: Path, command: str, pattern: str, why: str
) -> None:
    """Python's `re` takes these patterns; Polars' regex, which filters the layers, does not:
    a usage error (exit 2) that says so, never a traceback."""
    directories = [run, run] if command == "compare" else [run]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main([command, *map(str, directories), "--layers", pattern])
    assert exited.value.code == 2
    last = err.getvalue().splitlines()[-1]
    assert last == (
        f"torchinstruments {command}: error: argument --layers: not a valid regular expression "
        f"for Polars, which runs it ({why}; Polars' regex has no look-around such as (?!...) or "
        "(?<=...) and no back-references such as \\1)"
    )


def test_compare_names_both_runs_and_a_missing_signal_is_refused(run: Path, tmp_path: Path) -> None:
    forward_only = make_run(tmp_path / "forward-only", 4, 1, backward=False)
    code, _, err = cli("compare", run, forward_only, "--metrics", "p99")
    assert code == 1
    assert "--metrics: 'p99' is not a metric of these runs; their metrics: max," in err
    code, _, err = cli("show", forward_only, "--signal", "output_gradient")
    assert (code, err) == (
        1,
        "torchinstruments show: --signal output_gradient: this run recorded only output\n",
    )


def test_finalize_counts_agree_with_index_md_and_read_as_english(run: Path, tmp_path: Path) -> None:
    code, out, _ = cli("finalize", run)
    assert code == 0
    assert "; 300 root forwards, 6 samples, 6 with output gradients\n" in out
    assert "at least" not in out
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "300 root forwards" in index
    one = make_run(tmp_path / "one", 1, 1)
    code, out, _ = cli("finalize", one)
    assert "; 1 root forward, 1 sample, 1 with output gradients\n" in out


def test_compare_prints_metric_names_whole_and_plurals_right_at_80_columns(
    run: Path, tmp_path: Path
) -> None:
    other = make_run(tmp_path / "a-run-with-a-much-longer-name-here", 300, 50, window=1)
    code, out, _ = cli(
        "compare", other, run, "--metrics", "nonfinite_fraction,zero_fraction", "--width", "80"
    )
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert sum("nonfinite_fraction" in line for line in lines) == 6  # 3 layers x 2 signals
    assert "..._fraction" not in out
    text = " ".join(lines)
    assert "forward_indexs" not in text
    assert "sample_ids measured" not in text
    assert "matched: samples (matched on sample_id) at which both runs have a row" in text
    code, out, _ = cli("compare", other, other, "--window", "1", "--metrics", "mean")
    assert "recent window of up to 1 sample." in " ".join(out.splitlines())


def describe(png: Path) -> dict:
    with Image.open(png) as image:
        return json.loads(image.info["Description"])


def test_plot_gives_every_line_its_own_marker_and_style(run: Path, tmp_path: Path) -> None:
    code, out, _ = cli("plot", run, "--metrics", "zero_fraction", "-o", tmp_path / "p.png")
    assert code == 0
    assert out.endswith(": 2 panels, 3 tensors, x = sample_id\n")
    styles = [tuple(s) for s in describe(tmp_path / "p.png")["styles"]]
    assert len(styles) == 3
    assert len({marker for marker, _ in styles}) == 3
    assert len({style for _, style in styles}) == 3


def test_plot_log_and_symlog_axes(run: Path, tmp_path: Path) -> None:
    code, _, _ = cli(
        "plot", run, "--metrics", "zero_fraction,nonfinite_fraction", "--signal", "output",
        "--yscale", "log", "-o", tmp_path / "log.png",
    )  # fmt: skip
    assert code == 0
    # zero_fraction is 0 for the Linear layers, nonfinite_fraction 0 everywhere: log cannot show
    # zeros, so those panels are symlog (and their titles say so)
    assert describe(tmp_path / "log.png")["yscales"] == ["symlog", "symlog"]
    code, _, _ = cli("plot", run, "--metrics", "std", "--yscale", "log", "-o", tmp_path / "std.png")
    # the head's output gradient (of out.sum()) is all ones: std 0 there, so that panel is symlog
    assert describe(tmp_path / "std.png")["yscales"] == ["log", "symlog"]
    code, _, _ = cli(
        "plot", run, "--metrics", "mean", "--yscale", "symlog", "-o", tmp_path / "mean.png"
    )
    assert describe(tmp_path / "mean.png")["yscales"] == ["symlog", "symlog"]


def test_plot_chooses_a_panel_scale_from_the_lines_it_draws(run: Path, tmp_path: Path) -> None:
    """The head's output gradient (of out.sum()) has std 0: drawn, the log panel falls back to
    symlog; left out by --max-tensors, it does not choose the scale of lines it is not in."""
    common = ("--metrics", "std", "--signal", "output_gradient", "--yscale", "log")
    for most, scale in ((2, "log"), (3, "symlog")):
        png = tmp_path / f"{most}.png"
        code, _, _ = cli("plot", run, *common, "--max-tensors", str(most), "-o", png)
        assert code == 0
        assert (len(describe(png)["tensors"]), describe(png)["yscales"]) == (most, [scale])


@pytest.mark.parametrize("command", ["show", "compare"])
def test_a_reader_that_closes_the_pipe_first_stops_the_command_without_a_traceback(
    run: Path, command: str
) -> None:
    """`show DIR | head`: the pipe's reader is gone before the command writes (closed here before
    the child has imported Polars); the command stops with the shell's SIGPIPE status, and says
    nothing on stderr."""
    args = [run] if command == "show" else [run, run]
    child = subprocess.Popen(
        [sys.executable, "-m", "torchinstruments", command, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None
    assert child.stderr is not None
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == CLOSED_PIPE
    assert err == ""


def test_ctrl_c_stops_a_command_with_one_line_and_the_shells_status(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in a long heatmap (or show, finalize) printed a KeyboardInterrupt traceback: one
    line on stderr instead, exit 130 (128 + SIGINT), as a shell reports it."""

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(command_line, "run_command", interrupted)
    assert main(["heatmap", str(run)]) == 130
    assert capsys.readouterr().err == "torchinstruments heatmap: interrupted\n"
