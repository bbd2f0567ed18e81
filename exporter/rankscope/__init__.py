"""rankscope's exporter: per-rank Prometheus metrics for any PyTorch training loop.

Public API (everything else is private to the package):

- :class:`Monitor`, :class:`MonitorConfig`, :func:`create_monitor` - record and serve metrics.
- :class:`NullMonitor` - the same calls, doing nothing, for runs with monitoring off.
- :class:`RankIdentity` - run id, rank, local rank and node, from torchrun's environment.
- :data:`METRICS`, :func:`metric`, :class:`MetricSpec` - the metric contract.
- :class:`MetricsPortInUse` - raised when a rank's metrics port is taken.
- :func:`enable_collective_view` - make sure torch's Flight Recorder records collectives (before init_process_group).
- :func:`set_log_level` - how much rankscope prints to stderr ("off" silences it; or RANKSCOPE_LOG_LEVEL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rankscope._lazy import lazy_attributes

if TYPE_CHECKING:  # for type checkers; at run time each name is imported on first use (no torch for the CLI)
    from rankscope._log import set_log_level
    from rankscope.collectives import enable_collective_view
    from rankscope.config import MonitorConfig, config_from_mapping
    from rankscope.contract import IDENTITY_LABELS, METRICS, MetricKind, MetricSpec, metric
    from rankscope.identity import RankIdentity
    from rankscope.monitor import Monitor, StepContext
    from rankscope.null import NullMonitor
    from rankscope.serving.discovery import write_file_sd
    from rankscope.serving.metrics_endpoint import MetricsPortInUse

_WHERE = {
    "set_log_level": "._log",
    "enable_collective_view": ".collectives",
    "MonitorConfig": ".config",
    "config_from_mapping": ".config",
    "IDENTITY_LABELS": ".contract",
    "METRICS": ".contract",
    "MetricKind": ".contract",
    "MetricSpec": ".contract",
    "metric": ".contract",
    "write_file_sd": ".serving.discovery",
    "RankIdentity": ".identity",
    "Monitor": ".monitor",
    "StepContext": ".monitor",
    "NullMonitor": ".null",
    "MetricsPortInUse": ".serving.metrics_endpoint",
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
    "enable_collective_view",
    "metric",
    "set_log_level",
    "write_file_sd",
]

__getattr__ = lazy_attributes(__name__, _WHERE, globals())


def __dir__() -> list[str]:
    return __all__


def create_monitor(config: MonitorConfig | None = None, **kwargs: Any) -> Monitor | NullMonitor:
    """A Monitor, or a NullMonitor when `config.enabled` is False."""
    from rankscope.config import MonitorConfig
    from rankscope.monitor import Monitor
    from rankscope.null import NullMonitor

    config = config or MonitorConfig()
    return Monitor(config, **kwargs) if config.enabled else NullMonitor()
