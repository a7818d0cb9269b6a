"""The readers on a run whose history part is cut short (a copy that stopped, a machine that lost
power after the rename): one line naming the part and what to do, never a Polars traceback; and
once `finalize` has merged the readable parts and left the damaged one in place (as it says in
index.md), the commands read the rest and say which part they left out.

The run is killed for real (SIGKILL) with several parts on disk; the expected values are computed
here from history.parquet with plain Polars.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import (
    EveryNForwardsSampler,
    HistoryConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir.layout import list_parts

from conftest import cli_in_process, kill_when_ready, run_cli, wait_for_rows

SAMPLES = 4
ROWS_PER_SAMPLE = 2 * 2 * 9  # two Linears, output and gradient, nine metrics


def child(directory: str) -> None:
    """Observe SAMPLES samples, each written as its own part, then wait to be killed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    inject_observer(
        model,
        output_dir=directory,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=ROWS_PER_SAMPLE // 2),
    )
    for _ in range(SAMPLES):
        model(torch.randn(4, 3)).sum().backward()
    wait_for_rows(Path(directory), SAMPLES * ROWS_PER_SAMPLE)
    print("ready", flush=True)
    time.sleep(120)  # killed here (stdin may be closed: input() would end the child first)


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, Path]:
    """A killed run whose third part is cut to half its bytes; the run and that part."""
    directory = tmp_path / "run"
    kill_when_ready(__file__, "ready", directory)
    parts = list_parts(directory)
    assert len(parts) >= 3
    cut = parts[2]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    return directory, cut


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one error line of a command that exits with `code`, without a traceback: stderr's
    only line, after the killed run's state where the command says it first (plot, heatmap)."""
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    *state, line = result.stderr.splitlines()
    assert [": state: interrupted" in said for said in state] == [True] * len(state), state
    return line


def test_a_damaged_part_is_named_with_what_to_do_then_the_rest_is_read(
    damaged: tuple[Path, Path], tmp_path: Path
) -> None:
    directory, cut = damaged
    for command in ("show", "compare", "plot", "heatmap"):
        args = (directory, directory) if command == "compare" else (directory,)
        out = ("-o", tmp_path / "p.png") if command == "plot" else ()
        line = one_line(cli_in_process(command, *args, *out), 1)
        assert line.startswith(
            f"torchinstruments {command}: {cut}: unreadable (not a whole Parquet"
        )
        assert f"torchinstruments finalize {directory}" in line
        assert "merges the readable parts and leaves this one in place" in line

    assert run_cli("finalize", directory).returncode == 1  # incomplete: the part is left
    assert cut.exists()
    history = pl.read_parquet(directory / "history.parquet")
    assert 0 < history.height < SAMPLES * ROWS_PER_SAMPLE  # the cut part's rows are missing

    result = cli_in_process("show", directory, "--format", "json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["run"]["history_files"] == [str(directory / "history.parquet")]
    assert shown["run"]["unreadable_files"] == [str(cut)]
    key = ["layer", "call_index", "signal", "tensor_path", "mode", "metric"]
    latest = (
        history.with_row_index("order")
        .filter(pl.col("metric") != "interrupted")
        .sort("sample_id", "order")
        .group_by(key)
        .agg(pl.col("value").last(), pl.col("sample_id").last())
    )
    expected = {(*r[:6], r[6], r[7]) for r in latest.iter_rows()}
    got = {(*(r[k] for k in key), r["latest_value"], r["latest_sample_id"]) for r in shown["rows"]}
    assert got == expected

    text = cli_in_process("show", directory, "--metrics", "mean", "--width", "200")
    assert text.returncode == 0, text.stderr
    assert (
        "read: history.parquet (left out: 1 unreadable part in history.parts/, its rows "
        f"missing: {cut.name}); latest sample_id"
    ) in text.stdout
    assert "INCOMPLETE" in text.stdout  # the state line says finalize left it out, too
    for command in ("compare", "plot", "heatmap"):
        args = (directory, directory) if command == "compare" else (directory,)
        out = ("-o", tmp_path / "p.png") if command == "plot" else ("-o", tmp_path)
        result = cli_in_process(command, *args, *(out if command != "compare" else ()))
        assert result.returncode == 0, (command, result.stderr)


def test_a_damaged_history_parquet_says_to_restore_it(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    merged = directory / "history.parquet"
    merged.write_bytes(merged.read_bytes()[:100])
    line = one_line(cli_in_process("show", directory), 1)
    assert line == (
        f"torchinstruments show: {merged}: the history file is unreadable (not a whole Parquet "
        "file: cut short by a copy or a crash of the machine); restore it from a copy of the run"
    )


if __name__ == "__main__":
    child(sys.argv[1])
