"""Efficiency: goodput (where the job's wall time went, across restarts) and MFU (docs/goodput.md).

The goodput buckets are exported by rank 0 alone (seven series per run), already the job's totals across
restarts: the rules read them without aggregating over ranks, and range over their run-level recording.
"""

from __future__ import annotations

from rankscope.mixin.config import Tunables
from rankscope.mixin.promql import (
    BADPUT_WINDOW,
    FLOPS_NODE_RATE,
    FLOPS_RATE,
    GOODPUT_BUCKETS,
    GOODPUT_PRODUCTIVE,
    GOODPUT_RATIO,
    GOODPUT_WALL,
    GOODPUT_WINDOW_RATIO,
    MFU,
    NODE,
    PEAK_FLOPS,
    PEAK_FLOPS_NODE,
    RUN,
    metric_name,
    num,
    percent,
    rate_by,
    ratio,
)
from rankscope.mixin.rules import Alert


def records(t: Tunables) -> list[dict[str, str]]:
    w = t.goodput_window

    def total(expr: str) -> str:
        return f"sum by ({RUN}) ({expr})"

    def bucket(matcher: str) -> str:
        return f"{GOODPUT_BUCKETS}{{{matcher}}}"

    def grown(matcher: str) -> str:
        return f"increase({bucket(matcher)}[{w}])"

    training, lost, wall = 'bucket="training"', 'bucket="lost"', 'bucket!="lost"'
    return [
        # --- level 1 -----------------------------------------------------------------------------------------
        # One series per run and bucket: rank 0's, whichever node it ran on in each incarnation. Only rank 0
        # exports them; the matcher says so, and keeps the read to rank 0's series even where a page holds more.
        {
            "record": GOODPUT_BUCKETS,
            "expr": f'max by ({RUN}, bucket) ({metric_name("goodput_seconds_total")}{{rank="0"}})',
        },
        # Each node's flop rate and peak (where its ranks' series are), then the run's below.
        {"record": FLOPS_NODE_RATE, "expr": rate_by(NODE, metric_name("model_flops_total"), t.rate_window)},
        {"record": PEAK_FLOPS_NODE, "expr": f"sum by ({NODE}) ({metric_name('peak_flops_per_second')})"},
        # --- level 2 -----------------------------------------------------------------------------------------
        {"record": FLOPS_RATE, "expr": f"sum by ({RUN}) ({FLOPS_NODE_RATE})"},
        {"record": PEAK_FLOPS, "expr": f"sum by ({RUN}) ({PEAK_FLOPS_NODE})"},
        # The job's wall time is every bucket but `lost`, which is the part of `training` thrown away.
        {"record": GOODPUT_WALL, "expr": total(bucket(wall))},
        {"record": GOODPUT_PRODUCTIVE, "expr": f"{total(bucket(training))}\n- {total(bucket(lost))}"},
        {
            "record": GOODPUT_RATIO,
            "expr": ratio(f"({total(bucket(training))}\n- {total(bucket(lost))})", total(bucket(wall))),
        },
        {
            # Productive seconds in the window over its wall seconds. A rollback can throw away more than the
            # window trained: the window then produced nothing (0), not a negative share.
            "record": GOODPUT_WINDOW_RATIO,
            "expr": ratio(f"clamp_min({total(grown(training))} - {total(grown(lost))}, 0)", total(grown(wall))),
        },
        # Seconds each cause of badput took in the window (the alert names the largest).
        {"record": BADPUT_WINDOW, "expr": grown('bucket!="training"')},
        # --- level 3: dashboards only --------------------------------------------------------------------------
        {"record": MFU, "expr": ratio(FLOPS_RATE, PEAK_FLOPS)},
    ]


def alerts(t: Tunables) -> list[Alert]:
    return [
        Alert(
            "RankscopeGoodputLow",
            f"(\n  {GOODPUT_WINDOW_RATIO} < {num(t.goodput_ratio)}\n"
            f"  and on ({RUN}) {GOODPUT_WALL} > {num(t.goodput_min_wall_seconds)}\n)\n"
            f"* on ({RUN}) group_left (bucket) (topk by ({RUN}) (1, {BADPUT_WINDOW} > 0) * 0 + 1)",
            t.goodput_for,
            t.goodput_severity,
            "A run spends too much of its time on something other than training progress that is kept.",
            "Run {{ $labels.run_id }} turned only {{ $value | humanizePercentage }} of the last "
            f"{t.goodput_window} into training progress that was kept (threshold {percent(t.goodput_ratio)}). "
            "The largest cause of the rest: {{ $labels.bucket }}.",
        ),
    ]
