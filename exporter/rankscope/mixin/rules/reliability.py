"""Reliability: checkpoints that cannot be written."""

from __future__ import annotations

from rankscope.mixin.config import Tunables
from rankscope.mixin.promql import RUN, counted_in_window, metric_name
from rankscope.mixin.rules import Alert


def records(t: Tunables) -> list[dict[str, str]]:
    return []


def alerts(t: Tunables) -> list[Alert]:
    return [
        Alert(
            "RankscopeCheckpointFailing",
            f"max by ({RUN}, reason) "
            f"({counted_in_window(metric_name('checkpoint_failures_total'), t.checkpoint_failure_window)}) > 0",
            t.checkpoint_failing_for,
            t.checkpoint_failing_severity,
            "Checkpoints of a run cannot be written: a crash now would lose everything since the last one.",
            'Run {{ $labels.run_id }} failed to write {{ $value | printf "%.0f" }} checkpoint(s) in the last '
            f"{t.checkpoint_failure_window} (reason {{{{ $labels.reason }}}}). Training goes on, but a crash or a "
            "stop loses the work since the last good checkpoint, and the run will exit with an error.",
        ),
    ]
