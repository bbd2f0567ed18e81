"""Attributes of a package imported on first use (PEP 562), so that importing a light submodule
(`rankscope.cli`, `rankscope.contract`, `rankscope.control.catalog`) does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, where: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` resolving each name in `where` (name -> submodule) on first access."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # the next access is a plain global
        return value

    return __getattr__


def require(extra: str, *modules: str) -> None:
    """ImportError in one line naming the pip extra when one of `modules` cannot be imported."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"{module} cannot be imported ({exc}): pip install 'rankscope[{extra}]'") from None
