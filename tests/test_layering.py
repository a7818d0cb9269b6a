"""The package reads top to bottom in the design notes' order: no module imports one above it.

docs/design-notes.md's "Where each idea lives" lists every module of the package (the tree is
parsed here and compared with the files), most dependent first; every import inside the package
must point down that list, so the list is a reading order in which each module only uses what a
newcomer meets after it. Imports are read from the source (inside functions too), so a lazy import cannot hide a
cycle. A module's own subpackage `__init__` that holds nothing but a docstring need not be listed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torchinstruments

PACKAGE = Path(torchinstruments.__file__).parent
DESIGN_NOTES = PACKAGE.parents[1] / "docs" / "design-notes.md"
# An entry of the tree: its indent (2 for the package level, 4 inside a folder), its names.
_ENTRY = re.compile(r"^(?P<indent> {2}| {4})(?P<names>[\w.]+(?:/|\.py)(?:, [\w.]+\.py)*)(?:\s|$)")


def readme_order() -> list[str]:
    """Module names (`api`, `rundir.layout`, `cli` for cli/__init__.py) in the design notes' tree order.

    A folder line stands for its `__init__.py` at that place (whether or not it is listed).
    """
    text = DESIGN_NOTES.read_text(encoding="utf-8")
    section = text.split("## Where each idea lives", 1)[1]
    block = section.split("```", 2)[1]
    order: list[str] = []
    folder = ""
    for line in block.splitlines():
        match = _ENTRY.match(line)
        if match is None:
            continue  # the root line, or a description's continuation
        names = match.group("names")
        if match.group("indent") == "  ":
            folder = ""
        if names.endswith("/"):
            folder = names.removesuffix("/")
            order.append(folder)
            continue
        for name in names.split(", "):
            stem = name.removesuffix(".py")
            if stem == "__init__":
                if folder not in order:  # its folder's line already stands for it
                    order.append(folder)
            else:
                order.append(f"{folder}.{stem}" if folder else stem)
    return order


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


def only_a_docstring(path: Path) -> bool:
    """An `__init__.py` with nothing but its docstring (it imports and defines nothing)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def test_readme_lists_every_module_once() -> None:
    order = readme_order()
    assert len(order) == len(set(order)), [name for name in order if order.count(name) > 1]
    files = {
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if not (path.name == "__init__.py" and path.parent != PACKAGE and only_a_docstring(path))
    }
    # A folder line stands for its docstring-only __init__ too: listed but not required.
    folders = {module_name(path) for path in PACKAGE.rglob("__init__.py")}
    assert set(order) - files - folders == set()  # listed, but no such file
    assert files - set(order) == set()  # a file the design notes do not list


def test_no_module_imports_a_module_printed_above_it() -> None:
    position = {name: index for index, name in enumerate(readme_order())}
    offenders = []
    for module, deps in graph().items():
        for dep in deps:
            if dep in position and module in position and position[dep] <= position[module]:
                offenders.append(f"{module} imports {dep}, printed above it")
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


# The command line's modules, each of one kind. A command's module holds what one command (or
# one command on a parent of rank runs) does; what several commands share (reading, ordering,
# text, drawing) is in the shared modules; the entry parses arguments and runs a command.
CLI_COMMANDS = {
    "cli.show",
    "cli.compare",
    "cli.plot",
    "cli.heatmap",
    "cli.finalize",
    "cli.ranks",
    "cli.rank_spread",
    "cli.ranks_draw",
}
CLI_SHARED = {
    "cli.attempts_apart",
    "cli.chunked",
    "cli.matching",
    "cli.module_types",
    "cli.rank_departures",
    "cli.differences",
    "cli.rank_runs",
    "cli.reader",
    "cli.run_dirs",
    "cli.states",
    "cli.selection",
    "cli.text",
    "cli.overview",
    "cli.rank_overview",
    "cli.pictures",
    "cli.pictures_grid",
}
CLI_ENTRY = {"cli", "cli.arguments", "cli.ranks_command"}


def test_no_command_module_imports_another_commands_module() -> None:
    """`plot PARENT` draws through the shared drawing modules, not through `plot`'s module: a
    command changed for its own sake never changes another. Every CLI module is of one kind, so
    a new one cannot slip past the rule."""
    edges = graph()
    cli = {m for m in edges if m == "cli" or m.startswith("cli.")}
    assert cli == CLI_COMMANDS | CLI_SHARED | CLI_ENTRY
    offenders = [
        f"{module} imports {dep}"
        for module in CLI_COMMANDS | CLI_SHARED
        for dep in edges[module]
        if dep in CLI_COMMANDS | CLI_ENTRY and dep != module
    ]
    assert offenders == []


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


def test_every_module_declares_its_public_names() -> None:
    """Each module says what it offers (`__all__`), so a reader (and `from x import *`) never
    takes a helper or an imported name for part of its interface."""
    lacking = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = [
            target
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        ]
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            lacking.append(str(path.relative_to(PACKAGE)))
    assert lacking == []


def test_no_module_is_over_600_lines() -> None:
    """A module that outgrows 600 lines holds more than one idea: split it by idea."""
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > 600
    }
    assert long == {}
