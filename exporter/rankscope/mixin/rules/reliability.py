"""Reliability: checkpoints that cannot be written."""

from __future__ import annotations

from rankscope.mixin.config import Tunables
from rankscope.mixin.promql import (
    CHECKPOINT_FAILED_AT,
    CHECKPOINT_FAILURES_MAX,
    CHECKPOINT_FAILURES_NODE_MAX,
    LAST_CHECKPOINT_NODE_MAX,
    NODE,
    RUN,
    counted_in_window,
    metric_name,
)
from rankscope.mixin.rules import Alert


def shard_records(t: Tunables) -> list[dict[str, str]]:
    """Each node's highest failure count per reason, on the sharded layout's shards (one server reads it inline)."""
    return [
        {
            "record": CHECKPOINT_FAILURES_NODE_MAX,
            "expr": f"max by ({NODE}, reason) ({metric_name('checkpoint_failures_total')})",
        }
    ]


def records(t: Tunables) -> list[dict[str, str]]:
    """The run's checkpoint failures per reason, once per evaluation: an instant read of every rank's counter.
    The alert's three range functions over its window then read one series per run and reason instead of every
    rank's (at 4096 ranks they cost 0.98 s an evaluation over the ranks' counters). The highest rank's count is
    the run's: a rank that fails first raises it, and one whose counter appears already at 1 does too. The
    run's last good checkpoint is the latest of its nodes' (each node's where its ranks' series are)."""
    return [
        {
            "record": LAST_CHECKPOINT_NODE_MAX,
            "expr": f"max by ({NODE}) ({metric_name('last_checkpoint_timestamp_seconds')})",
        },
        {
            "record": CHECKPOINT_FAILURES_MAX,
            "expr": f"max by ({RUN}, reason) ({CHECKPOINT_FAILURES_NODE_MAX})",
        },
        # Present at the evaluation that sees the run's count grow, valued its time: the latest over a window is
        # when the run last failed (to within an evaluation), to compare with its last good checkpoint.
        {
            "record": CHECKPOINT_FAILED_AT,
            "expr": f"max by ({RUN}) (idelta({CHECKPOINT_FAILURES_MAX}[{t.rate_window}]) > 0) * 0 + time()",
        },
    ]


def alerts(t: Tunables) -> list[Alert]:
    return [
        Alert(
            "RankscopeCheckpointFailing",
            # A checkpoint written after the last failure ends it: the condition (no recent good checkpoint) is gone.
            f"({counted_in_window(CHECKPOINT_FAILURES_MAX, t.checkpoint_failure_window)}) > 0\n"
            f"unless on ({RUN})\n"
            f"(\n"
            f"  max by ({RUN}) ({LAST_CHECKPOINT_NODE_MAX})\n"
            f"  > on ({RUN})\n"
            f"  max_over_time({CHECKPOINT_FAILED_AT}[{t.checkpoint_failure_window}])\n"
            f")",
            t.checkpoint_failing_for,
            t.checkpoint_failing_severity,
            "Checkpoints of a run cannot be written: a crash now would lose everything since the last one.",
            'Run {{ $labels.run_id }} failed to write {{ $value | printf "%.0f" }} checkpoint(s) in the last '
            f"{t.checkpoint_failure_window} (reason {{{{ $labels.reason }}}}). Training goes on, but a crash or a "
            "stop loses the work since the last good checkpoint, and the run will exit with an error. It resolves "
            "once a checkpoint is written.",
        ),
    ]
