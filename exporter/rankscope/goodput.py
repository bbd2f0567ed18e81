"""Goodput: where the job's wall time went, kept across restarts (docs/goodput.md).

The job's wall time, from the first incarnation's process start to now, is split into buckets that add up
to it: `startup` (process start to the first step, checkpoint load included, and the time between one
incarnation's last record and the next one's process start: the restart), `training` (steps and the loop
between them), `checkpoint`, `validation`, `paused` (phases the loop or the control channel marks) and
`hang`: a gap without activity (no step ended, no phase ended) longer than the hang threshold, counted whole
from that last activity, as the rule pack's hang alert reads it (:mod:`rankscope.hang_threshold`). `lost` is the part of
`training` whose steps were thrown away: trained after the checkpoint a resume or a rollback went back to.
Productive time, the goodput's numerator, is `training - lost`.

Only rank 0 keeps the ledger (the buckets are the job's, not a rank's). It writes it, atomically, to
`rankscope-goodput.json` in the run's state directory (beside the checkpoints) every `flush_seconds`
from a background thread, and the next incarnation continues from it. Every value is a counter: nothing
ever decreases, so Prometheus adds them up across restarts with increase()/rate().
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from rankscope._files import write_atomically
from rankscope.contract import METRICS, PREFIX
from rankscope.hang_threshold import FLOOR_SECONDS, STEP_MULTIPLE, HangThreshold

__all__ = ["BUCKETS", "LEDGER_FILE", "PHASE_BUCKETS", "GoodputCollector", "GoodputLedger", "process_start_time"]

logger = logging.getLogger("rankscope")

#: Every bucket, in the order a report stacks them. `lost` is part of `training` (see the module docstring).
BUCKETS: tuple[str, ...] = ("startup", "training", "lost", "checkpoint", "validation", "paused", "hang")
#: Buckets a loop (or the control channel) enters with Monitor.phase().
PHASE_BUCKETS: tuple[str, ...] = ("checkpoint", "validation", "paused")
LEDGER_FILE = "rankscope-goodput.json"
_FORMAT = 1
_METRIC = PREFIX + "goodput_seconds_total"


def process_start_time(default: float) -> float:
    """Unix time this process started (psutil), or `default` where that cannot be read."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # no psutil, or no permission: the monitor's creation is the next best start
        return default


class GoodputLedger:
    """The job's time accounting, on rank 0. Thread-safe: the loop records, the scrape and the flusher read.

    Timestamps are Unix seconds (`clock`, time.time by default): the ledger outlives the process."""

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        process_start: float | None = None,
        hang_floor_seconds: float = FLOOR_SECONDS,
        hang_step_multiple: float = STEP_MULTIPLE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self.path = Path(directory) / LEDGER_FILE if directory else None
        self.hang = HangThreshold(hang_floor_seconds, hang_step_multiple)
        started = process_start if process_start is not None else clock()
        self._lock = threading.Lock()
        self._closed = dict.fromkeys(BUCKETS, 0.0)  # closed intervals (and whole earlier incarnations)
        self._marks: dict[int, float] = {0: 0.0}  # checkpointed step -> kept training seconds at it
        self.step = 0  # the latest step trained
        self.job_start = started
        self.incarnation = 1
        previous = self._read()
        if previous is not None:
            self.job_start = float(previous["job_start"])
            self.incarnation = int(previous["incarnation"]) + 1
            self.step = int(previous["step"])
            self._marks = {int(step): float(kept) for step, kept in previous["marks"].items()}
            for bucket in BUCKETS:
                self._closed[bucket] = float(previous["totals"].get(bucket, 0.0))
            # From the last record of the incarnation before to this process's start: the restart. A process
            # start read from psutil (boot time in whole seconds plus clock ticks) can be up to a second early
            # against the clock; this incarnation began no earlier than the last record of the one before.
            started = max(started, float(previous["updated_at"]))
            self._closed["startup"] += started - float(previous["updated_at"])
        self._state = "startup"
        self._since = started
        self._stack: list[str] = []
        # This incarnation's last step end or phase end (None until its first step ended: start-up and the first
        # step are never a hang): a gap from here longer than the hang threshold is a hang, all of it.
        self._last_activity: float | None = None
        self._last_step_end: float | None = None
        self._hang_open = 0.0  # hang seconds already cut out of the open training interval
        self._training = False  # a step has begun in this incarnation
        self._restored = False
        self._finished_at: float | None = None  # the run finished: nothing accrues after it

    # --- recording (the loop's thread) -----------------------------------------------------------------

    def first_step(self, started: float, previous_step: int) -> None:
        """The first step of this incarnation begins at `started` after `previous_step` (0 from scratch):
        start-up ends. A run that starts below the step the job had reached (restarted without a resume)
        threw the steps above away."""
        with self._lock:
            if self._training or self._finished_at is not None:
                return
            if not self._restored and previous_step < self.step:
                self._restore(previous_step, started)
            self._close(started)
            self._state = "training"
            self._training = True
            self._last_step_end = started

    def on_step(self, index: int, ended: float, seconds: float | None = None) -> None:
        """Step `index`, of `seconds` (default: since the step before ended), ended at `ended`: a gap since the
        last activity longer than the hang threshold (as it stood before this step) was a hang, all of it."""
        with self._lock:
            if self._finished_at is not None:
                return
            if self._state == "training":
                self._hang_open += self._hang(ended)
            if seconds is None:
                seconds = ended - (self._last_step_end if self._last_step_end is not None else ended)
            self.hang.add_step(ended, seconds)
            self._last_activity = self._last_step_end = ended
            self.step = index

    def restore(self, step: int) -> None:
        """The loop went back to `step` (a resume or a rollback loaded its checkpoint): the training time
        spent since that checkpoint is lost."""
        with self._lock:
            self._restored = True
            if step < self.step:
                self._restore(step, self._clock())

    def finish(self) -> None:
        """The run finished (Monitor.finish): the accounting ends now. What follows (the linger for the last
        scrapes, the teardown) is no bucket's; a later incarnation of the job (a preempted run launched again)
        counts it as its start-up, from this moment."""
        with self._lock:
            if self._finished_at is None:
                now = self._clock()
                self._close(now)
                self._stack.clear()
                self._state = "finished"
                self._finished_at = now

    def enter(self, bucket: str) -> None:
        """A phase begins (checkpoint, validation, paused); phases nest."""
        if bucket not in PHASE_BUCKETS:
            raise ValueError(f"unknown goodput phase {bucket!r}; known: {', '.join(PHASE_BUCKETS)}")
        with self._lock:
            if self._finished_at is not None:
                return
            self._close(self._clock())
            self._stack.append(self._state)
            self._state = bucket

    def leave(self, saved_step: int | None = None) -> None:
        """The innermost phase ended. `saved_step`: a checkpoint of that step was written (a later resume
        or rollback to it loses only the training after it)."""
        with self._lock:
            if self._finished_at is not None:
                return
            now = self._clock()
            self._close(now)
            self._state = self._stack.pop() if self._stack else ("training" if self._training else "startup")
            if self._last_activity is not None:
                self._last_activity = now
            if saved_step is not None:
                self._marks = {s: kept for s, kept in self._marks.items() if s < saved_step}
                self._marks[saved_step] = self._kept(now)

    # --- reading (any thread) ---------------------------------------------------------------------------

    def totals(self, now: float | None = None) -> dict[str, float]:
        """Seconds per bucket up to `now` (default: the clock), as exposed: the open interval included, but not
        the time since the last activity while it is below the hang threshold. Until then it is not known to
        be training or a hang; counted either way, one bucket would have to give it back to the other, and
        the buckets are counters. It is counted when the step ends (or as hang once past the threshold)."""
        with self._lock:
            return self._totals(self._clock() if now is None else now, settled=False)

    def flush(self) -> None:
        """Write the ledger beside the checkpoints (no-op without a directory); a failure is logged, not raised."""
        if self.path is None:
            return
        with self._lock:
            now = self._clock() if self._finished_at is None else self._finished_at
            record = {
                "format": _FORMAT,
                "job_start": self.job_start,
                "updated_at": now,
                "incarnation": self.incarnation,
                "step": self.step,
                "totals": self._totals(now),
                "marks": {str(step): kept for step, kept in self._marks.items()},
            }
        data = json.dumps(record, sort_keys=True).encode()
        try:
            write_atomically(self.path, lambda handle: handle.write(data))
        except OSError as exc:
            logger.warning("rankscope: goodput ledger not written to %s: %s", self.path, exc)

    # --- internals (lock held) ------------------------------------------------------------------------

    def _hang(self, now: float) -> float:
        """The gap since the last activity if it is a hang by `now` (longer than the threshold), else 0."""
        if self._last_activity is None:
            return 0.0
        gap = now - self._last_activity
        # The threshold is never below its floor: a gap within it (every step's case) needs no more arithmetic.
        return gap if gap > self.hang.floor_seconds and gap > self.hang.seconds(now) else 0.0

    def _live_hang(self, now: float) -> float:
        return self._hang(now) if self._state == "training" else 0.0

    def _open(self, now: float, settled: bool = True) -> dict[str, float]:
        """The open interval's seconds, by bucket. `settled`: the gap since the last activity, not (yet) a hang,
        counted as training (when the interval closes, in the record a next incarnation reads), else left out."""
        if self._finished_at is not None:
            return {}
        seconds = max(0.0, now - self._since)
        if self._state != "training":
            return {self._state: seconds}
        live = self._live_hang(now)
        hang = self._hang_open + live
        pending = 0.0
        if not settled and not live and self._last_activity is not None:
            pending = max(0.0, now - self._last_activity)
        return {"training": max(0.0, seconds - hang - pending), "hang": hang}

    def _totals(self, now: float, settled: bool = True) -> dict[str, float]:
        totals = dict(self._closed)
        for bucket, seconds in self._open(now, settled).items():
            totals[bucket] += seconds
        return totals

    def _close(self, now: float) -> None:
        for bucket, seconds in self._open(now).items():
            self._closed[bucket] += seconds
        self._since = max(self._since, now)
        self._hang_open = 0.0
        if self._state == "training" and self._last_activity is not None:
            self._last_activity = max(self._last_activity, now)

    def _kept(self, now: float) -> float:
        totals = self._totals(now)
        return totals["training"] - totals["lost"]

    def _restore(self, step: int, now: float) -> None:
        self._restored = True
        base = max((s for s in self._marks if s <= step), default=0)
        thrown = self._kept(now) - self._marks.get(base, 0.0)
        if thrown > 0:
            self._closed["lost"] += thrown
        self._marks = {s: kept for s, kept in self._marks.items() if s <= step}
        self.step = step

    def _read(self) -> dict[str, Any] | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            record = json.loads(self.path.read_text())
            if record.get("format") != _FORMAT:
                raise ValueError(f"format {record.get('format')!r}, expected {_FORMAT}")
            return record
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning(
                "rankscope: goodput ledger %s unreadable, the job's accounting starts again: %s", self.path, exc
            )
            return None


class GoodputFlusher:
    """Writes the ledger every `seconds` from a daemon thread, so a crash loses at most that much."""

    def __init__(self, ledger: GoodputLedger, seconds: float) -> None:
        self._ledger = ledger
        self._seconds = seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-goodput", daemon=True)
        self._thread.start()
        # The process's last moments count too (an exception on its way out, the teardown after close()):
        # the next incarnation's restart begins where this process really ended, not at the last tick.
        atexit.register(ledger.flush)

    def _run(self) -> None:
        while not self._stop.wait(self._seconds):
            self._ledger.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ledger.flush()


class GoodputCollector(Collector):
    """Exposes the ledger's buckets as `rankscope_goodput_seconds_total{bucket}`, computed at scrape time."""

    def __init__(self, ledger: GoodputLedger, identity_labels: dict[str, str]) -> None:
        self._ledger = ledger
        self._identity = list(identity_labels.values())

    def collect(self) -> Iterator[CounterMetricFamily]:
        spec = METRICS[_METRIC]
        family = CounterMetricFamily(spec.client_name, spec.help, labels=spec.all_labels)
        for bucket, seconds in self._ledger.totals().items():
            family.add_metric([*self._identity, bucket], seconds)
        yield family

    def describe(self) -> list[CounterMetricFamily]:
        return []
