"""The trainer's JSONL run log (trainer/rankscope_trainer/logbook.py), read into arrays.

Rank 0 appends one JSON object per line: `{"type": "train", "step", "loss",
"acc_i2t", "acc_t2i", "lr", "time"}` per step, `{"type": "val", "step", "loss",
"acc_i2t", "acc_t2i", "time"}` per validation, and events (`start`, `resume`,
`checkpoint` with `reason` and `path`, `finished` with `stopped`). Non-finite
numbers are null. Train records are written in batches (one flush every
`run.log_every` steps) and carry the flush time, so each step's time is spread
evenly between two flushes, never into a stretch without steps (a hang, a restart, a
pause: see `_step_times`). Unknown record types are kept but not plotted, so a
newer trainer's log still reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.report.errors import ReportError

__all__ = ["RunLog", "read_run_log"]


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


@dataclass
class RunLog:
    """What rank 0 logged, newest record last."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Records of one `type`, in file order."""
        return [r for r in self.records if r.get("type") == kind]

    def train(self) -> dict[str, np.ndarray]:
        """Per-step arrays: step, time (see :func:`_step_times`), segment (steps that trained without a stretch
        between them share one: a plot breaks its line between segments), flushed (the record's own time,
        when its batch was written: a step happened by then), loss, acc_i2t, acc_t2i, lr."""
        records = self.of("train")
        times, segment = _step_times(self.records, len(records))
        return {
            "step": np.array([_number(r.get("step")) for r in records]),
            "time": times,
            "segment": segment,
            "flushed": np.array([_number(r.get("time")) for r in records]),
            **{key: np.array([_number(r.get(key)) for r in records]) for key in ("loss", "acc_i2t", "acc_t2i", "lr")},
        }

    def val(self) -> dict[str, np.ndarray]:
        """Per-validation arrays: step, time, loss, acc_i2t, acc_t2i."""
        records = self.of("val")
        return {
            key: np.array([_number(r.get(key)) for r in records])
            for key in ("step", "time", "loss", "acc_i2t", "acc_t2i")
        }

    @property
    def span(self) -> tuple[float, float] | None:
        """(first, last) record time, or None for an empty log."""
        times = [t for t in (_number(r.get("time")) for r in self.records) if math.isfinite(t)]
        return (min(times), max(times)) if times else None


#: Events after which the steps come from a new start: a new incarnation of the group, or a restored state.
NEW_START = frozenset({"start", "resume", "rollback"})
#: A flush this many times its normal spacing (per step) after the one before had a stretch without a step
#: in between (a hang, a pause, a long validation): its steps are not spread into that stretch.
STRETCH = 2.0


@dataclass
class _Flush:
    indices: list[int]
    flushed: float
    since: float
    """The previous flush's time, or the new start's (an event record) after it."""
    new_start: bool
    """A new incarnation or restored state began since the previous flush: its steps trained after it."""


def _flushes(records: list[dict[str, Any]]) -> list[_Flush]:
    """The train records grouped by flush (one time), each with what came before it."""
    out: list[_Flush] = []
    since, new_start, last_step, index = math.nan, False, math.nan, 0
    for record in records:
        kind, time = record.get("type"), _number(record.get("time"))
        if kind in NEW_START:
            since = time if math.isfinite(time) else since
            new_start = True
        elif kind == "train":
            step = _number(record.get("step"))
            if out and out[-1].flushed == time and not new_start:
                out[-1].indices.append(index)
            else:
                # Steps that do not follow on (a resume or rollback without its record) start anew too.
                jumped = math.isfinite(last_step) and math.isfinite(step) and step != last_step + 1
                out.append(_Flush([index], time, since, new_start or (bool(out) and jumped)))
                since, new_start = time, False
            last_step = step
            index += 1
    return out


def _step_times(records: list[dict[str, Any]], count: int) -> tuple[np.ndarray, np.ndarray]:
    """Each step's time and the segment of steps it trained in (a new one after each stretch without steps).

    The steps of one flush share its time. They are spread evenly after the previous flush (or the new
    start after it) when that took the run's normal time; after a longer stretch (a hang, a restart, a
    pause) they are placed at the run's normal pace up to the flush, and a new segment begins, so the plot
    breaks the line instead of drawing steps where none trained.
    """
    flushes = _flushes(records)
    times, segment = np.full(count, math.nan), np.zeros(count, dtype=int)
    paces = [(f.flushed - f.since) / len(f.indices) for f in flushes
             if not f.new_start and math.isfinite(f.since) and f.flushed > f.since]  # fmt: skip
    pace = float(np.median(paces)) if paces else None
    current = 0
    for number, flush in enumerate(flushes):
        n, elapsed = len(flush.indices), flush.flushed - flush.since
        ordinal = np.arange(1, n + 1)
        normal = math.isfinite(elapsed) and elapsed > 0 and (pace is None or elapsed <= STRETCH * n * pace)
        if normal:
            times[flush.indices] = flush.since + elapsed * ordinal / n
        elif pace is not None and math.isfinite(flush.flushed):
            times[flush.indices] = flush.flushed - (n - ordinal) * pace
        else:
            times[flush.indices] = flush.flushed
        if number and (flush.new_start or not normal):
            current += 1
        segment[flush.indices] = current
    return times, segment


def read_run_log(path: str | Path) -> RunLog:
    """Read a run log; a half-written last line (a live run) is left out.

    ReportError names the file (and line) when it cannot be read or a line is not a JSON object
    with a `type`.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ReportError(f"cannot read run log {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ReportError(f"run log {path} is not text (expected JSON lines)") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # being written right now
                break
            raise ReportError(f"{path}:{number}: not a JSON object (is this a rankscope run log?)") from None
        if not isinstance(record, dict) or not isinstance(record.get("type"), str):
            raise ReportError(f'{path}:{number}: a record must be a JSON object with a "type"')
        records.append(record)
    return RunLog(path, records)
