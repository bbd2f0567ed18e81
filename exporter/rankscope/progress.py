"""What this rank is doing and since when, served by the metrics thread so a hang cannot freeze it.

The training thread only replaces one tuple (phase index, Unix time it began): a single attribute store,
atomic under the GIL, no lock. The scrape (the metrics server's thread, which keeps running while the
training thread is blocked in a collective, a data loader or I/O) reads it and, while the loop is
computing, asks the collective view whether a collective started since the step began is still in flight:
then the rank is shown 'collective', since the time that collective started.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rankscope.contract import PHASES, PREFIX, metric

if TYPE_CHECKING:
    from rankscope.collectives import CollectiveView

__all__ = ["PHASE_INDEX", "CollectivesCollector", "ProgressTracker"]

PHASE_INDEX: dict[str, int] = {name: index for index, name in enumerate(PHASES)}
_COMPUTE = PHASE_INDEX["compute"]
_COLLECTIVE = PHASE_INDEX["collective"]


class ProgressTracker:
    """The current phase of the training thread (`state`: (index, since)) and a stack for nested phases."""

    def __init__(self) -> None:
        self.state: tuple[int, float] = (PHASE_INDEX["idle"], time.time())
        self.step_started = 0.0  # Unix time the current step's work began (collectives older are not its own)
        self._held: list[tuple[int, float]] = []

    def set(self, index: int) -> None:
        """Enter phase `index` now (no-op if already in it: 'since' keeps the first entry)."""
        if self.state[0] != index:
            self.state = (index, time.time())

    def begin_step(self) -> None:
        self.step_started = time.time()
        self.set(_COMPUTE)

    @contextmanager
    def holding(self, name: str) -> Iterator[None]:
        """Phase `name` for the block, then back to what came before (since the time it began then)."""
        index = _index(name)
        self._held.append(self.state)
        self.state = (index, time.time())
        try:
            yield
        finally:
            self.state = self._held.pop()

    def current(self, view: CollectiveView | None) -> tuple[int, float]:
        """(phase index, since), as a scrape shows it."""
        index, since = self.state
        if index == _COMPUTE and view is not None:
            flight = view.in_flight
            if flight is not None and flight.started >= self.step_started:
                return _COLLECTIVE, max(flight.started, since)
        return index, since


def _index(name: str) -> int:
    try:
        return PHASE_INDEX[name]
    except KeyError:
        raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}") from None


class CollectivesCollector:
    """Serves phase, collective counts and collective seconds; reads the view first (metrics thread)."""

    def __init__(self, tracker: ProgressTracker, view: CollectiveView | None, labels: dict[str, str]) -> None:
        self._tracker = tracker
        self._view = view
        self._names = list(labels)
        self._values = list(labels.values())
        self._on_error: Any = None

    def describe(self) -> list[Any]:
        return []  # collected on every scrape, never at registration

    def collect(self) -> Iterator[Any]:
        view = self._view
        if view is not None:
            try:
                view.read()
            except Exception as exc:  # a torch change must not take the page down: phases still served
                view.enabled = False
                view.why_off = f"reading the Flight Recorder failed: {exc!r}"
                if self._on_error is not None:
                    self._on_error(exc)
        index, since = self._tracker.current(view if view is not None and view.enabled else None)
        phase = GaugeMetricFamily(PREFIX + "phase", metric("phase").help, labels=self._names)
        phase.add_metric(self._values, index)
        yield phase
        began = metric("phase_started_timestamp_seconds")
        started = GaugeMetricFamily(began.name, began.help, labels=self._names)
        started.add_metric(self._values, since)
        yield started
        if view is None or not view.enabled:
            return
        count = metric("collectives_total")
        counts = CounterMetricFamily(count.client_name, count.help, labels=[*self._names, "dim"])
        for dim, number in sorted(view.started_by_dim().items()):
            counts.add_metric([*self._values, dim], number)
        yield counts
        secs = metric("collective_seconds_total")
        seconds = CounterMetricFamily(secs.client_name, secs.help, labels=[*self._names, "kind", "dim"])
        for (kind, dim), spent in sorted(view.seconds_by_kind_dim().items()):
            seconds.add_metric([*self._values, kind, dim], spent)
        yield seconds
