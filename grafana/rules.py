"""The rule generator as a module: the alerts' tunables and the names of the recorded series.

prometheus/generate_rules.py is the one source of every threshold, window, `for` and severity
(its :class:`Tunables`) and of the recorded series' names. The dashboards draw the alerts'
thresholds and name the series the rules record from here, so a changed threshold or a renamed
series changes the dashboards when they are regenerated (and `tests/test_grafana_dashboards.py`
fails on committed dashboards that no longer match).

prometheus/ is not a package (it holds configs and a script), so the script is loaded by path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["GENERATOR", "generator", "tunables"]

#: The rule generator script.
GENERATOR = Path(__file__).resolve().parent.parent / "prometheus" / "generate_rules.py"


def generator() -> ModuleType:
    """prometheus/generate_rules.py, loaded once."""
    name = "_rankscope_generate_rules"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GENERATOR)
        assert spec and spec.loader, GENERATOR
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


def tunables() -> Any:
    """The shipped tunables (the defaults the committed rules are generated from)."""
    return generator().Tunables()
