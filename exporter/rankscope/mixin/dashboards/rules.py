"""The rule generator's tunables and recorded series' names, as the dashboards read them.

rankscope.mixin.rules is the one source of every threshold, window, `for` and severity (its
:class:`Tunables`) and of the recorded series' names. The dashboards draw the alerts' thresholds
and name the series the rules record from here, so a changed threshold or a renamed series changes
the dashboards when they are regenerated (and `tests/test_grafana_dashboards.py` fails on committed
dashboards that no longer match).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from rankscope.mixin import rules

__all__ = ["generator", "tunables"]


def generator() -> ModuleType:
    """The rule generator module."""
    return rules


def tunables() -> Any:
    """The shipped tunables (the defaults the committed rules are generated from)."""
    return rules.Tunables()
