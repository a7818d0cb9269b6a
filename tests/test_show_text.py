"""`show`'s text view: each window mean with the number of samples it is over, layer names that
stay distinguishable at 80 columns, and counts in the right number ("1 sample").
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.__main__ import main


def show(*args: str | Path) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["show", *map(str, args), "--width", "80"]) == 0
    return out.getvalue().splitlines()


def row_of(lines: list[str], name: str) -> list[str]:
    """The cells of the table row of layer `name` (after its name line when it was wrapped)."""
    for i, line in enumerate(lines):
        if line == name:
            return lines[i + 1].split()
        if line.split() and line.split()[0] == name:
            return line.split()[1:]
    raise AssertionError(f"no row for {name}: {lines}")


def test_window_means_say_how_many_samples_they_are_over(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Identity())
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    for step in range(8):
        x = torch.full((4,), float(step))
        model(x if step % 2 == 0 else x * float("nan"))  # odd samples: no finite entry
    remove_observer(model)
    history = pl.read_parquet(tmp_path / "run" / "history.parquet").filter(
        pl.col("metric") == "mean"
    )
    valid = history["value"].drop_nulls()
    assert valid.len() == 4

    lines = show(tmp_path / "run", "--metrics", "mean")
    header = next(line for line in lines if line.startswith("layer"))
    assert header.split() == ["layer", "type", "out", "latest", "out", "mean", "n"]
    latest, mean, count = row_of(lines, "0")[1:]
    assert latest == "null"
    assert float(mean) == pytest.approx(sum(valid.to_list()) / 4, rel=1e-3)
    assert count == "4/8"  # the mean is over 4 of the window's 8 samples


def test_n_counts_only_the_values_the_window_mean_is_over(tmp_path: Path) -> None:
    """A NaN or an infinity (only a hand-edited or concatenated history holds one: the library
    writes a null with a reason) is left out of the window mean, and so out of `n`."""
    model = nn.Sequential(nn.Identity())
    run = tmp_path / "run"
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    for step in range(8):
        model(torch.full((4,), float(step)))
    remove_observer(model)
    edited = {1: float("nan"), 4: float("inf")}
    rows = pl.read_parquet(run / "history.parquet")
    at = pl.col("metric") == "mean"
    for sample, value in edited.items():
        at_sample = at & (pl.col("sample_id") == sample)
        rows = rows.with_columns(value=pl.when(at_sample).then(value).otherwise("value"))
    rows.write_parquet(run / "history.parquet")
    values = rows.filter(at)["value"]
    finite = values.filter(values.is_finite())
    assert (values.len(), finite.len()) == (8, 6)

    latest, mean, count = row_of(show(run, "--metrics", "mean"), "0")[1:]
    assert float(latest) == values[-1] == 7.0
    assert float(mean) == pytest.approx(finite.mean(), rel=1e-3)
    assert count == "6/8"  # the mean is over the 6 finite values of the window's 8 samples

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["show", str(run), "--metrics", "mean", "--format", "csv"]) == 0
    frame = pl.read_csv(io.StringIO(out.getvalue()))
    assert frame.select("window_finite", "window_valid", "window_samples").row(0) == (6, 8, 8)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(4, 4)
        self.key = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.query(x) + self.key(x)


class Deep(nn.Module):
    """BERT-like names: two layers whose names differ only in the middle."""

    def __init__(self) -> None:
        super().__init__()
        block = lambda: nn.ModuleDict({"attention_self": Attention()})  # noqa: E731
        self.encoder_with_a_long_name = nn.ModuleDict({"layer": nn.ModuleList([block(), block()])})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.encoder_with_a_long_name["layer"]:  # type: ignore[union-attr]
            x = block["attention_self"](x)
        return x


def test_long_layer_names_stay_distinct_at_80_columns(tmp_path: Path) -> None:
    model = Deep()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    names = [
        f"encoder_with_a_long_name.layer.{i}.attention_self.{part}"
        for i in range(2)
        for part in ("query", "key")
    ]
    lines = show(tmp_path / "run", "--metrics", "std")
    assert max(len(line) for line in lines) <= 80
    for name in names:
        assert name in lines, name  # whole, on a line of its own, above its row
        assert len(row_of(lines, name)) == 7  # type, then latest / mean / n of both signals


def test_counts_of_one_are_singular(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    inject_observer(model, output_dir=tmp_path / "run")
    model(torch.randn(1, 2))
    remove_observer(model)
    lines = show(tmp_path / "run")
    assert "counts: 1 root forward, 1 sample, 0 samples with output gradients" in lines
    page = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "1 samples" not in page
    assert "1 root forwards" not in page


CONTROL_NAMES = ("new\nline", "tab\tx", "back\rz", "esc\x1b[2Jy")


class ControlNames(nn.Module):
    """A Linear per name in CONTROL_NAMES (keys of a ModuleDict, which allows them), chained."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.ModuleDict({name: nn.Linear(2, 2) for name in CONTROL_NAMES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.d.values():
            x = layer(x)
        return x


def test_control_characters_in_layer_names_are_escaped_in_text_and_kept_in_csv(
    tmp_path: Path,
) -> None:
    """A newline in a name would split its row, a carriage return or an escape rewrite the
    screen: the text views write such a name as its Python string literal; csv keeps the names
    as they are."""
    torch.manual_seed(0)
    model = ControlNames()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    lines = show(tmp_path / "run", "--metrics", "mean")
    assert not any("\x1b" in line or "\r" in line or "\t" in line for line in lines)
    history = pl.read_parquet(tmp_path / "run" / "history.parquet").filter(
        pl.col("metric") == "mean", pl.col("signal") == "output"
    )
    for name in CONTROL_NAMES:
        shown = repr(f"d.{name}")  # its Python literal, as index.md writes it
        (value,) = history.filter(pl.col("layer") == f"d.{name}")["value"].to_list()
        assert row_of(lines, shown)[:2] == ["Linear", f"{value:.4g}"]
    for command in ("show", "compare"):
        out = io.StringIO()
        runs = [tmp_path / "run"] * (2 if command == "compare" else 1)
        with contextlib.redirect_stdout(out):
            assert main([command, *map(str, runs), "--metrics", "mean", "--format", "csv"]) == 0
        frame = pl.read_csv(
            io.StringIO(out.getvalue()), schema_overrides={"tensor_path": pl.String}
        )
        assert set(frame["layer"]) == {f"d.{name}" for name in CONTROL_NAMES}


def test_notes_are_counted_and_each_begun_never_printed_whole_past_a_few_lines() -> None:
    from torchinstruments.cli.show import notes_lines

    assert notes_lines(()) == []
    long = "a long note " * 20
    notes = ["short one", long, *(f"note {i}" for i in range(5))]
    assert notes_lines(notes) == [
        "notes: 7, in full at the top of index.md:",
        "- short one",
        f"- {long[:147].rstrip()}...",
        "- note 0",
        "- note 1",
        "- note 2",
        "- ... (2 more)",
    ]
