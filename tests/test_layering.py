"""The package reads top to bottom: no module imports one above it, and there are no cycles.

The order is README's "Where each idea lives": records and reasons at the bottom; the run
directory, its TensorBoard events, the measurement, sampling, distributed placement and capture
above them; then sinks,
selection, gradients and the command line; the observer; the API; the trainer integrations; the
package entry points.
Imports are read from the source (inside functions too), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torchinstruments

PACKAGE = Path(torchinstruments.__file__).parent

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"records", "reasons", "_torch_internals", "_tensorboard_internals"}),
    frozenset(
        {
            "rundir",
            "events",
            "measurement",
            "sampling",
            "distributed",
            "forks",
            "capture",
            "outputs",
            "compilation",
        }
    ),
    frozenset({"sinks", "selection", "gradients", "cli"}),
    frozenset({"config"}),
    frozenset({"observer"}),
    frozenset({"api"}),
    frozenset({"integrations"}),
    frozenset({"__main__", ""}),
)


def module_name(path: Path) -> str:
    """`rundir/layout.py` -> `rundir.layout`; the package's own `__init__` is ``""``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether `name` (e.g. `cli.show`) is a module or subpackage of the package."""
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """The package modules `path` imports, by `module_name`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "torchinstruments" and not node.module.startswith(
                "torchinstruments."
            ):
                continue
            base = node.module.removeprefix("torchinstruments").removeprefix(".")
            for alias in node.names:  # `from torchinstruments.cli import show` is a submodule
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if is_module(candidate) else base)
        elif isinstance(node, ast.Import):
            found.update(
                alias.name.removeprefix("torchinstruments.")
                for alias in node.names
                if alias.name.startswith("torchinstruments.")
            )
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in PACKAGE.rglob("*.py")}


def rank(module: str) -> int:
    top = module.split(".")[0]
    return next(index for index, layer in enumerate(LAYERS) if top in layer)


def test_every_module_has_a_place_in_the_order() -> None:
    for module in graph():
        rank(module)  # raises StopIteration for a module the order does not place


def test_no_module_imports_a_module_above_it_or_beside_it() -> None:
    offenders = []
    for module, deps in graph().items():
        for dep in deps:
            same_group = dep.split(".")[0] == module.split(".")[0]
            if not same_group and rank(dep) >= rank(module):
                offenders.append(f"{module} imports {dep}")
    assert offenders == []


def test_there_are_no_import_cycles() -> None:
    edges = graph()
    known = set(edges)
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, " -> ".join((*stack, module))
        if module in done:
            return
        for dep in edges.get(module, set()) & known:
            visit(dep, (*stack, module))
        done.add(module)

    for module in edges:
        visit(module, ())


def test_the_run_directory_never_imports_torch_or_tensorboard() -> None:
    """`finalize`, `show` and `compare` run in processes without torch: they live on rundir."""
    offenders = []
    for path in (PACKAGE / "rundir").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [
                f"{module_name(path)} imports {name}"
                for name in names
                if name.split(".")[0] in ("torch", "tensorboard")
            ]
    assert offenders == []
