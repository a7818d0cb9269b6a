"""`compare` says every difference a reader would want: a series that stops or starts in one run
(from which sample), layers in one run only, runs sampled differently; index.md's comparison
query prints every differing series.

Runs are real (a small model trained in this process); the expected samples come from the
training schedule written here, the rows from Polars on the files.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from _state_decodes import count_state_decodes
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.__main__ import main
from torchinstruments.cli import compare, differences

STEPS = 8
CUT_FROM = 3  # from this step on, the branch of the cut run is detached


class Branches(nn.Module):
    def __init__(self, cut_from: int | None, extra: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.side = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.extra = nn.Tanh() if extra else None
        self.cut_from = cut_from
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.side(x)
        if self.cut_from is not None and self.step >= self.cut_from:
            side = side.detach()  # the fault: the branch no longer receives a gradient
        self.step += 1
        hidden = self.trunk(x) + side
        if self.extra is not None:
            hidden = self.extra(hidden)
        return self.head(hidden)


def train(directory: Path, *, cut_from: int | None = None, every: int = 1, **kw: Any) -> Path:
    torch.manual_seed(0)
    model = Branches(cut_from, **kw)
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(every))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
    remove_observer(model)
    return directory


def cli(*args: str | Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([str(a) for a in args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    return {
        "baseline": train(root / "baseline"),
        "cut": train(root / "cut", cut_from=CUT_FROM),
        "every2": train(root / "every2", every=2),
        "extra": train(root / "extra", extra=True),
    }


def test_a_series_that_stops_in_one_run_is_a_difference_from_the_sample_it_stops(
    runs: dict[str, Path],
) -> None:
    code, out = cli("compare", runs["baseline"], runs["cut"], "--format", "json")
    assert code == 0
    rows = json.loads(out)["rows"]
    side_grad = [r for r in rows if r["layer"] == "side" and r["signal"] == "output_gradient"]
    assert side_grad
    for row in side_grad:
        assert row["first_difference"] == CUT_FROM, row["metric"]  # not "no difference"
        assert row["matched_samples"] == CUT_FROM
        assert (row["first_a"], row["last_a"], row["samples_a"]) == (0, STEPS - 1, STEPS)
        assert (row["first_b"], row["last_b"], row["samples_b"]) == (0, CUT_FROM - 1, CUT_FROM)
    # the same, from the files: B's side gradient rows end where the fault begins
    cut = pl.read_parquet(runs["cut"] / "history.parquet")
    grads = cut.filter(pl.col("layer") == "side", pl.col("signal") == "output_gradient")
    assert grads["sample_id"].max() == CUT_FROM - 1

    code, text = cli("compare", runs["baseline"], runs["cut"], "--metrics", "std")
    assert code == 0
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "series that stop or start in one run (1 tensor" in text
    assert (
        f"  side grad: sample_id 0-{STEPS - 1} in A, 0-{CUT_FROM - 1} in B "
        f"(B stops after {CUT_FROM - 1})" in text.splitlines()
    )
    line = next(li for li in text.splitlines() if re.match(r"side\s+grad\s+std", li))
    assert line.split()[-2:] == [str(CUT_FROM), str(CUT_FROM)]  # first diff, matched


def test_compare_decodes_each_run_state_once(
    runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command says each run's state, checks the selection and reads each run's facts, and
    still decodes each state file once (a 3,000-layer run's takes about 70 ms)."""
    decoded = count_state_decodes(monkeypatch)
    for fmt in ("text", "csv"):  # csv says the states on stderr too
        decoded.clear()
        code, _ = cli("compare", runs["baseline"], runs["cut"], "--format", fmt)
        assert code == 0
        assert sorted(decoded) == sorted([runs["baseline"], runs["cut"]]), fmt


def test_a_series_first_difference_is_the_same_whatever_selects_it(
    runs: dict[str, Path],
) -> None:
    """The samples both runs have are each run's own, not those of the selected rows: the side
    gradient, selected alone, still differs from the sample its rows stop at in B."""
    whole = "compare", runs["baseline"], runs["cut"], "--format", "json"
    alone = (*whole, "--layers", "^side$", "--signal", "output_gradient", "--metrics", "mean")
    firsts = []
    for args in (whole, alone):
        code, out = cli(*args)
        assert code == 0
        rows = json.loads(out)["rows"]
        (row,) = [
            r
            for r in rows
            if (r["layer"], r["signal"], r["metric"]) == ("side", "output_gradient", "mean")
        ]
        firsts.append((row["first_difference"], row["matched_samples"]))
    assert firsts == [(CUT_FROM, CUT_FROM), (CUT_FROM, CUT_FROM)]


def test_a_series_that_starts_late_in_one_run_says_so(runs: dict[str, Path]) -> None:
    code, text = cli("compare", runs["cut"], runs["baseline"], "--metrics", "std")
    assert code == 0
    assert f"(A stops after {CUT_FROM - 1})" in text


def test_layers_in_one_run_only_are_absent_not_nonfinite(runs: dict[str, Path]) -> None:
    code, text = cli("compare", runs["baseline"], runs["extra"], "--metrics", "mean")
    assert code == 0
    extra_rows = [li for li in text.splitlines() if li.startswith("extra ")]
    assert len(extra_rows) == 2  # output and gradient
    assert all(li.split()[3] == "absent" for li in extra_rows)  # mean A
    assert "only in B (1 layer, no row in the other run): extra." in text
    assert "no finite value" not in text


def test_runs_sampled_differently_warn_first(runs: dict[str, Path]) -> None:
    code, text = cli("compare", runs["baseline"], runs["every2"], "--metrics", "mean")
    assert code == 0
    first = text.splitlines()[0]
    assert first.startswith("warning: the runs were sampled differently (A:")
    assert "EveryNForwardsSampler(n=1)" in text
    assert "EveryNForwardsSampler(n=2)" in text
    code, same = cli("compare", runs["baseline"], runs["cut"], "--metrics", "mean")
    assert "warning" not in same


def resumed(directory: Path, *everies: int) -> Path:
    """One run continued over attempts (`resume=True`), the k-th sampling every `everies[k]`."""
    for every in everies:
        torch.manual_seed(0)
        model = Branches(None)
        inject_observer(
            model, output_dir=directory, sampler=EveryNForwardsSampler(every), resume=True
        )
        torch.manual_seed(1)
        for _ in range(STEPS):
            model(torch.randn(3, 4)).square().sum().backward()
        remove_observer(model)
    return directory


def attempt_samplers(run: Path) -> list[str]:
    state = json.loads((run / ".state.json").read_text(encoding="utf-8"))
    return [a["sampler"] for a in state["attempts"]]


def compare_warnings(a: Path, b: Path) -> list[str]:
    code, out = cli("compare", a, b, "--metrics", "mean", "--format", "json")
    assert code == 0
    return json.loads(out)["run"]["warnings"]


def test_a_run_restarted_with_another_sampler_was_sampled_differently_whatever_its_last(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """B's last attempt samples as A does, its first did not: B's samples 0-3 are every other
    step, A's every step, and the warning names each attempt's sampler."""
    (baseline,) = attempt_samplers(runs["baseline"])
    restarted = resumed(tmp_path / "restarted", 2, 1)
    first, last = attempt_samplers(restarted)
    assert last == baseline != first
    assert compare_warnings(runs["baseline"], restarted)[0] == (
        f"warning: the runs were sampled differently (A: {baseline}; B, attempt 0: {first}; "
        f"B, attempt 1: {last}): the same sample_id may be a different step in each "
        "(--x forward_index matches them by root forward)."
    )
    # Restarted with the sampler it had: sampled as A was, no warning.
    same = resumed(tmp_path / "same", 1, 1)
    assert attempt_samplers(same) == [baseline, baseline]
    assert not [w for w in compare_warnings(runs["baseline"], same) if "sampled" in w]


def test_index_comparison_query_prints_every_differing_series(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The page's own setup and comparison blocks, with `other_run` set, list every series
    whose rows differ (here more than 50, where the page used to cut), the stopped gradients
    included."""
    page = (runs["cut"] / "index.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.MULTILINE | re.DOTALL)
    comparison = next(b for b in blocks if "other_run = run" in b)
    comparison = re.sub(
        r"^other_run = run\b.*$",
        f"other_run = Path({str(runs['baseline'])!r})",
        comparison,
        flags=re.MULTILINE,
    )
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(blocks[0], "setup", "exec"), namespace)
    capsys.readouterr()
    exec(compile(comparison, "comparison", "exec"), namespace)
    printed = capsys.readouterr().out
    first = namespace["first"]
    assert isinstance(first, pl.DataFrame)
    assert first.height > 50
    csv_rows = printed.splitlines()[2:]  # the count line, the CSV header
    assert len(csv_rows) == first.height
    side = first.filter(pl.col("layer") == "side", pl.col("signal") == "output_gradient")
    assert set(side["first_sample"]) == {CUT_FROM}
    assert first["first_sample"].is_sorted()
    # It joins the runs a range of samples at a time (memory bounded by a range, not by the
    # runs: two 3,000-layer runs of 100 samples joined whole took 2.8 GB): a range of one
    # sample each finds the same first rows as the page's ranges.
    assert "CHUNK_ROWS = 500_000" in comparison
    one_each = comparison.replace("CHUNK_ROWS = 500_000", "CHUNK_ROWS = 1")
    exec(compile(one_each, "comparison", "exec"), namespace)
    capsys.readouterr()
    common = namespace["common"].collect()["sample_id"].sort().to_list()
    assert namespace["ranges"] == [(sample, sample) for sample in common]
    assert namespace["first"].equals(first)


def table_rows(text: str) -> list[tuple[str, str, str]]:
    """(layer, signal, metric) of each row of compare's text table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["layer", "signal"])
    start += 2  # the header and its rule
    rows = []
    for line in lines[start:]:
        cells = line.split()
        if len(cells) != 8:
            break
        rows.append((cells[0], cells[1], cells[2]))
    return rows


def test_compare_text_of_many_series_prints_the_earliest_to_differ_and_says_how_many_it_left_out(
    runs: dict[str, Path],
) -> None:
    """Five layers are 90 series: the text prints the 60 whose first difference comes earliest
    (ties in traversal order, series without a difference last), then a line with how many it
    left out, in how many layers, how many of those differ, and `--all`, which prints all 90."""
    code, out = cli("compare", runs["baseline"], runs["cut"], "--format", "csv")
    assert code == 0
    every = pl.read_csv(io.StringIO(out)).with_row_index("traversal")
    assert every.height == 90 > compare.TEXT_SERIES
    earliest = every.sort(pl.col("first_difference").is_null(), "first_difference", "traversal")
    short = {"output": "out", "output_gradient": "grad"}
    expected = [
        (r["layer"], short[r["signal"]], r["metric"]) for r in earliest.iter_rows(named=True)
    ]
    assert earliest["first_difference"].null_count() > 0  # some series never differ
    assert earliest["first_difference"].n_unique() > 2  # the order is not traversal's alone

    wide = ("--width", "200")  # every layer name on its row
    code, text = cli("compare", runs["baseline"], runs["cut"], *wide)
    assert code == 0
    assert table_rows(text) == expected[: compare.TEXT_SERIES]
    left = earliest.slice(compare.TEXT_SERIES)
    differ = left["first_difference"].is_not_null().sum()
    said = " ".join(text.split())
    assert (
        f"{left.height} more series not shown, in {left['layer'].n_unique()} layers ({differ} of "
        "them differ, the others are equal at every matched sample): --all prints every series"
    ) in said

    code, text = cli("compare", runs["baseline"], runs["cut"], *wide, "--all")
    assert code == 0
    traversal = [(r["layer"], short[r["signal"]], r["metric"]) for r in every.iter_rows(named=True)]
    assert table_rows(text) == traversal
    assert "more series not shown" not in text


def occurrences_of(values: list[tuple[float | None, str | None]]) -> pl.DataFrame:
    """One series' rows at sample_id 0, 1, ... (one occurrence each): value and reason."""
    return pl.DataFrame(
        {
            "layer": ["fc"] * len(values),
            "call_index": [0] * len(values),
            "signal": ["output"] * len(values),
            "tensor_path": [""] * len(values),
            "mode": ["train"] * len(values),
            "metric": ["mean"] * len(values),
            "module_type": ["Linear"] * len(values),
            "sample_id": list(range(len(values))),
            "value": [v for v, _ in values],
            "unavailable_reason": [r for _, r in values],
            "_occurrence": [0] * len(values),
        },
        schema_overrides={"call_index": pl.Int32, "value": pl.Float64},
    )


@pytest.mark.parametrize(
    ("a", "b", "first", "matched"),
    [
        ((1.0, None), (1.0, None), None, 1),
        ((float("nan"), None), (1.0, None), 0, 1),  # NaN against a number: a difference
        ((float("nan"), None), (float("nan"), None), None, 1),
        ((float("inf"), None), (float("inf"), None), None, 1),
        ((float("inf"), None), (float("-inf"), None), 0, 1),
        ((None, "empty tensor"), (None, "empty tensor"), None, 1),
        ((None, "empty tensor"), (None, "non-finite result"), 0, 0),
        ((None, "empty tensor"), (1.0, None), 0, 0),
    ],
    ids=[
        "equal",
        "nan-number",
        "nan-nan",
        "inf-inf",
        "inf-minus-inf",
        "nulls-same-reason",
        "nulls-other-reason",
        "null-value",
    ],
)
def test_a_sample_differs_and_matches_by_what_both_rows_hold(
    a: tuple[float | None, str | None],
    b: tuple[float | None, str | None],
    first: int | None,
    matched: int,
) -> None:
    # sample 1 is equal in both runs: only sample 0 can differ
    rows = occurrences_of([a, (2.0, None)]), occurrences_of([b, (2.0, None)])
    joined = compare.first_differences(*rows, "sample_id", 0.0)
    # the same rows in the same order, as runs of one model hold them: read side by side
    side_by_side, _, _ = differences._side_by_side(*rows, "sample_id", 0.0, latest=False)
    for found in (joined, side_by_side):
        assert found["first_difference"].to_list() == [first]
        assert found["matched_samples"].to_list() == [matched + 1]


def test_compare_by_forward_index_gives_each_run_the_summary_show_gives(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Matched on forward_index, each run's means and module types are `show`'s, whether its
    forward_index goes up with its sample_id (read with the differences) or not (a hand-edited
    history whose forward_index runs backwards, and whose `head` is of another type in its
    latest sample: read by sample, its latest is that sample's, not its last forward's)."""
    history = pl.read_parquet(runs["cut"] / "history.parquet")
    backwards = tmp_path / "backwards"
    backwards.mkdir()
    renamed = (pl.col("layer") == "head") & (pl.col("sample_id") == STEPS - 1)
    history.with_columns(
        forward_index=STEPS - 1 - pl.col("forward_index"),
        module_type=pl.when(renamed).then(pl.lit("Renamed")).otherwise("module_type"),
    ).write_parquet(backwards / "history.parquet")
    key = ("layer", "call_index", "signal", "tensor_path", "mode", "metric")

    def shown(run: Path, column: str) -> dict[tuple[Any, ...], Any]:
        code, out = cli("show", run, "--format", "json")
        assert code == 0
        return {tuple(r[k] for k in key): r[column] for r in json.loads(out)["rows"]}

    for a in (runs["baseline"], backwards):
        code, out = cli("compare", a, runs["cut"], "--x", "forward_index", "--format", "json")
        assert code == 0
        rows = json.loads(out)["rows"]
        assert {tuple(r[k] for k in key): r["mean_a"] for r in rows} == shown(a, "window_mean")
        assert {tuple(r[k] for k in key): r["mean_b"] for r in rows} == shown(
            runs["cut"], "window_mean"
        )
        types = {tuple(r[k] for k in key): r["module_type"] for r in rows}
        assert types == shown(a, "module_type")
    assert set(types.values()) > {"Renamed", "Linear"}
