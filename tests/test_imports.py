"""Imports cost what they use: the package imports without fcntl, the CLI's finalize without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl

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
    from torchinstruments.registry import OBSERVERS

    observer = OBSERVERS.pop(model)
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


def test_integrations_import_their_trainer_only_when_used() -> None:
    done = run_python(
        """
        import sys
        import torchinstruments.integrations as integrations
        assert sorted(integrations.__all__) == ["HuggingFaceObserver", "LightningObserver"]
        loaded = [m for m in ("torch", "lightning", "pytorch_lightning", "transformers")
                  if m in sys.modules]
        print(loaded)
        """
    )
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr
    # Each callback's module imports its own trainer and never the other one.
    package = Path(__file__).parents[1] / "src" / "torchinstruments" / "integrations"
    huggingface = top_level_imports(package / "huggingface.py")
    lightning = top_level_imports(package / "lightning.py")
    assert "transformers" in huggingface
    assert not {"lightning", "pytorch_lightning"} & huggingface
    assert "lightning" in lightning
    assert "transformers" not in lightning


def top_level_imports(path: Path) -> set[str]:
    """The top-level package of every import in `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found
