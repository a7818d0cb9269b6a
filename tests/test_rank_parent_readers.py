"""Reading a directory of rank runs as one run, where ranks differ: a rank with eval samples,
steps, another sampler, no history yet, no value for a series, or none at all. Every rank is
written by a real observer (the launcher's RANK and WORLD_SIZE, as torchrun sets them), and
what the readers print is checked against each rank's own history.parquet."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments.__main__ import main

from conftest import cli_in_process


def observe_rank(
    parent: Path,
    rank: int,
    world_size: int = 2,
    *,
    forwards: int = 3,
    every: int = 1,
    eval_forwards: bool = False,
    steps: bool = False,
    selector: Callable[[str, nn.Module], bool] | None = None,
    last_batch: int = 5,
    remove: bool = True,
) -> nn.Module:
    """Rank `rank` of `world_size` observes a small MLP for `forwards` training steps (each
    followed by an eval forward with `eval_forwards`; with `steps`, step 10 * i via set_step),
    the last one on a batch of `last_batch` (0: empty outputs, null values)."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer, set_step

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", str(rank))
        env.setenv("WORLD_SIZE", str(world_size))
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        options: dict[str, Any] = {"selector": selector} if selector is not None else {}
        inject_observer(
            model,
            output_dir=parent,
            sampler=EveryNForwardsSampler(every),
            rank_policy="all",
            **options,
        )
    for i in range(forwards):
        if steps:
            set_step(model, 10 * i)
        batch = last_batch if i == forwards - 1 else 5
        model(torch.randn(batch, 4) * (rank + 1)).sum().backward()
        if eval_forwards:
            model.eval()
            with torch.no_grad():
                model(torch.randn(5, 4) * 10)
            model.train()
    if remove:
        remove_observer(model)
    return model


SERIES = ["layer", "call_index", "signal", "tensor_path", "mode", "metric"]


def history(parent: Path, rank: int) -> pl.DataFrame:
    return pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet")


def test_compare_of_one_parent_and_one_rank_is_a_usage_error_naming_what_to_pass(
    tmp_path: Path,
) -> None:
    for rank in (0, 1):
        observe_rank(tmp_path, rank)
    done = cli_in_process("compare", tmp_path, "--rank", "0")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    message = " ".join(done.stderr.split())
    assert "compare needs two" in message
    assert "two runs" in message
    assert "without --rank" in message
    assert "--rank N (rank N of each)" in message
    assert cli_in_process("compare", tmp_path, "--rank", "0,1").returncode == 0


def test_heatmap_of_the_parent_over_step_has_a_column_per_sample_labelled_by_its_step(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    from conftest import read_heatmap

    parent = tmp_path / "stats"
    for rank in (0, 1):
        observe_rank(parent, rank, forwards=4, steps=True)
    done = cli_in_process("heatmap", parent, "--x", "step", "--metrics", "mean", "-o", tmp_path)
    assert done.returncode == 0, done.stderr
    _, description = read_heatmap(tmp_path / "heatmap-ranks-mean.png")
    steps = history(parent, 0).select("sample_id", "step").unique().sort("sample_id")
    assert description["columns"] == steps["step"].to_list() == [0, 10, 20, 30]
    assert [row[0] for row in description["rows"]] == ["rank 000: 0", "rank 001: 0"]


def test_plot_and_heatmap_of_the_parent_over_step_refuse_ranks_without_steps(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    parent = tmp_path / "stats"
    for rank in (0, 1):
        observe_rank(parent, rank)
    assert history(parent, 0)["step"].is_null().all()
    single = cli_in_process("plot", parent / "rank-000", "--x", "step", "-o", tmp_path / "one.png")
    for command, output in (("plot", tmp_path / "p.png"), ("heatmap", tmp_path)):
        done = cli_in_process(command, parent, "--x", "step", "--metrics", "mean", "-o", output)
        assert done.returncode == 1 == single.returncode
        assert done.stderr.startswith(f"torchinstruments {command}: no sample of {parent} ")
        assert done.stderr.split(parent.name, 1)[1] == single.stderr.split("rank-000", 1)[1]
    assert not (tmp_path / "p.png").exists()
    assert not list(tmp_path.glob("heatmap-*.png"))


def test_the_far_rank_of_two_ranks_is_the_lower_one_whatever_the_rounding(tmp_path: Path) -> None:
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    # Two ranks are always equally far from their median; in float64, `value - median` rounds
    # these two distances apart (4.0220483740170785 and 4.02204837401708).
    values = (-23.468405922253925, -15.424309174219767)
    for rank, value in enumerate(values):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANK", str(rank))
            env.setenv("WORLD_SIZE", "2")
            model = nn.Sequential(nn.Identity())
            inject_observer(
                model, output_dir=tmp_path, sampler=EveryNForwardsSampler(1), rank_policy="all"
            )
        model(torch.tensor([[value]], dtype=torch.float64, requires_grad=True)).sum().backward()
        remove_observer(model)
    done = cli_in_process("show", tmp_path, "--format", "csv", "--signal", "output")
    assert done.returncode == 0, done.stderr
    rows = pl.read_csv(io.StringIO(done.stdout), comment_prefix="#").filter(
        pl.col("metric") == "mean"
    )
    assert rows["min"].to_list() == [values[0]] * 2
    assert rows["max"].to_list() == [values[1]] * 2
    assert rows["farthest_rank"].to_list() == [0, 0]
    assert rows["farthest_by"].to_list() == [values[0] - rows["median"][0]] * 2


def test_plot_and_heatmap_of_the_parent_count_ranks_as_ranks_and_keep_each_ranks_modes_together(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    from conftest import read_heatmap

    parent = tmp_path / "stats"
    for rank in (0, 1):
        observe_rank(parent, rank, eval_forwards=True)
    for rank in (0, 1):
        assert set(history(parent, rank)["mode"]) == {"train", "eval"}
    done = cli_in_process("heatmap", parent, "--metrics", "mean", "-o", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "mean of tensor 0, 2 ranks (2 train rows, 2 eval rows) x 6 samples" in done.stdout
    _, description = read_heatmap(tmp_path / "heatmap-ranks-mean.png")
    assert len(description["rows"]) == 4
    done = cli_in_process("plot", parent, "--metrics", "mean", "-o", tmp_path / "all.png")
    assert done.returncode == 0, done.stderr
    assert "tensor 0, 2 ranks (2 train lines, 2 eval lines)" in done.stdout
    assert done.stderr == ""
    done = cli_in_process(
        "plot", parent, "--metrics", "mean", "--max-tensors", "1", "-o", tmp_path / "one.png"
    )
    assert done.returncode == 0, done.stderr
    assert "tensor 0, 1 rank (1 train line, 1 eval line)" in done.stdout
    assert "1 rank left out (rank 1;" in done.stderr
    drawn = json.loads(Image.open(tmp_path / "one.png").text["Description"])["tensors"]  # type: ignore[attr-defined]
    assert drawn == ["rank 000: 0 (Linear)", "rank 000: 0 [eval] (Linear)"]


def test_heatmap_of_the_parent_subtitle_says_its_rows_are_one_tensors_ranks_not_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks of one tensor (train and eval rows each) are four rows of one tensor: the
    subtitle says tensor x ranks, never "4 tensors down in traversal order"."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from conftest import read_heatmap

    texts: list[str] = []
    figure_text = Figure.text

    def recording(self: Figure, x: float, y: float, s: str, *args: Any, **kwargs: Any) -> Any:
        texts.append(s)
        return figure_text(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(Figure, "text", recording)
    parent = tmp_path / "stats"
    for rank in (0, 1):
        observe_rank(parent, rank, eval_forwards=True)
    done = cli_in_process("heatmap", parent, "--metrics", "mean", "-o", tmp_path)
    assert done.returncode == 0, done.stderr
    _, description = read_heatmap(tmp_path / "heatmap-ranks-mean.png")
    assert [row[0] for row in description["rows"]] == [
        "rank 000: 0",
        "rank 000: 0",
        "rank 001: 0",
        "rank 001: 0",
    ]
    (title,) = texts
    lines = title.split("\n")
    assert lines[1] == (
        "tensor 0 x 2 ranks (2 train rows, 2 eval rows) down, in rank order "
        "(labelled: every row (module type))"
    )
    assert "traversal order" not in title
    assert "4 tensors" not in title
    texts.clear()
    done = cli_in_process("heatmap", parent / "rank-000", "--metrics", "mean", "-o", tmp_path)
    assert done.returncode == 0, done.stderr
    (title,) = texts
    assert (
        title.split("\n")[1]
        == (
            "6 tensors down in traversal order (labelled: every tensor (module type))"  # 3 layers x 2 modes
        )
    )


def test_plot_of_the_parent_draws_the_metrics_plot_of_one_run_draws_and_names_the_others(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    parent = tmp_path / "stats"
    for rank in (0, 1):
        observe_rank(parent, rank)
    one = cli_in_process("plot", parent / "rank-000", "-o", tmp_path / "one.png")
    both = cli_in_process("plot", parent, "-o", tmp_path / "both.png")
    assert one.returncode == both.returncode == 0, (one.stderr, both.stderr)
    metrics = set(history(parent, 0).filter(pl.col("metric") != "interrupted")["metric"])
    drawn = {"mean", "std", "zero_fraction", "nonfinite_fraction"}
    signals = set(history(parent, 0)["signal"])
    for done in (one, both):
        assert f"{len(drawn) * len(signals)} panels" in done.stdout
        said = next(line for line in done.stderr.splitlines() if "not drawn" in line)
        left_out = said.split("not drawn without --metrics: ", 1)[1].split(" (")[0]
        assert set(left_out.split(", ")) == metrics - drawn
    every = cli_in_process(
        "plot", parent, "--metrics", ",".join(sorted(metrics)), "-o", tmp_path / "all.png"
    )
    assert every.returncode == 0, every.stderr
    assert f"{len(metrics) * len(signals)} panels" in every.stdout
    assert "not drawn" not in every.stderr


def expected_matched(parent: Path) -> dict[tuple[Any, ...], int]:
    """Per series: the samples where rank 0's and rank 1's rows agree on what they hold (a
    value each, or a null each for the same reason), from the two histories."""
    a, b = (history(parent, r).filter(pl.col("metric") != "interrupted") for r in (0, 1))
    both = a.join(b, on=[*SERIES, "sample_id"], suffix="_b", nulls_equal=True)
    counts: dict[tuple[Any, ...], int] = {key: 0 for key in a.select(SERIES).unique().iter_rows()}
    for row in both.iter_rows(named=True):
        values = row["value"] is not None and row["value_b"] is not None
        nulls = row["value"] is None and row["value_b"] is None
        if values or (nulls and row["unavailable_reason"] == row["unavailable_reason_b"]):
            counts[tuple(row[k] for k in SERIES)] += 1
    return counts


@pytest.mark.parametrize("rank_1_last_batch", [0, 5], ids=["null-in-both", "null-in-one"])
def test_compare_of_two_ranks_and_compare_of_their_parent_count_matched_samples_alike(
    tmp_path: Path, rank_1_last_batch: int
) -> None:
    parent = tmp_path / "stats"
    observe_rank(parent, 0, last_batch=0)  # the last sample's outputs are empty: null values
    observe_rank(parent, 1, last_batch=rank_1_last_batch)
    expected = expected_matched(parent)
    assert set(expected.values()) == ({3} if rank_1_last_batch == 0 else {2})
    pair = cli_in_process("compare", parent / "rank-000", parent / "rank-001", "--format", "json")
    ranks = cli_in_process("compare", parent, "--format", "json")
    for done in (pair, ranks):
        assert done.returncode == 0, done.stderr
        got = {
            tuple(r[k] for k in SERIES): r["matched_samples"]
            for r in json.loads(done.stdout)["rows"]
        }
        assert got == expected
    for done in (
        cli_in_process("compare", parent / "rank-000", parent / "rank-001", "--width", "400"),
        cli_in_process("compare", parent, "--width", "400"),
    ):
        assert "or a null for the same reason" in done.stdout


def test_plot_and_heatmap_of_the_parent_write_the_default_files_their_help_names(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    parent = tmp_path / "stats"
    for rank in (0, 1):
        observe_rank(parent, rank)
    for command, written in (("plot", "trends-ranks.png"), ("heatmap", "heatmap-ranks-mean.png")):
        done = cli_in_process(command, parent, "--metrics", "mean")
        assert done.returncode == 0, done.stderr
        assert (parent / written).is_file()
        help_text = io.StringIO()
        with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
            main([command, "--help"])
        assert written.replace("mean", "<metric>") in "".join(help_text.getvalue().split())


def test_a_parent_is_read_with_the_ranks_that_have_history_and_says_which_have_none(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    from torchinstruments import remove_observer

    parent = tmp_path / "stats"
    observe_rank(parent, 0)
    waiting = observe_rank(parent, 1, forwards=0, remove=False)  # no sample written yet
    try:
        assert not (parent / "rank-001" / "history.parquet").exists()
        said = "rank 1: no sample written yet (in progress: a live process holds its lock)"
        done = cli_in_process("show", parent, "--width", "200")
        assert done.returncode == 0, done.stderr
        assert f"not read, no history: {said}" in done.stdout
        assert "ranks: " + str(parent) + " (1 rank: 0)" in done.stdout
        done = cli_in_process("show", parent, "--format", "json")
        assert done.returncode == 0, done.stderr
        assert done.stderr == f"torchinstruments show: not read, no history: {said}\n"
        facts = json.loads(done.stdout)
        assert facts["run"]["ranks"] == [0]
        assert facts["run"]["ranks_without_history"] == {"1": said.split(": ", 1)[1]}
        rows = pl.DataFrame(facts["rows"]).filter(pl.col("at") == "latest")
        own = history(parent, 0).sort("sample_id").group_by(SERIES, maintain_order=True).last()
        assert rows.height == own.height
        joined = rows.join(own, on=SERIES)
        assert (joined["min"] == joined["value"]).all()
        done = cli_in_process("compare", parent, "--width", "200")
        assert done.returncode == 0, done.stderr
        assert f"not read, no history: {said}" in done.stdout
        for command, output in (("plot", tmp_path / "p.png"), ("heatmap", tmp_path)):
            done = cli_in_process(command, parent, "--metrics", "mean", "-o", output)
            assert done.returncode == 0, done.stderr
            assert done.stderr == f"torchinstruments {command}: not read, no history: {said}\n"
            assert "1 rank (1 train" in done.stdout
    finally:
        remove_observer(waiting)


def test_a_parent_where_no_rank_has_history_is_refused_naming_each_rank(tmp_path: Path) -> None:
    from torchinstruments import remove_observer

    models = [observe_rank(tmp_path, rank, forwards=0, remove=False) for rank in (0, 1)]
    try:
        for command in ("show", "compare"):
            done = cli_in_process(command, tmp_path)
            assert done.returncode == 1
            assert "no rank has any history yet (rank 0-1: no sample written yet" in done.stderr
    finally:
        for model in models:
            remove_observer(model)


def test_show_parent_says_how_many_ranks_each_spread_covers_and_which_ranks_lack_values(
    tmp_path: Path,
) -> None:
    observe_rank(tmp_path, 0, world_size=4)
    observe_rank(tmp_path, 1, world_size=4, selector=lambda name, module: name == "2")
    observe_rank(tmp_path, 2, world_size=4, last_batch=0)  # its latest values are null
    # rank 3 never attached: no directory
    null = history(tmp_path, 2).filter(pl.col("signal") == "output", pl.col("metric") == "mean")
    reason = null.sort("sample_id")["unavailable_reason"][-1]
    assert reason
    options = ("--signal", "output", "--metrics", "mean")
    done = cli_in_process("show", tmp_path, *options, "--format", "csv")
    assert done.returncode == 0, done.stderr
    rows = pl.read_csv(io.StringIO(done.stdout), schema_overrides={"layer": pl.String})
    latest = {r["layer"]: r for r in rows.filter(pl.col("at") == "latest").iter_rows(named=True)}
    counts = {
        layer: (r["ranks"], r["ranks_not_finite"], r["ranks_without_row"])
        for layer, r in latest.items()
    }
    assert counts == {"0": (1, 1, 1), "1": (1, 1, 1), "2": (2, 1, 0)}
    done = cli_in_process("show", tmp_path, *options, "--width", "200")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "rank 1: no row in 2 of the 3 series read" in lines
    assert f"rank 2: latest value null in 3 series ({reason})" in lines
    assert any(line.startswith("missing: no directory for rank 3 ") for line in lines)
    header = lines[lines.index("mean:") + 1].split()
    assert header[:4] == ["layer", "sig", "at", "ranks"]
    table = [line.split() for line in lines[lines.index("mean:") + 3 :] if line.strip()]
    cells = {(row[0], row[2]): row[3] for row in table if row[1] == "out"}
    assert cells[("0", "latest")] == "1/3"
    assert cells[("2", "latest")] == "2/3"


def test_every_reader_of_a_parent_says_which_rank_has_no_directory(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    parent = tmp_path / "stats"
    for rank in (0, 2):  # rank 1 of 3 never attached: no directory
        observe_rank(parent, rank, world_size=3)
    said = "missing: no directory for rank 1 "
    for command, *options in (("show",), ("compare",)):
        done = cli_in_process(command, parent, *options, "--metrics", "mean", "--width", "400")
        assert done.returncode == 0, done.stderr
        assert any(line.startswith(said) for line in done.stdout.splitlines()), command
        done = cli_in_process(command, parent, "--metrics", "mean", "--format", "json")
        assert json.loads(done.stdout)["run"]["ranks_missing"] == [1], command
    for command, output in (("plot", tmp_path / "p.png"), ("heatmap", tmp_path)):
        done = cli_in_process(command, parent, "--metrics", "mean", "-o", output)
        assert done.returncode == 0, done.stderr
        assert f"torchinstruments {command}: {said}" in done.stderr, command
    done = cli_in_process("compare", parent, "--rank", "0,2", "--metrics", "mean")
    assert said not in done.stdout  # the ranks asked for are all there
    done = cli_in_process("finalize", parent)
    assert done.returncode == 0, done.stderr
    assert any(line.startswith(said) for line in done.stdout.splitlines())


def test_compare_parent_warns_first_when_the_ranks_were_sampled_differently(
    tmp_path: Path,
) -> None:
    observe_rank(tmp_path, 0, forwards=6, every=2)
    observe_rank(tmp_path, 1, forwards=6, every=3)
    for rank, every in ((0, 2), (1, 3)):  # sample k is forward k * every on each rank
        samples = history(tmp_path, rank).select("sample_id", "forward_index").unique()
        assert (samples["forward_index"] == samples["sample_id"] * every).all()
    options = ("--metrics", "mean", "--width", "400")
    pair = cli_in_process("compare", tmp_path / "rank-000", tmp_path / "rank-001", *options)
    done = cli_in_process("compare", tmp_path, *options)
    assert done.returncode == 0 == pair.returncode, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("warning: the ranks were sampled differently (rank 0: Every")
    # The two-run compare's rule and words, ranks for runs.
    expected = pair.stdout.splitlines()[0]
    assert expected.startswith("warning: the runs were sampled differently (A: ")
    assert first == (
        expected.replace("the runs", "the ranks")
        .replace("(A: ", "(rank 0: ")
        .replace("; B: ", "; rank 1: ")
    )
    done = cli_in_process("compare", tmp_path, "--metrics", "mean", "--format", "json")
    assert json.loads(done.stdout)["run"]["warnings"] == [first]
    done = cli_in_process("compare", tmp_path, *options, "--x", "forward_index")
    assert "(--x forward_index" not in done.stdout.splitlines()[0]


def observe_on_a_clock(parent: Path, rank: int, sampled: set[int], forwards: int = 6) -> None:
    """Rank `rank` of 2 with the default clock-based sampler, its clock run so that it samples
    the root forwards in `sampled` (each rank's own clock: same sampler, other forwards)."""
    from torchinstruments import TimeIntervalSampler, inject_observer, remove_observer

    # 10 s pass right before each sampled forward but the first, none before the others
    times = iter([10.0 * sum(1 for j in sampled if 0 < j <= i) for i in range(forwards)])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", str(rank))
        env.setenv("WORLD_SIZE", "2")
        model = nn.Sequential(nn.Linear(4, 2))
        sampler = TimeIntervalSampler(5.0, clock=lambda: next(times))
        inject_observer(model, output_dir=parent, sampler=sampler, rank_policy="all")
    for _ in range(forwards):
        model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)


def test_compare_parent_warns_when_one_sampler_took_different_root_forwards_on_the_ranks(
    tmp_path: Path,
) -> None:
    """The same sampler on every rank (the default clock-based one) can still take different
    root forwards: matched on sample_id, compare then compares different steps, and says so
    first, naming the first such sample and each rank's forward_index there."""
    observe_on_a_clock(tmp_path, 0, {0, 2, 4})
    observe_on_a_clock(tmp_path, 1, {0, 3, 5})
    for rank, forwards in ((0, [0, 2, 4]), (1, [0, 3, 5])):
        samples = history(tmp_path, rank).select("sample_id", "forward_index").unique()
        assert samples.sort("sample_id")["forward_index"].to_list() == forwards
    done = cli_in_process("compare", tmp_path, "--metrics", "mean", "--width", "400")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        "warning: the ranks sampled different root forwards: sample_id 1 is rank 0: "
        "forward_index 2, step none; rank 1: forward_index 3, step none; from there on the "
        "same sample_id may be a different step in each (--x forward_index matches them by "
        "root forward)."
    )
    done = cli_in_process("compare", tmp_path, "--metrics", "mean", "--x", "forward_index")
    assert not done.stdout.startswith("warning")


def test_compare_parent_warns_when_a_rank_ran_a_forward_the_others_did_not(
    tmp_path: Path,
) -> None:
    """EveryNForwardsSampler on both ranks, rank 1 with an evaluation batch after each step:
    sample 2 is step 20 on rank 0 and step 10 on rank 1, which compare says first."""
    observe_rank(tmp_path, 0, steps=True)
    observe_rank(tmp_path, 1, steps=True, eval_forwards=True)
    done = cli_in_process("compare", tmp_path, "--metrics", "mean", "--width", "400")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        "warning: the ranks sampled different root forwards: sample_id 1 is rank 0: "
        "forward_index 1, step 10, a training forward (a module in train mode, or grad enabled); "
        "rank 1: forward_index 1, step 0, an evaluation forward (eval mode, grad disabled); "
        "from there on the same sample_id may be a different step in each."
    )


def test_compare_parent_does_not_warn_when_only_one_rank_has_steps(tmp_path: Path) -> None:
    """set_step on rank 0 alone (a loop that logs there): the ranks' samples are the same root
    forwards, so no warning."""
    observe_rank(tmp_path, 0, steps=True)
    observe_rank(tmp_path, 1)
    done = cli_in_process("compare", tmp_path, "--metrics", "mean", "--width", "400")
    assert done.returncode == 0, done.stderr
    assert not done.stdout.startswith("warning")


def test_compare_parent_text_of_many_series_prints_the_earliest_to_depart_and_says_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond the text's limit (10 here, 60 by default) the table holds the series whose first
    departure comes earliest (ties in traversal order, none last) and a line says how many
    series it left out, in how many layers, how many of them depart, and `--all`."""
    from torchinstruments.cli import ranks

    for rank in (0, 1):
        observe_rank(tmp_path, rank)
    monkeypatch.setattr(ranks, "TEXT_SERIES", 10)
    done = cli_in_process("compare", tmp_path, "--format", "csv")
    every = pl.read_csv(io.StringIO(done.stdout)).with_row_index("traversal")
    earliest = every.sort(pl.col("first_departure").is_null(), "first_departure", "traversal")
    short = {"output": "out", "output_gradient": "grad"}
    names: list[tuple[str, ...]] = [
        (str(r["layer"]), short[r["signal"]], r["metric"]) for r in earliest.iter_rows(named=True)
    ]
    assert earliest["first_departure"].is_null().any()  # some series never depart
    assert earliest["traversal"].to_list()[:10] != list(range(10))  # not traversal order

    def rows(text: str) -> list[tuple[str, ...]]:
        lines = text.splitlines()
        start = next(i for i, li in enumerate(lines) if li.split()[:2] == ["layer", "signal"]) + 2
        return [tuple(li.split()[:3]) for li in lines[start:] if len(li.split()) == 7]

    done = cli_in_process("compare", tmp_path, "--width", "200")
    assert done.returncode == 0, done.stderr
    assert rows(done.stdout) == names[:10]
    rest = earliest.slice(10)
    departing = rest["first_departure"].is_not_null().sum()
    assert (
        f"{rest.height} more series not shown, in {rest['layer'].n_unique()} layers "
        f"({departing} of them with a departure): --all prints every series"
    ) in " ".join(done.stdout.split())
    done = cli_in_process("compare", tmp_path, "--width", "200", "--all")
    assert len(rows(done.stdout)) == every.height
    assert "more series not shown" not in done.stdout


@pytest.mark.parametrize("x", ["sample_id", "forward_index"])
def test_compare_parent_is_the_same_read_in_ranges_of_one_row_or_at_once_and_cuts_them_from_x_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, x: str
) -> None:
    """Each range's per-series result is folded into the last as it comes: every series'
    first departure, its ranks and values there, and its matched samples are the same whether
    the ranks are read in ranges of one sample or all at once. The ranges are cut from each
    rank's rows per x, every row counted (its x column only, not the selection's names)."""
    from torchinstruments.cli import ranks
    from torchinstruments.cli.selection import Selection

    parent = tmp_path / "stats"
    for rank in (0, 1, 2):
        observe_rank(parent, rank, world_size=3, forwards=4, eval_forwards=rank == 1)
    cut_from: list[list[pl.DataFrame]] = []
    x_ranges = ranks.x_ranges

    def recording(counts: list[pl.DataFrame], *args: Any) -> list[tuple[int, int]]:
        cut_from.append(counts)
        return x_ranges(counts, *args)

    monkeypatch.setattr(ranks, "x_ranges", recording)
    selection = Selection(layers="^2$", metrics=("mean", "max"))
    one = ranks.departures(parent, selection, x=x, budget_rows=1).frame
    whole = ranks.departures(parent, selection, x=x, budget_rows=10**9).frame
    # layer 2: output and gradient x mean and max, and rank 1's eval output x mean and max
    assert one.height == whole.height == 6
    assert one.to_dicts() == whole.to_dicts()
    assert one["first_departure"].null_count() < one.height
    for counts in cut_from:
        for rank, per_x in enumerate(counts):
            assert per_x.columns == [x, "rows"]
            own = history(parent, rank).group_by(x).agg(rows=pl.len()).sort(x)
            assert per_x.cast(own.schema).to_dicts() == own.to_dicts()
