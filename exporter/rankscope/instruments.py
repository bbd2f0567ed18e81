"""prometheus_client objects for the contract's metrics, bound to one rank.

Every series gets the rank's identity labels; callers pass only the extras.
Children are cached because `.labels()` is a dict lookup plus a lock, and
the training loop asks for the same few children every step.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary

from rankscope.contract import IDENTITY_LABELS, METRICS, MetricKind, MetricSpec
from rankscope.identity import RankIdentity

__all__ = ["BeforeRender", "Instruments", "observe_all"]

_CLIENT_TYPES = {
    MetricKind.COUNTER: Counter,
    MetricKind.GAUGE: Gauge,
    MetricKind.HISTOGRAM: Histogram,
    MetricKind.SUMMARY: Summary,
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
        extra: Iterable[MetricSpec] = (),
    ) -> None:
        """`specs`: which contract metrics (default: all but the scrape-time probes); `extra`: metrics of
        the loop's own, declared as MetricSpec (same conventions, checked when each spec is built)."""
        # Probes, the goodput ledger, collectives and progress have collectors of their own, run at scrape time.
        scraped = ("probe", "goodput", "collectives", "progress")
        chosen = list(specs if specs is not None else (s for s in METRICS.values() if s.source not in scraped))
        for spec in extra:
            if not isinstance(spec, MetricSpec):
                raise TypeError(f"extra metrics are MetricSpec declarations, got {type(spec).__name__}")
            if spec.name in METRICS or any(spec.name == c.name for c in chosen):
                raise ValueError(f"metric {spec.name!r} is declared twice (rankscope's contract already has it)")
            chosen.append(spec)
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
            raise KeyError(
                f"metric {name!r} is not in the contract (rankscope.contract.METRICS) nor among this monitor's "
                "extra_metrics"
            ) from None
        if set(labels) != set(_child_labels(spec)):
            raise ValueError(f"{name} takes labels {list(_child_labels(spec))}, got {sorted(labels)}")
        with self._lock:
            found = self._children.get(key)
            if found is None:
                found = parent.labels(**self._identity, **{k: str(v) for k, v in labels.items()})
                self._children[key] = found
        return found


def observe_all(child: Any, values: Sequence[float]) -> None:
    """Observe every value into a histogram or summary child: what a loop of `child.observe(v)` does, cheaper.

    A batch statistic (caption lengths, image sizes) brings dozens of values per step; this adds
    one increment per touched bucket (a summary: to its count) instead of one `observe` call per value.
    It relies on the client's internals (`_upper_bounds`, `_buckets`, `_sum`; a summary's `_count`,
    `_sum`), so where they are missing (another prometheus_client version) or a value is NaN, it falls
    back to the plain loop.
    """
    bounds, buckets, count, total = (getattr(child, a, None) for a in ("_upper_bounds", "_buckets", "_count", "_sum"))
    if total is not None and not any(math.isnan(v) for v in values):
        if bounds is not None and buckets is not None and count is None:  # a histogram
            # The first bound >= value is the bucket `observe` picks (amount <= bound); +Inf catches the rest.
            for index, hits in Tally(bisect_left(bounds, value) for value in values).items():
                buckets[index].inc(hits)
            total.inc(math.fsum(values))
            return
        if count is not None and bounds is None:  # a summary
            count.inc(len(values))
            total.inc(math.fsum(values))
            return
    for value in values:
        child.observe(value)


class BeforeRender:
    """A collector without metrics of its own that runs `refresh` whenever the page is collected: rankscope's
    renderer collects collectors before it reads the metrics, so what `refresh` sets shows on that page."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        self._refresh = refresh

    def describe(self) -> list[Any]:
        return []  # registering it never runs `refresh`

    def collect(self) -> list[Any]:
        self._refresh()
        return []
