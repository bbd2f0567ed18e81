"""What a person (and a test) reads: a progress line every N steps and an optional JSONL log.

Only rank 0 keeps a log, but for fault injection's records, which the rank that fires a fault writes
into the same file (rankscope_trainer.faults). Per-step loss and accuracy stay device tensors
until the next log line, where they become numbers in one transfer: the
log costs one sync per `log_every` steps, not one per step.

JSONL records (one object per line, appended): `{"type": "train", "step",
"loss", "acc_i2t", "acc_t2i", "lr"}` per step, `{"type": "val", ...}` per
validation, and events (`start`, `resume`, `checkpoint`, `checkpoint_failed`, `action`,
`finished`). An `action` record is one settled control action as `/v1/status` reports it (`id`,
`action`, `source`, `result`, `reason`, `detail`, `step`) stamped with the time it was settled, not
the time it was written: a pause is logged once the loop resumes, with the pause's own time.
Non-finite numbers are written as null (JSON has no NaN).

Fault records, from any rank: `{"type": "fault", "kind", "name", "step", "rank", "source", "attempt",
"time"}` when an injected fault fires (before it acts; `step` is the data batch for poison), and
`{"type": "fault_end", ...}` when a fault with an `until_step` ends. Every append is one write to a file
opened for appending, so records of two ranks never interleave within a line.
"""

from __future__ import annotations

import json
import logging
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

__all__ = ["ProgressLog"]

logger = logging.getLogger("rankscope_trainer")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class ProgressLog:
    def __init__(self, path: str, enabled: bool, max_steps: int, samples_per_step: int) -> None:
        self.enabled = enabled
        self.path = Path(path) if path and enabled else None
        self.fault_path = Path(path) if path else None
        """Where this rank writes its fault records (every rank)."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_steps = max_steps
        self.samples_per_step = samples_per_step
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._logged_actions: set[str] = set()

    def restart_clock(self) -> None:
        """Start timing from now (after setup, or after a pause), so throughput is not diluted."""
        self._window_start = time.perf_counter()
        self._window_steps = 0

    def record_step(self, step: int, loss: torch.Tensor, accuracy: torch.Tensor, lr: float) -> None:
        if self.enabled:
            self._pending.append((step, loss.detach().float().reshape(()), accuracy.detach().float(), lr))
        self._window_steps += 1

    def flush(self) -> None:
        """Resolve the buffered steps (one transfer), append them to the JSONL log, print a progress line."""
        if not self.enabled or not self._pending:
            return
        pending, self._pending = self._pending, []
        values = torch.stack([torch.cat([loss.reshape(1), acc]) for _, loss, acc, _ in pending]).tolist()
        self.write_records(
            {"type": "train", "step": step, "loss": _finite(v[0]), "acc_i2t": _finite(v[1]),
             "acc_t2i": _finite(v[2]), "lr": lr}
            for (step, _, _, lr), v in zip(pending, values, strict=True)
        )  # fmt: skip
        finite = [v for v in values if all(math.isfinite(x) for x in v)]
        elapsed = time.perf_counter() - self._window_start
        step_seconds = elapsed / max(1, self._window_steps)
        step = pending[-1][0]
        eta = timedelta(seconds=round(step_seconds * (self.max_steps - step)))
        if finite:
            loss = sum(v[0] for v in finite) / len(finite)
            i2t = sum(v[1] for v in finite) / len(finite)
            t2i = sum(v[2] for v in finite) / len(finite)
            scores = f"loss {loss:.4f} | acc i2t {i2t:.3f} t2i {t2i:.3f}"
        else:
            scores = "loss non-finite"
        logger.info(
            "step %d/%d | %s | lr %.2e | %.1f ms/step | %.0f samples/s | ETA %s",
            step, self.max_steps, scores, pending[-1][3], step_seconds * 1000,
            self.samples_per_step / step_seconds if step_seconds else 0.0, eta,
        )  # fmt: skip
        self.restart_clock()

    def event(self, kind: str, **fields: Any) -> None:
        """An event record, written at once."""
        if self.enabled:
            self.write_records([{"type": kind, **fields}])

    def fault(self, record: dict[str, Any]) -> None:
        """A fault injection's record (any rank), written at once."""
        if self.fault_path is not None:
            self.fault_path.parent.mkdir(parents=True, exist_ok=True)
            _append(self.fault_path, [record])

    def actions(self, recent: list[dict[str, Any]]) -> None:
        """An `action` record for each newly settled control action of `recent` (the control queue's
        outcomes, oldest first), stamped with its own settle time."""
        if self.path is None:
            return
        fresh = [r for r in recent if r.get("status") != "pending" and r.get("id") not in self._logged_actions]
        records = []
        for r in fresh:
            self._logged_actions.add(r["id"])
            records.append({"type": "action", "step": r.get("step"), "id": r["id"], "action": r.get("action"),
                            "source": r.get("source"), "result": r.get("status"), "reason": r.get("reason", ""),
                            "detail": r.get("detail", ""), "time": r.get("settled_at")})  # fmt: skip
        self.write_records(records)

    def write_records(self, records: Any) -> None:
        if self.path is None or not records:
            return
        _append(self.path, records)


def _append(path: Path, records: Any) -> None:
    """Append `records` as JSON lines in one write (another rank's fault record never lands mid-line)."""
    now = time.time()
    lines = []
    for record in records:
        # A record that carries its own time (an action's settle time, a fault's) keeps it.
        stamp = record.get("time") if isinstance(record.get("time"), int | float) else now
        lines.append(json.dumps({**record, "time": round(stamp, 3)}) + "\n")
    if lines:
        with path.open("ab", buffering=0) as handle:
            handle.write("".join(lines).encode())
