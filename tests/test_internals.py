"""Private names of torch, TensorBoard and other libraries are read in two places only.

The `_torch_internals/` package and `_tensorboard_internals.py` hold every use of a name another
library does not promise (each with why and the version it was checked on), so an upgrade that
moves one breaks in one place. Anywhere else in src, a test fails on:
- the text `torch._` or `._C.` (what `grep -rn "torch\\._\\|\\._C\\." src` finds);
- importing a private module or name of another library (`from torch.fx import _symbolic_trace`,
  `import torch._dynamo`), or an undocumented torch module (`torch.utils.weak`);
- reading `x._name` (or `getattr(x, "_name")`) where `_name` is not defined by the module that
  reads it (`self._x`, a slot or field, a function) and not part of namedtuple's public API
  (`_fields`, `_replace`, ...): a name another module of ours defines does not count, so a read
  of a foreign `_writer` cannot hide behind one of our own `_writer` attributes;
- subclassing a class of another library that is not in `DOCUMENTED_BASES`, by exact name
  (a subclass depends on the base's private behaviour as much as an attribute read does).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torchinstruments

PACKAGE = Path(torchinstruments.__file__).parent
# Paths relative to the package: every module of the `_torch_internals/` package, and TensorBoard's.
TORCH_INTERNALS = "_torch_internals/"
TENSORBOARD_INTERNALS = "_tensorboard_internals.py"
TEXT = re.compile(r"torch\._|\._C\.")
UNDOCUMENTED_MODULES = frozenset({"torch.utils.weak"})
NAMEDTUPLE_API = frozenset({"_fields", "_replace", "_asdict", "_make", "_field_defaults"})
# Foreign classes the package subclasses outside the internals modules, each a documented
# extension point of its library.
DOCUMENTED_BASES = frozenset(
    {
        "typing.Protocol",
        "enum.StrEnum",
        "wrapt.FunctionWrapper",
        "pytorch_lightning.Callback",
        "transformers.TrainerCallback",
    }
)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names(trees: list[ast.Module]) -> set[str]:
    """Every private name the package defines: attributes it assigns, its slots, fields,
    functions, classes and variables."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__slots__" for target in node.targets
            ):
                names.update(
                    item.value
                    for item in ast.walk(node.value)
                    if isinstance(item, ast.Constant) and isinstance(item.value, str)
                )
    return {name for name in names if is_private(name)}


def foreign_bases(tree: ast.Module) -> list[str]:
    """The foreign classes (as `module.Name`) that the module's classes subclass."""
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            imported.update({(a.asname or a.name).split(".")[0]: a.name for a in node.names})
    bases = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                text = ast.unparse(base)
                head, _, rest = text.partition(".")
                origin = imported.get(head)
                if origin and not origin.startswith("torchinstruments"):
                    bases.append(f"{origin}.{rest}" if rest else origin)
    return bases


def offenses(source: str, own: set[str]) -> list[str]:
    """What `source` reads of another library's private names (see the module docstring)."""
    found = [f"text {match.group()!r}" for match in TEXT.finditer(source)]
    tree = ast.parse(source)
    found += [f"subclass of {base}" for base in foreign_bases(tree) if base not in DOCUMENTED_BASES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            modules = []
        for module in modules:
            if module.split(".")[0] in ("torchinstruments", "__future__"):
                continue
            if any(is_private(part) for part in module.split(".")):
                found.append(f"import of {module}")
            elif module in UNDOCUMENTED_MODULES:
                found.append(f"import of undocumented {module}")
        if (
            isinstance(node, ast.Attribute)
            and is_private(node.attr)
            and node.attr not in own
            and node.attr not in NAMEDTUPLE_API
        ):
            found.append(f"line {node.lineno}: .{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and is_private(node.args[1].value)
            and node.args[1].value not in own | NAMEDTUPLE_API
        ):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def is_allowed(name: str) -> bool:
    """Whether the module at `name` (a path relative to the package) may read private names."""
    return name.startswith(TORCH_INTERNALS) or name == TENSORBOARD_INTERNALS


def package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE)): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_private_names_of_other_libraries_are_read_only_in_the_internals_modules() -> None:
    sources = package_sources()
    checked = {name: text for name, text in sources.items() if not is_allowed(name)}
    found = {name: offenses(text, own_names([ast.parse(text)])) for name, text in checked.items()}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_internals_modules_exist_and_are_where_the_private_names_are() -> None:
    sources = package_sources()
    assert {TENSORBOARD_INTERNALS, f"{TORCH_INTERNALS}__init__.py"} <= set(sources)
    hits = {name for name, text in sources.items() if TEXT.search(text)}
    assert hits == {f"{TORCH_INTERNALS}__init__.py", f"{TORCH_INTERNALS}dynamo.py"}


def test_each_kind_of_private_use_is_caught() -> None:
    own = {"_mine"}
    assert offenses("import torch._dynamo\n", own) == ["text 'torch._'", "import of torch._dynamo"]
    assert offenses("from torch.fx import _symbolic_trace\n", own) == [
        "import of torch.fx._symbolic_trace"
    ]
    assert offenses("from torch.utils.weak import WeakIdKeyDictionary\n", own) == [
        "import of undocumented torch.utils.weak"
    ]
    assert offenses("version = tensor._version\n", own) == ["line 1: ._version"]
    assert offenses("frame = sys._getframe(1)\n", own) == ["line 1: ._getframe"]
    assert offenses("x = eval_frame._C.thing\n", own) == ["text '._C.'", "line 1: ._C"]
    assert offenses("w = getattr(writer, '_async_writer', None)\n", own) == [
        "line 1: getattr(..., '_async_writer')"
    ]


def test_own_names_and_namedtuple_api_are_not_private_uses() -> None:
    source = "class A:\n    __slots__ = ('_slot',)\n    def f(self):\n        self._x = 1\n"
    own = own_names([ast.parse(source)])
    assert own == {"_slot", "_x"}
    uses = "a._x\na._slot\npoint._fields\npoint._replace(x=1)\nm.__dict__\ngetattr(a, '_x')\n"
    assert offenses(uses, own) == []


def test_a_foreign_private_name_fails_even_where_another_module_defines_it() -> None:
    sources = package_sources()
    everywhere = own_names([ast.parse(text) for name, text in sources.items()])
    assert "_writer" in everywhere  # events.EventFile's own attribute
    source = "def f(records):\n    return records._writer\n"
    assert offenses(source, own_names([ast.parse(source)])) == ["line 2: ._writer"]


def test_subclassing_an_undocumented_foreign_class_is_caught() -> None:
    source = (
        "from tensorboard.summary.writer.record_writer import RecordWriter\n"
        "import wrapt\n"
        "class Framing(RecordWriter):\n    pass\n"
        "class Proxy(wrapt.FunctionWrapper):\n    pass\n"
    )
    assert offenses(source, set()) == [
        "subclass of tensorboard.summary.writer.record_writer.RecordWriter"
    ]
