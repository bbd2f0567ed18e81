"""prometheus_client objects for the contract's metrics, bound to one rank.

Every series gets the rank's identity labels; callers pass only the extras.
Children are cached because `.labels()` is a dict lookup plus a lock, and
the training loop asks for the same few children every step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from .contract import IDENTITY_LABELS, METRICS, MetricKind, MetricSpec
from .identity import RankIdentity

__all__ = ["Instruments"]

_CLIENT_TYPES = {
    MetricKind.COUNTER: Counter,
    MetricKind.GAUGE: Gauge,
    MetricKind.HISTOGRAM: Histogram,
    MetricKind.INFO: Info,
}


def _child_labels(spec: MetricSpec) -> tuple[str, ...]:
    # An info metric's `labels` are the keys of its info dict, set through .info().
    return () if spec.kind is MetricKind.INFO else spec.labels


def _build(spec: MetricSpec, registry: CollectorRegistry) -> Any:
    kwargs: dict[str, Any] = {"labelnames": IDENTITY_LABELS + _child_labels(spec), "registry": registry}
    if spec.kind is MetricKind.HISTOGRAM:
        kwargs["buckets"] = spec.buckets
    return _CLIENT_TYPES[spec.kind](spec.client_name, spec.help, **kwargs)


class Instruments:
    """The contract's metrics (except scrape-time probes) registered in one registry.

    Thread-safe: the control endpoint and the training loop record from
    different threads.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        identity: RankIdentity,
        specs: Iterable[MetricSpec] | None = None,
    ) -> None:
        chosen = specs if specs is not None else (s for s in METRICS.values() if s.source != "probe")
        self._metrics = {spec.name: (spec, _build(spec, registry)) for spec in chosen}
        self._identity = identity.labels()
        self._children: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self._metrics

    def child(self, name: str, **labels: str) -> Any:
        """The labelled child of `name` (full exposed name) for this rank."""
        key = (name, tuple(sorted(labels.items())))
        found = self._children.get(key)
        if found is not None:
            return found
        try:
            spec, parent = self._metrics[name]
        except KeyError:
            raise KeyError(f"metric {name!r} is not in the contract (exporter.contract.METRICS)") from None
        if set(labels) != set(_child_labels(spec)):
            raise ValueError(f"{name} takes labels {list(_child_labels(spec))}, got {sorted(labels)}")
        with self._lock:
            found = self._children.get(key)
            if found is None:
                found = parent.labels(**self._identity, **{k: str(v) for k, v in labels.items()})
                self._children[key] = found
        return found
