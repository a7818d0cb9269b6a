"""Imports cost what they use: the package imports without fcntl, the CLI's finalize without torch."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

from torchinstruments import EveryNForwardsSampler, inject_observer
from torchinstruments.rundir.layout import list_parts

from conftest import mlp


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter and return what happened."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_package_imports_and_runs_where_fcntl_does_not_exist(tmp_path: Path) -> None:
    done = run_python(
        """
        import sys, warnings
        sys.modules["fcntl"] = None  # as on Windows: `import fcntl` raises ImportError
        import torch
        import torchinstruments as ti
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ti.inject_observer(model, output_dir=sys.argv[1], sampler=ti.EveryNForwardsSampler(1))
            model(torch.randn(2, 3)).sum().backward()
            ti.remove_observer(model)
        print([str(w.message) for w in caught])
        """,
        str(tmp_path / "run"),
    )
    assert done.returncode == 0, done.stderr
    assert "is not locked" in done.stdout  # never silent: the missing lock is said
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert set(history["layer"]) == {"0", "1"}


def test_finalize_cli_runs_without_torch_or_tensorboard(tmp_path: Path) -> None:
    run = tmp_path / "crashed"
    model = mlp()
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    import torch

    model(torch.randn(2, 8)).sum().backward()
    # A crash: the observer never finishes; flush what it holds the way a part boundary would.
    from torchinstruments.api import _OBSERVERS

    observer = _OBSERVERS.pop(model)
    directory_sink = observer.sinks._sinks[0]
    directory_sink._history.flush()  # type: ignore[attr-defined]
    directory_sink._lock.release()  # type: ignore[attr-defined]
    assert observer._finalizer is not None
    observer._finalizer.detach()
    observer.proxies.restore()
    assert list_parts(run)

    done = run_python(
        """
        import sys
        for name in ("torch", "tensorboard", "numpy"):
            sys.modules[name] = None  # any import of them now raises ImportError
        from torchinstruments.__main__ import main
        code = main(["finalize", sys.argv[1]])
        assert not any(m in sys.modules and sys.modules[m] for m in ("torch", "tensorboard"))
        sys.exit(code)
        """,
        str(run),
    )
    assert done.returncode == 0, done.stderr
    history = pl.read_parquet(run / "history.parquet")
    assert history.height == 6 * 9 * 2  # 6 layers x 9 metrics x (output, output_gradient)
    # a crashed run is never "complete": what it held in memory at the crash is unknown
    assert "**State: interrupted.**" in (run / "index.md").read_text(encoding="utf-8")


def test_measures_exactly_where_numpy_does_not_exist() -> None:
    """NumPy comes with tensorboard, but the statistics do not rely on it: without it the CPU
    statistics take the radix passes and give the same exact values."""
    done = run_python(
        """
        import json, sys
        sys.modules["numpy"] = None
        import torch
        from torchinstruments.measurement import numerics
        from torchinstruments.measurement.reducers import Measurer
        assert not numerics.HAVE_NUMPY
        torch.manual_seed(0)
        out = torch.randn(50, 300).relu()
        measurer = Measurer(None)
        pending = measurer.launch(out)
        vector = pending.device_vector
        values = pending.resolve([] if vector is None else vector.tolist())
        got = {n: v.value for n, v in zip(measurer.metrics, values)}
        flat = out.double().flatten()
        want = {
            "mean": flat.mean().item(), "min": flat.min().item(), "max": flat.max().item(),
            "p25": torch.quantile(flat, 0.25).item(), "p50": flat.quantile(0.5).item(),
            "p75": torch.quantile(flat, 0.75).item(), "std": flat.std(correction=0).item(),
            "zero_fraction": (flat == 0).double().mean().item(), "nonfinite_fraction": 0.0,
        }
        print(json.dumps({"got": got, "want": want}))
        """
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name, expected in result["want"].items():
        assert result["got"][name] == pytest.approx(expected, rel=1e-12, abs=1e-12), name


def test_histogram_edges_without_numpy_equal_those_with_it() -> None:
    from torchinstruments.measurement import numerics

    rng = random.Random(5)
    pairs = [(-1.0, 1.0), (0.0, 0.0), (-0.0, 0.0), (1e-300, 1e300), (-3.5, -3.5 + 1e-12)]
    pairs += [tuple(sorted((rng.uniform(-1e6, 1e6), rng.uniform(-1e6, 1e6)))) for _ in range(500)]
    for low, high in pairs:
        for bins in (1, 7, 64):
            vectorised = numerics.edges_on_host(low, high, bins)
            scalar = numerics._edges_in_python(low, high, bins)
            assert [struct.pack("<d", v) for v in vectorised] == [
                struct.pack("<d", v) for v in scalar
            ], (low, high, bins)
