"""Lazy public namespaces (PEP 562): a package's public names imported from their modules on use.

Why: `import torchinstruments` must cost nothing (the command line never imports torch), and
`torchinstruments.integrations` must not import Lightning for the Hugging Face callback nor the
other way round. Both packages build their module-level `__getattr__` and `__dir__` here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_namespace"]


def lazy_namespace(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, whose public names are `exports`' keys.

    Args:
        package: the package's name, for the error message.
        namespace: the package's `globals()`; each name is cached there on first use.
        exports: public name -> the module that defines it.
    """

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
