"""rankscope's exporter: per-rank Prometheus metrics for any PyTorch training loop.

Public API (everything else is private to the package):

- :class:`Monitor`, :class:`MonitorConfig`, :func:`create_monitor` - record and serve metrics.
- :class:`NullMonitor` - the same calls, doing nothing, for runs with monitoring off.
- :class:`RankIdentity` - run id, rank, local rank and node, from torchrun's environment.
- :data:`METRICS`, :func:`metric`, :class:`MetricSpec` - the metric contract.
- :class:`MetricsPortInUse` - raised when a rank's metrics port is taken.
- :func:`set_log_level` - how much rankscope prints to stderr ("off" silences it; or RANKSCOPE_LOG_LEVEL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._lazy import lazy_attributes

if TYPE_CHECKING:  # for type checkers; at run time each name is imported on first use (no torch for the CLI)
    from ._log import set_log_level
    from .config import MonitorConfig, config_from_mapping
    from .contract import IDENTITY_LABELS, METRICS, MetricKind, MetricSpec, metric
    from .discovery import write_file_sd
    from .identity import RankIdentity
    from .monitor import Monitor, StepContext
    from .null import NullMonitor
    from .server import MetricsPortInUse

_WHERE = {
    "set_log_level": "._log",
    "MonitorConfig": ".config",
    "config_from_mapping": ".config",
    "IDENTITY_LABELS": ".contract",
    "METRICS": ".contract",
    "MetricKind": ".contract",
    "MetricSpec": ".contract",
    "metric": ".contract",
    "write_file_sd": ".discovery",
    "RankIdentity": ".identity",
    "Monitor": ".monitor",
    "StepContext": ".monitor",
    "NullMonitor": ".null",
    "MetricsPortInUse": ".server",
}

__all__ = [
    "IDENTITY_LABELS",
    "METRICS",
    "MetricKind",
    "MetricSpec",
    "MetricsPortInUse",
    "Monitor",
    "MonitorConfig",
    "NullMonitor",
    "RankIdentity",
    "StepContext",
    "config_from_mapping",
    "create_monitor",
    "metric",
    "set_log_level",
    "write_file_sd",
]

__getattr__ = lazy_attributes(__name__, _WHERE, globals())


def __dir__() -> list[str]:
    return __all__


def create_monitor(config: MonitorConfig | None = None, **kwargs: Any) -> Monitor | NullMonitor:
    """A Monitor, or a NullMonitor when `config.enabled` is False."""
    from .config import MonitorConfig
    from .monitor import Monitor
    from .null import NullMonitor

    config = config or MonitorConfig()
    return Monitor(config, **kwargs) if config.enabled else NullMonitor()  # type: ignore[arg-type]
