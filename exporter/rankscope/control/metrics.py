"""Recording the control loop's metrics (declared in rankscope.contract).

Checkpoints are written by the training loop, not by the channel (it also
checkpoints on an interval and at the end), so the loop records each
completed checkpoint with :func:`record_checkpoint`, whatever asked for it.
"""

from __future__ import annotations

import time
from typing import Any

from rankscope.contract import PREFIX

__all__ = [
    "CHECKPOINT_FAILURE_REASONS",
    "CHECKPOINT_REASONS",
    "checkpoint_reason_label",
    "record_checkpoint",
    "record_checkpoint_failure",
]

#: Bounded values of the `reason` label of rankscope_checkpoints_total.
CHECKPOINT_REASONS: tuple[str, ...] = ("interval", "alert", "operator", "stop", "final", "other")
#: Bounded values of the `reason` label of rankscope_checkpoint_failures_total.
CHECKPOINT_FAILURE_REASONS: tuple[str, ...] = ("no_space", "permission", "io_error", "other")


def checkpoint_reason_label(reason: str) -> str:
    """The label for a checkpoint reason: its kind before ':' ("alert:HighLoss" -> "alert")."""
    kind = reason.split(":", 1)[0]
    return kind if kind in CHECKPOINT_REASONS else "other"


def record_checkpoint(monitor: Any, reason: str, seconds: float, finished_at: float | None = None) -> None:
    """Count one completed checkpoint: checkpoints_total{reason}, its duration, and its time.

    `monitor` is a Monitor (a NullMonitor, or None, records nothing).
    """
    instruments = getattr(monitor, "instruments", None)
    if instruments is None:
        return
    instruments.child(PREFIX + "checkpoints_total", reason=checkpoint_reason_label(reason)).inc()
    instruments.child(PREFIX + "checkpoint_duration_seconds").observe(seconds)
    instruments.child(PREFIX + "last_checkpoint_timestamp_seconds").set(
        time.time() if finished_at is None else finished_at
    )


def record_checkpoint_failure(monitor: Any, reason: str | None) -> None:
    """Count one failed checkpoint: checkpoint_failures_total{reason} (one of CHECKPOINT_FAILURE_REASONS,
    anything else counts as "other"). `reason=None` counts nothing but makes every reason's counter
    exist at 0, so that increase() sees the first failure."""
    instruments = getattr(monitor, "instruments", None)
    if instruments is None:
        return
    for label in CHECKPOINT_FAILURE_REASONS:
        instruments.child(PREFIX + "checkpoint_failures_total", reason=label)
    if reason is not None:
        label = reason if reason in CHECKPOINT_FAILURE_REASONS else "other"
        instruments.child(PREFIX + "checkpoint_failures_total", reason=label).inc()
