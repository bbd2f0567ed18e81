"""Liveness: a stalled run, a rank that cannot be scraped, a long pause."""

from __future__ import annotations

from rankscope.mixin.config import Tunables
from rankscope.mixin.promql import PAUSED_MAX, RANK, RUN, metric_name, num
from rankscope.mixin.rules import RANK_TEXT, Alert


def records(t: Tunables) -> list[dict[str, str]]:
    """Whether a run is paused (several alerts, here and in other areas, exclude paused runs)."""
    return [{"record": PAUSED_MAX, "expr": f"max by ({RUN}) ({metric_name('paused')})"}]


def alerts(t: Tunables) -> list[Alert]:
    return [
        Alert(
            "RankscopeRunStalled",
            f"time() - max by ({RUN}) ({metric_name('last_step_timestamp_seconds')} > 0) > {num(t.stall_seconds)}\n"
            f"unless on ({RUN})\n"
            f"{PAUSED_MAX} > 0",
            t.stall_for,
            t.stall_severity,
            "A run serves metrics but has not completed a step for a long time.",
            "Run {{ $labels.run_id }} has completed no step for {{ $value | humanizeDuration }} while its ranks "
            "still serve metrics and it is not paused. It is hung (a collective, the data loader, I/O).",
        ),
        Alert(
            "RankscopeRankDown",
            # The `up` series of a rank carries run_id/rank when service discovery sets them (file_sd from
            # the trainer, Kubernetes); with static targets they come from the metrics the rank served last.
            # A rank whose last word was "finished cleanly" (rankscope_run_finished) is gone, not down.
            f"(\n"
            f'  max by ({RANK}, instance) (up{{run_id!="", rank!=""}} == 0)\n'
            f"  or\n"
            f"  max by ({RANK}, instance) (\n"
            f"    (up == 0)\n"
            f"    * on (job, instance) group_left ({RANK})\n"
            f"    topk by (job, instance) (1, last_over_time({metric_name('run_info')}[{t.rank_down_lookback}]))\n"
            f"  )\n"
            f")\n"
            f"unless on (run_id, rank)\n"
            f"(last_over_time({metric_name('run_finished')}[{t.rank_down_lookback}]) == 1)",
            t.rank_down_for,
            t.rank_down_severity,
            "A rank of a live run cannot be scraped.",
            f"Prometheus cannot scrape {RANK_TEXT} at {{{{ $labels.instance }}}} for {t.rank_down_for}. The process "
            "died or hangs so badly it cannot serve metrics; the other ranks will stall in their next collective.",
        ),
        Alert(
            "RankscopeRunPaused",
            f"{PAUSED_MAX} > 0",
            t.paused_for,
            t.paused_severity,
            "A run has been paused by a control action for a long time.",
            f"Run {{{{ $labels.run_id }}}} has been paused for more than {t.paused_for}. Resume it or stop it.",
        ),
    ]
