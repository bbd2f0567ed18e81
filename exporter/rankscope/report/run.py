"""Which run the report is about, and over which time window and resolution.

The run is the set of series with one `run_id` label. Its window runs from the
first to the last sample of `rankscope_global_step` (every rank serves it from
start-up to exit), found with subqueries over growing look-back windows, so a
recent run costs a look at the last hour and an old one at most :data:`LOOKBACKS`'
last entry. The scrape interval is estimated from the samples themselves, which
works on any Prometheus-compatible store (no config API needed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from rankscope.report.errors import ReportError
from rankscope.report.prom import Prometheus

__all__ = ["LOOKBACKS", "RunWindow", "find_run", "known_runs", "label_matcher"]

#: Look-back windows tried in turn (seconds): an hour, a day, a week, 30 days.
LOOKBACKS: tuple[int, ...] = (3600, 86400, 7 * 86400, 30 * 86400)
#: The series that says a rank of a run exists (0 until its first step).
PRESENCE = "rankscope_global_step"
#: Points a figure is drawn with at most: plenty for 1280 px.
TARGET_POINTS = 1200


def label_matcher(name: str, value: str) -> str:
    """`name="value"` with the value escaped as PromQL wants it."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{name}="{escaped}"'


def _resolution(lookback: float) -> int:
    # Coarse enough to keep a subquery cheap, fine enough never to step over a whole run (each point
    # looks back Prometheus's 5 min staleness window, so 60 s cannot miss a series).
    return max(1, min(60, math.ceil(lookback / 2000)))


@dataclass(frozen=True)
class RunWindow:
    """A run as Prometheus holds it."""

    run_id: str
    start: float
    """Unix time of the run's first sample."""
    end: float
    """Unix time of its last sample (close to now while the run is live)."""
    interval: float
    """Seconds between two scrapes of a rank (estimated from the samples)."""
    ranks: int
    """Ranks seen."""
    max_step: int
    """The highest step any rank reported."""
    live: bool
    """True if the last sample is recent (within a few scrape intervals of now)."""

    @property
    def selector(self) -> str:
        """The label matcher every query of the report uses."""
        return label_matcher("run_id", self.run_id)

    @property
    def duration(self) -> float:
        return max(self.end - self.start, self.interval)

    @property
    def step(self) -> float:
        """Resolution of the report's range queries: every scrape, or coarser for long runs."""
        return float(max(math.ceil(self.interval), math.ceil(self.duration / TARGET_POINTS)))

    @property
    def rate_window(self) -> str:
        """Window for rate(): 4 scrapes at least, and a step plus a scrape (as Grafana's $__rate_interval)."""
        return f"{math.ceil(max(4 * self.interval, self.step + self.interval))}s"


def _presence_times(fn: str, selector: str, lookback: int, by: str = "") -> str:
    """`fn` (max/min) over the window of the sample times of the presence series, aggregated (by `by`)."""
    window = f"[{lookback}s:{_resolution(lookback)}s]"
    outer = f"{fn} by ({by})" if by else fn
    return f"{outer} ({fn}_over_time(timestamp({PRESENCE}{{{selector}}}){window}))"


def _latest(prom: Prometheus, selector: str, lookback: int, now: float, by: str = "") -> dict[str, float]:
    """The newest sample time of the presence series in the last `lookback` seconds, per `by` label ("" = all).

    A subquery's points sit at multiples of its resolution, so the newest one can be up to that much
    before `now`: an instant lookup covers samples younger than it (a run that started seconds ago).
    """
    outer = f"max by ({by})" if by else "max"
    newest: dict[str, float] = {}
    for expr in (_presence_times("max", selector, lookback, by), f"{outer} (timestamp({PRESENCE}{{{selector}}}))"):
        for series in prom.query(expr, now):
            key = series.labels.get(by, "") if by else ""
            if len(series) and (not by or key):
                newest[key] = max(newest.get(key, -math.inf), float(series.v[-1]))
    return newest


def known_runs(prom: Prometheus, now: float, lookback: int = LOOKBACKS[-1]) -> list[str]:
    """run_id values of the rankscope runs seen in the last `lookback` seconds, newest first."""
    newest = _latest(prom, 'run_id!=""', lookback, now, by="run_id")
    return sorted(newest, key=lambda run_id: -newest[run_id])


def _newest_run(prom: Prometheus, now: float) -> str:
    for lookback in LOOKBACKS:
        runs = known_runs(prom, now, lookback)
        if runs:
            return runs[0]
    raise ReportError(
        f"Prometheus at {prom.url} holds no rankscope run from the last {LOOKBACKS[-1] // 86400} days "
        f"(no {PRESENCE} series): is it scraping the trainer's ranks?"
    )


def _median_spacing(times: list[np.ndarray]) -> float | None:
    gaps = np.concatenate([np.diff(t) for t in times if len(t) > 1] or [np.array([])])
    return float(np.median(gaps)) if len(gaps) else None


def _edges(prom: Prometheus, selector: str, now: float) -> tuple[float, float, float | None] | None:
    """(first sample, last sample, scrape interval or None) of the run, or None if it has no sample."""
    for lookback in LOOKBACKS:
        last = _latest(prom, selector, lookback, now).get("")
        if last is None:
            continue
        first = prom.scalar(_presence_times("min", selector, lookback), now)
        if first is None:  # younger than the subquery's resolution: the raw samples below find its start
            first = last
        res = _resolution(lookback)
        # A first sample at the window's very edge means the run is older: look further back.
        if first - (now - lookback) <= 2 * res + 300 and lookback != LOOKBACKS[-1]:
            continue
        # The coarse first point is up to `res` late; the raw samples around it say exactly, and
        # their spacing is the scrape interval.
        raw = prom.query(f"{PRESENCE}{{{selector}}}[{2 * res + 300}s]", min(first + res, last))
        starts = [float(s.t[0]) for s in raw if len(s)]
        return (min(starts) if starts else first), last, _median_spacing([s.t for s in raw])
    return None


def find_run(prom: Prometheus, run_id: str | None = None, now: float | None = None) -> RunWindow:
    """The run `run_id` (default: the one with the newest samples) as Prometheus holds it.

    ReportError (one line) for an unreachable Prometheus, an unknown run (naming the runs
    there are) and a run that has not completed a step yet.
    """
    now = time.time() if now is None else now
    prom.ping()
    run_id = run_id or _newest_run(prom, now)
    selector = label_matcher("run_id", run_id)
    edges = _edges(prom, selector, now)
    if edges is None:
        runs = known_runs(prom, now)
        seen = f"runs there: {', '.join(runs[:10])}{' ...' if len(runs) > 10 else ''}" if runs else "it holds no run"
        raise ReportError(f"no run with run_id {run_id!r} in Prometheus at {prom.url} ({seen})")
    start, end, interval = edges
    span = f"{max(1, math.ceil(end - start)) + 1}s"
    max_step = prom.scalar(f"max(max_over_time({PRESENCE}{{{selector}}}[{span}]))", end) or 0.0
    if max_step < 1:
        raise ReportError(
            f"run {run_id!r} has no data yet: its ranks are scraped but none has completed a training step "
            "(run the report again once it has trained for a while)"
        )
    counts = prom.query(f"count_over_time({PRESENCE}{{{selector}}}[{span}])", end)
    if interval is None:  # a single sample near the start: average over the whole run instead
        samples = max((float(s.v[-1]) for s in counts if len(s)), default=1.0)
        interval = (end - start) / (samples - 1) if samples > 1 else 15.0
    # Scrape intervals are set in whole seconds; the samples' spacing jitters around them by milliseconds.
    interval = (
        float(round(interval)) if interval >= 1 and abs(interval - round(interval)) <= 0.05 * interval else interval
    )
    interval = max(0.001, round(interval, 3))
    return RunWindow(
        run_id=run_id,
        start=start,
        end=end,
        interval=interval,
        ranks=len({s.labels.get("rank") for s in counts}),
        max_step=int(max_step),
        live=now - end < max(3 * interval, 30.0),
    )
