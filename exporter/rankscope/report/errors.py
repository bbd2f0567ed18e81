"""The one exception of the report: a problem the user can act on, said in one line."""

from __future__ import annotations

__all__ = ["ReportError"]


class ReportError(Exception):
    """Prometheus unreachable, an unknown run, no data yet, an unreadable log: one line for the user."""
