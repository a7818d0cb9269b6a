"""The text tables of `show` and `compare` at 80 columns: no line wider, no name cut alike.

A 3,000-layer run's gradients are small numbers, printed in 10 characters (`-6.168e-05`), so a
table of several such columns beside a metric name that is never cut (`nonfinite_fraction`)
needs more than 80 columns at two spaces apart: the columns are then one space apart, and the
wrapping first column (layer, module type) gives up its width, each name whole on a line of
its own. A module type is never cut: `LayerNorm` and `GroupNorm` cut to their ends both read
`...orm`.
"""

from __future__ import annotations

from torchinstruments.cli.overview import type_table
from torchinstruments.cli.text import table

WIDE = "-6.168e-05"  # a number cell at its widest (text.NUMBER_WIDTH)


def test_a_compare_table_of_wide_numbers_stays_within_80_columns_with_names_whole() -> None:
    headers = ["layer", "signal", "metric", "mean A", "mean B", "B - A", "first diff", "matched"]
    layer = "encoder.layers.11.self_attn.out_proj"
    rows = [[layer, "grad", "nonfinite_fraction", WIDE, WIDE, WIDE, "12", "100"]]
    lines = table(
        headers,
        rows,
        numeric=[False, False, False, True, True, True, True, True],
        width=80,
        whole=[False, False, True, False, False, False, False, False],
        wrap_first=True,
    )
    assert max(len(line) for line in lines) <= 80
    assert lines[0].split() == ["signal", "metric", "mean", "A", "mean", "B", "B", "-", "A",
                                "first", "diff", "matched"]  # fmt: skip
    assert lines[2] == layer  # the layer whole, on its own line
    assert lines[3].split() == ["grad", "nonfinite_fraction", WIDE, WIDE, WIDE, "12", "100"]


def test_a_table_that_fits_keeps_two_spaces_and_its_first_column() -> None:
    lines = table(["layer", "value"], [["fc1", "1.5"]], numeric=[False, True], width=80)
    assert lines == ["layer  value", "-----  -----", "fc1      1.5"]


def test_grouped_module_types_are_never_cut_and_named_once_per_group() -> None:
    headers = ["type", "sig", "at", "tensors", "partial", "min", "max", "widest", "far rank"]
    numbers = ["1000", "0", WIDE, WIDE, WIDE, "1"]
    rows = [
        ["LayerNorm", "out", "latest", *numbers],
        ["", "grad", "latest", *numbers],
        ["GroupNorm", "out [eval]", "window", *numbers],
    ]
    lines = type_table(headers, rows, [False] * 3 + [True] * 6, 80)
    assert max(len(line) for line in lines) <= 80
    assert "..." not in "\n".join(lines)
    names = [line for line in lines if line.strip() in ("LayerNorm", "GroupNorm")]
    assert names == ["LayerNorm", "GroupNorm"]
    assert any(line.split()[:3] == ["out", "[eval]", "window"] for line in lines)
