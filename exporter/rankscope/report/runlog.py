"""The trainer's JSONL run log (trainer/rankscope_trainer/logbook.py), read into arrays.

Rank 0 appends one JSON object per line: `{"type": "train", "step", "loss",
"acc_i2t", "acc_t2i", "lr", "time"}` per step, `{"type": "val", "step", "loss",
"acc_i2t", "acc_t2i", "time"}` per validation, and events (`start`, `resume`,
`checkpoint` with `reason` and `path`, `finished` with `stopped`). Non-finite
numbers are null. Train records are written in batches (one flush every
`run.log_every` steps) and carry the flush time, so each step's time is spread
evenly between two flushes. Unknown record types are kept but not plotted, so a
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
        """Per-step arrays: step, time (spread between flushes), flushed (the record's own time, when its batch
        was written: a step happened by then), loss, acc_i2t, acc_t2i, lr."""
        records = self.of("train")
        flushed = [_number(r.get("time")) for r in records]
        return {
            "step": np.array([_number(r.get("step")) for r in records]),
            "time": _spread(flushed, _number((self.of("start") or [{}])[0].get("time"))),
            "flushed": np.array(flushed),
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


def _spread(flush_times: list[float], start: float) -> np.ndarray:
    """Each step's time: the records of one flush share its time; spread them evenly after the previous flush."""
    out = np.array(flush_times, dtype=float)
    i, previous = 0, start
    while i < len(out):
        j = i
        while j + 1 < len(out) and out[j + 1] == out[i]:
            j += 1
        flushed = out[i]
        if math.isfinite(previous) and math.isfinite(flushed) and flushed > previous:
            count = j - i + 1
            out[i : j + 1] = previous + (flushed - previous) * np.arange(1, count + 1) / count
        previous = flushed
        i = j + 1
    return out


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
