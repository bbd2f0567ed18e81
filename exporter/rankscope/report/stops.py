"""Stretches in which a rank made no step (a hang, a restart, a long pause), from its own last-step time.

`rankscope_last_step_timestamp_seconds` is the unix time of the rank's latest step, so Prometheus's samples
of it say when the rank last stepped, whatever its timing histograms say: their rates are means over a
window and go on reading a normal step time for a while after the steps stop, then are absent. A stop
runs from the rank's last step before it to the last sample that still showed no newer step (or, across a
gap in the samples, a restart, to just before the rank was back); `rankscope_phase` in it says what the rank
was doing (data wait, collective, ...).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankscope.contract import PHASES
from rankscope.hang_threshold import FLOOR_SECONDS, STEP_MULTIPLE
from rankscope.report.series import Series

__all__ = ["STOP_FLOOR_SECONDS", "STOP_STEP_MULTIPLE", "Stop", "find_stops", "mask_stops", "phase_words"]

#: A stretch this long without a step is a stop: the hang's floor and multiple (one definition, with the alert and
#: the ledger), read here against the rank's median step time and never below 3 scrape intervals (the samples' lag).
STOP_FLOOR_SECONDS = FLOOR_SECONDS
STOP_STEP_MULTIPLE = STEP_MULTIPLE


@dataclass(frozen=True)
class Stop:
    rank: int
    start: float
    """The rank's last step before the stop."""
    end: float
    """The last sample that still showed no newer step (the stop lasted at least until then)."""
    phase: str = ""
    """What the rank was doing in it, most of the samples ("" where rankscope_phase is not exported)."""
    open: bool = False
    """Still stopped at the rank's last sample."""


def _grid(series: Series) -> float:
    steps = np.diff(series.t)
    steps = steps[steps > 0]
    return float(steps.min()) if steps.size else math.inf


def _phase(phases: Series | None, start: float, end: float) -> str:
    if phases is None:
        return ""
    inside = phases.v[(phases.t > start) & (phases.t <= end) & np.isfinite(phases.v)]
    if not inside.size:
        return ""
    index = int(Counter(int(v) for v in inside).most_common(1)[0][0])
    return PHASES[index] if 0 <= index < len(PHASES) else ""


def find_stops(
    last_step: Sequence[Series],
    interval: float,
    step_time: Sequence[Series] = (),
    phases: Sequence[Series] = (),
    to_the_end: bool = True,
) -> list[Stop]:
    """Each rank's stops, in time order: stretches longer than max(STOP_FLOOR_SECONDS, 3 scrape intervals,
    STOP_STEP_MULTIPLE x the rank's median step time) without a step. `to_the_end`: a rank that made no step
    from some time to its last sample stopped there (not for a run that finished)."""
    steps = {s.rank: float(np.nanmedian(s.v)) for s in step_time if s.rank is not None and len(s)}
    phase_of = {s.rank: s for s in phases if s.rank is not None}
    found: list[Stop] = []
    for s in last_step:
        rank = s.rank
        if rank is None or not len(s):
            continue
        threshold = max(STOP_FLOOR_SECONDS, 3 * interval, STOP_STEP_MULTIPLE * steps.get(rank, 0.0))
        grid = _grid(s)
        latest = math.nan  # the rank's latest step seen
        for i, (t, value) in enumerate(zip(s.t, s.v, strict=True)):
            newer = value > 0 and not (value <= latest)  # 0: a new incarnation that has not stepped yet
            if not newer:
                continue
            if math.isfinite(latest) and i:
                before = float(s.t[i - 1])
                # Across a gap the rank was not there to step: the stop reaches the sample before it was back.
                end = max(before, float(t) - grid) if float(t) - before > 1.5 * grid else before
                end = min(end, float(value))
                if end - latest > threshold:
                    found.append(Stop(rank, latest, end, _phase(phase_of.get(rank), latest, end)))
            latest = float(value)
        end = float(s.t[-1])
        if to_the_end and math.isfinite(latest) and end - latest > threshold:
            found.append(Stop(rank, latest, end, _phase(phase_of.get(rank), latest, end), open=True))
    return sorted(found, key=lambda stop: (stop.start, stop.rank))


def mask_stops(series: Series, stops: Sequence[Stop], gaps: bool = True) -> Series:
    """`series` with NaN in its rank's stops, or in every stop for a series of no rank (an aggregate: no new
    value came from the stopped rank), so a line breaks there (a rate-window mean there is of the steps before
    the stop, a gauge holds its last step's value), and between two points on either side of a stop; with
    `gaps` (a range query's series, on a regular grid) a NaN between points further apart than its grid (no
    sample, no line across)."""
    t, v = series.t.copy(), series.v.copy()
    apart = np.zeros(max(len(t) - 1, 0), dtype=bool)  # between points i and i + 1 the line must break
    for stop in stops:
        if series.rank is None or stop.rank == series.rank:
            v[(t > stop.start) & (t <= stop.end)] = np.nan
            apart |= (t[:-1] <= stop.start) & (t[1:] >= stop.end)  # sparse points (validations) on either side
    grid = _grid(series)
    if gaps and math.isfinite(grid) and len(t) > 1:
        apart |= np.diff(t) > 1.5 * grid
    if apart.any():
        cuts = np.flatnonzero(apart) + 1
        t = np.insert(t, cuts, (t[cuts - 1] + t[cuts]) / 2)
        v = np.insert(v, cuts, np.nan)
    return Series(dict(series.labels), t, v, series.name)


def phase_words(phase: str) -> str:
    """A phase as words: data_wait -> data wait."""
    return phase.replace("_", " ")
