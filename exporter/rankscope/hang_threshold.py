"""When a run is hung: one definition for the rule pack's hang alert and the goodput ledger's `hang`.

A run is hung once no step has ended, and no checkpoint, validation or pause has ended, for longer than
max(`floor_seconds`, `step_multiple` x its recent step time). The hang began at that last activity: the
whole gap is the hang, not only its part beyond the threshold. Start-up and the first step of each
incarnation (compilation, a checkpoint load) are never a hang: nothing has ended yet to be late after.

The recent step time is the mean time of the steps that ended within `window_seconds` of the last one, kept
while no step ends (a hang) for up to `lookback_seconds`. It follows the run: a long first step (compilation)
weighs in only until faster steps outnumber it, and a run that slows down gets a longer threshold as its
steps do. The defaults below are the shipped ones of both: `rankscope.config.MonitorConfig` (the ledger) and
`rankscope.mixin.config.Tunables` (the rules) read them, so the two cannot drift.
"""

from __future__ import annotations

import re
from collections import deque

__all__ = [
    "FLOOR_SECONDS",
    "LOOKBACK_SECONDS",
    "STEP_MULTIPLE",
    "WINDOW_SECONDS",
    "HangThreshold",
    "duration",
    "duration_seconds",
]

#: Never hung sooner than this after the last activity. At 1 s scrape and evaluation intervals the alert fires
#: within a second of it (the stall is the Unix time of the last step, not a count the scrape must see change):
#: a hang pages within 10 s. What is slow but not hung is excused, not measured against it: start-up and each
#: incarnation's first step (no step completed yet), checkpoints, validation and pauses (until the threshold
#: after they end), and steps slower than a tenth of it (the threshold is then 10 x the step time).
FLOOR_SECONDS = 8.0
#: Hung after this many recent step times without a step.
STEP_MULTIPLE = 10.0
#: The recent step time: the mean over this window...
WINDOW_SECONDS = 300.0
#: ...kept this long after the last step.
LOOKBACK_SECONDS = 3600.0

_UNITS = (("h", 3600), ("m", 60), ("s", 1))
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration(seconds: float) -> str:
    """Whole seconds as a Prometheus duration in its largest whole unit: 300 -> 5m, 3600 -> 1h, 90 -> 90s."""
    if seconds <= 0 or seconds != int(seconds):
        raise ValueError(f"a rule duration must be a positive whole number of seconds, got {seconds!r}")
    return next(f"{int(seconds) // size}{unit}" for unit, size in _UNITS if int(seconds) % size == 0)


def duration_seconds(text: str) -> float:
    """A Prometheus duration (``1h30m``, ``90s``) in seconds."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration such as 30s or 5m: {text!r}")
    return sum(int(number) * _SECONDS[unit] for number, unit in parts)


class HangThreshold:
    """The hang threshold as steps end: `add_step` each step, `seconds(now)` the gap beyond which it is a hang.

    Not thread-safe: the goodput ledger calls it under its lock."""

    def __init__(
        self,
        floor_seconds: float = FLOOR_SECONDS,
        step_multiple: float = STEP_MULTIPLE,
        window_seconds: float = WINDOW_SECONDS,
        lookback_seconds: float = LOOKBACK_SECONDS,
    ) -> None:
        self.floor_seconds = floor_seconds
        self.step_multiple = step_multiple
        self.window_seconds = window_seconds
        self.lookback_seconds = lookback_seconds
        self._steps: deque[tuple[float, float]] = deque()  # (ended, seconds) within the window of the last one
        self._sum = 0.0

    def add_step(self, ended: float, seconds: float) -> None:
        """A step of `seconds` ended at `ended` (Unix seconds)."""
        self._steps.append((ended, seconds))
        self._sum += seconds
        while self._steps[0][0] <= ended - self.window_seconds:
            self._sum -= self._steps.popleft()[1]

    def recent_step_seconds(self, now: float) -> float | None:
        """The mean of the window up to the last step; None without a step within the lookback."""
        if not self._steps or self._steps[-1][0] <= now - self.lookback_seconds:
            return None
        return max(0.0, self._sum) / len(self._steps)

    def seconds(self, now: float) -> float:
        """A gap without activity longer than this, at `now`, is a hang."""
        recent = self.recent_step_seconds(now)
        return self.floor_seconds if recent is None else max(self.floor_seconds, self.step_multiple * recent)
