"""Every benchmark names the machine it measured: CPU (family, model), cores, torch, NumPy, its
SIMD dispatch and its sort's speed.

A ratio against `torch.sort` moves by an order of magnitude between CPUs (NumPy's AVX-512 sort
is fast on some and microcoded on others), so a figure without its machine proves little.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(path for path in BENCH.glob("*.py") if not path.name.startswith("_"))


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> object:
    """bench/_machine.py, imported as the benches import it."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("_machine", None)
    import _machine

    return _machine


def test_there_are_benches_to_check() -> None:
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_bench_prints_its_machine_from_main(script: Path) -> None:
    tree = ast.parse(script.read_text())
    main = next(
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"
    )
    called = {
        node.func.id
        for node in ast.walk(main)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert "print_machine" in called, f"{script.name}: main() does not call print_machine()"


def test_the_machine_lines_say_what_numpy_show_runtime_reports(machine: object) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        np.show_runtime()
    found = re.search(r"'simd_extensions': (\{[^{}]*\})", printed.getvalue())
    assert found is not None, printed.getvalue()
    simd = ast.literal_eval(found.group(1))
    text = machine.describe()  # type: ignore[attr-defined]
    first, second, third = text.splitlines()
    assert f"torch {torch.__version__}" in first
    assert f"NumPy {np.__version__}" in first
    assert f"{len(os.sched_getaffinity(0))} cores" in first
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        block = cpuinfo.read_text().split("\n\n")[0]  # the first processor's
        fields: dict[str, str] = {}
        for line in block.splitlines():
            name, _, value = line.partition(":")
            fields[name.strip()] = value.strip()
        if "model name" in fields:
            ids = [f"family {fields['cpu family']}"] if "cpu family" in fields else []
            ids += [f"{key} {fields[key]}" for key in ("model", "stepping") if key in fields]
            named = fields["model name"] + (f" ({', '.join(ids)})" if ids else "")
            assert first.startswith(f"machine: {named}, ")
    assert f"baseline {' '.join(simd['baseline']) or '-'};" in second
    assert f"found {' '.join(simd['found']) or '-'};" in second
    assert second.endswith(f"not found {' '.join(simd['not_found']) or '-'}")
    speed = re.fullmatch(r"NumPy sort of 2\*\*20 float32: (\d+\.\d) ns per entry", third)
    assert speed is not None, third
    assert float(speed.group(1)) > 0


def test_a_bench_says_how_many_cores_other_work_held_while_it_ran(machine: object) -> None:
    # 10 s of wall time, 9 s of the machine's CPU of which 4 this process's and 1 stolen
    others, steal = machine.contention((0.0, 100.0, 2.0, 1.0), (10.0, 109.0, 3.0, 5.0))  # type: ignore[attr-defined]
    assert (others, steal) == (0.5, 0.1)
    script = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import _machine; _machine.print_machine()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    if Path("/proc/stat").exists():
        said = re.search(
            r"other work during this run: (\d+\.\d\d) of (\d+) cores on average \(of which (\d+\.\d\d)",
            done.stdout,
        )
        assert said is not None, done.stdout
        assert int(said.group(2)) == len(os.sched_getaffinity(0))
        assert float(said.group(3)) <= float(said.group(1))
