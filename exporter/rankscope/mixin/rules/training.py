"""Training health: the loss diverging, non-finite steps, the loss scale, exploding and vanishing gradients."""

from __future__ import annotations

from rankscope.hang_threshold import duration_seconds
from rankscope.mixin.config import Tunables, effect, sentence
from rankscope.mixin.promql import (
    GRAD_NORM_MAX,
    GRAD_NORM_NODE_MAX,
    HANG_THRESHOLD,
    LAST_STEP_AGE,
    LOSS_BASELINE,
    LOSS_RECENT_LOW,
    LOSS_RECENT_LOW_NODE_COUNT,
    LOSS_RECENT_LOW_NODE_SUM,
    LOSS_SMOOTHED,
    LOSS_SMOOTHED_NODE_COUNT,
    LOSS_SMOOTHED_NODE_SUM,
    LOSS_WINDOW_HIGH,
    LOSS_WINDOW_LOW,
    NODE,
    NONFINITE_MAX,
    NONFINITE_NODE_MAX,
    ONE_PER_NODE,
    RUN,
    STEPS_RATE,
    applied,
    counted_in_window,
    metric_name,
    num,
)
from rankscope.mixin.rules import Alert


def _rank_smoothed_loss(t: Tunables) -> str:
    """Each rank's training loss, smoothed: the median over the smoothing window."""
    return f'quantile_over_time(0.5, {metric_name("loss")}{{split="train"}}[{t.loss_smoothing_window}])'


def _rank_recent_loss(t: Tunables) -> str:
    """Each rank's recent training loss: its lower quartile over the leap window (high only once most of it is)."""
    return f'quantile_over_time(0.25, {metric_name("loss")}{{split="train"}}[{t.loss_leap_window}])'


#: (the run's mean, each node's sum, each node's count) of a per-rank loss measure.
_MEANS = (
    (LOSS_SMOOTHED, LOSS_SMOOTHED_NODE_SUM, LOSS_SMOOTHED_NODE_COUNT, _rank_smoothed_loss),
    (LOSS_RECENT_LOW, LOSS_RECENT_LOW_NODE_SUM, LOSS_RECENT_LOW_NODE_COUNT, _rank_recent_loss),
)


def shard_records(t: Tunables) -> list[dict[str, str]]:
    """Each node's sum and count of its ranks' smoothed and recent losses, for the sharded layout's forms of the
    run's."""
    return [
        record
        for _, node_sum, node_count, per_rank in _MEANS
        for record in (
            {"record": node_sum, "expr": f"sum by ({NODE}) ({per_rank(t)})"},
            {"record": node_count, "expr": f"count by ({NODE}) ({per_rank(t)})"},
        )
    ]


def sharded_forms(t: Tunables) -> dict[str, str]:
    """The run's smoothed and recent losses from their nodes' sums and counts: the mean one server takes in one read
    of every rank (two would cost it twice as much), without a rank's series on the global server."""
    return {
        run_mean: f"sum by ({RUN}) ({node_sum})\n/\nsum by ({RUN}) ({node_count})"
        for run_mean, node_sum, node_count, _ in _MEANS
    }


def records(t: Tunables) -> list[dict[str, str]]:
    """The run's smoothed loss and its baseline, and per-run values the alerts read: every rank's series
    is read once per evaluation instead of once per alert."""
    return [
        # Each rank's loss is its own micro-batch's: the run's is their average. Over time, the median: a mean lets
        # a few very bad batches (a 12 s spike, over at once) hold the whole window above the line for its length,
        # and the alert then acts on a run that had already recovered.
        {
            "record": LOSS_SMOOTHED,
            "expr": f"avg by ({RUN}) ({_rank_smoothed_loss(t)})",
        },
        # Its last seconds, by their lower quartile: a leap the median takes half its window to show.
        {"record": LOSS_RECENT_LOW, "expr": f"avg by ({RUN}) ({_rank_recent_loss(t)})"},
        # The baseline divergence compares with: the smoothed loss's typical level, not its lowest dip.
        {"record": LOSS_BASELINE, "expr": f"quantile_over_time(0.5, {LOSS_SMOOTHED}[{t.loss_baseline_window}])"},
        # Its range over the same window: in a run's first window, how far it fell and how far it climbed back.
        {"record": LOSS_WINDOW_LOW, "expr": f"min_over_time({LOSS_SMOOTHED}[{t.loss_baseline_window}])"},
        {"record": LOSS_WINDOW_HIGH, "expr": f"max_over_time({LOSS_SMOOTHED}[{t.loss_baseline_window}])"},
        # The highest rank's non-finite count and gradient norm: each node's (where its ranks' series are), then
        # the run's from its nodes'.
        {"record": NONFINITE_NODE_MAX, "expr": f"max by ({NODE}) ({metric_name('nonfinite_steps_total')})"},
        {"record": GRAD_NORM_NODE_MAX, "expr": f"max by ({NODE}) ({metric_name('grad_norm')})"},
        {"record": NONFINITE_MAX, "expr": f"max by ({RUN}) ({NONFINITE_NODE_MAX})"},
        {"record": GRAD_NORM_MAX, "expr": f"max by ({RUN}) ({GRAD_NORM_NODE_MAX})"},
    ]


def alerts(t: Tunables) -> list[Alert]:
    overflows = metric_name("loss_scale_overflows_total")
    divergence, divergence_said = effect(t.divergence_action)
    relapse_line = f"{LOSS_WINDOW_LOW} + {num(t.divergence_relapse_share)} * ({LOSS_WINDOW_HIGH} - {LOSS_WINDOW_LOW})"
    nonfinite, nonfinite_said = effect(t.nonfinite_action)
    nonfinite_return = (
        f" The rate comes back {t.nonfinite_lr_restore_steps} steps after the reduction."
        if t.nonfinite_action == "reduce_lr" and t.nonfinite_lr_restore_steps
        else ""
    )
    return [
        Alert(
            "RankscopeLossDiverging",
            # `unless` binds tighter than `or`: the whole condition in parentheses, the staleness guard after.
            f"(\n(\n  {LOSS_SMOOTHED} > {num(t.divergence_factor)} * {LOSS_BASELINE}\n  and {LOSS_BASELINE} > 0\n"
            f"  and {LOSS_SMOOTHED} - {LOSS_BASELINE} > {num(t.divergence_min_increase)}\n)\n"
            # A leap: the last seconds' lower quartile over the most the smoothed loss reached in the window. The
            # same leap takes the median half its window to show; by then the highest has risen with it and the
            # clause above holds instead.
            f"or\n(\n  {LOSS_RECENT_LOW} > {num(t.divergence_leap_factor)} * {LOSS_WINDOW_HIGH}\n"
            f"  and {LOSS_WINDOW_HIGH} > 0\n)\n"
            # In the run's first window (no smoothed loss a window ago) the median is the loss's own fall: a
            # loss that learned (fell by the factor) and climbed back over the share of its fall diverged.
            f"or\n(\n  (\n    {LOSS_SMOOTHED} > {relapse_line}\n    or\n    {LOSS_RECENT_LOW} > {relapse_line}\n  )\n"
            f"  and {LOSS_WINDOW_HIGH} > {num(t.divergence_relapse_fall)} * {LOSS_WINDOW_LOW}\n"
            f"  and {LOSS_WINDOW_LOW} > 0\n"
            f"  unless on ({RUN}) {LOSS_SMOOTHED} offset {t.loss_baseline_window}\n)\n)\n"
            # A run that stopped stepping (a hang, a long checkpoint) serves its last step's loss until it steps
            # again: scraped over and over, one batch's loss is the whole window. Judged only where no step of the
            # smoothing window took longer than the run's hang threshold (a hung campaign run's frozen 0.13 was
            # 650 times its baseline); a run whose steps take minutes has a threshold to match.
            f"unless on ({RUN})\n"
            f"max_over_time({LAST_STEP_AGE}[{t.loss_smoothing_window}]) > on ({RUN}) {HANG_THRESHOLD}\n"
            # A smoothing window that holds a rollback holds the climb it undid: the alert ends with the fix and
            # judges the restored run once its window is past it (a rollback that did not help fires again then).
            # Read in the campaign's logs, such a window's median crossed the line again a minute after the
            # rollback, on the climb alone.
            f"unless on ({RUN}) {applied('rollback', t.loss_smoothing_window)}",
            t.divergence_for,
            t.divergence_severity,
            f"Training loss is diverging; {divergence}.",
            "The training loss of run {{ $labels.run_id }} (all ranks) is "
            f'{{{{ $value | printf "%.4g" }}}}: its median over {t.loss_smoothing_window} more than '
            f"{num(t.divergence_factor)}x its median over the last {t.loss_baseline_window}, or its lower quartile "
            f"over {t.loss_leap_window} more than {num(t.divergence_leap_factor)}x the highest that median reached "
            f"in it (or, in the run's first {t.loss_baseline_window}, either back over "
            f"{num(t.divergence_relapse_share * 100)}% of its fall after it fell {num(t.divergence_relapse_fall)}-fold)"
            f", for {t.divergence_for}. "
            f"{sentence(divergence_said)}.",
            t.divergence_action,
            # A rollback goes back to before the loss's median began to climb: Prometheus sends the time the
            # alert fired as its startsAt, its `for` after it went pending, itself up to a smoothing window after
            # the climb began. The checkpoints between were written with the divergence in them.
            parameters={
                "incident_lookback_seconds": num(
                    duration_seconds(t.loss_smoothing_window) + duration_seconds(t.divergence_for)
                )
            }
            if t.divergence_action == "rollback"
            else {},
        ),
        Alert(
            "RankscopeNonFiniteSteps",
            # Every rank counts the steps it saw go non-finite (a NaN on one rank reaches all through the
            # all-reduce); the run's count is the highest, pre-aggregated once at the head of this group.
            # It holds while they go on (one within the clear window), and the trainer's action, once applied,
            # gets that window to work: non-finite steps a whole window after it fire the alert again.
            f"({counted_in_window(NONFINITE_MAX, t.nonfinite_window)}) > {num(t.nonfinite_steps)}\n"
            f"and on ({RUN})\n"
            f"increase({NONFINITE_MAX}[{t.nonfinite_clear_window}]) > 0\n"
            f"unless on ({RUN})\n"
            f"{applied(t.nonfinite_action, t.nonfinite_clear_window)}",
            t.nonfinite_for,
            t.nonfinite_severity,
            f"Training steps produce NaN or infinite loss or gradients; {nonfinite}.",
            'Run {{ $labels.run_id }} had {{ $value | printf "%.0f" }} steps with a non-finite loss or gradient '
            f"norm in the last {t.nonfinite_window} (more than {num(t.nonfinite_steps)} fires), the latest within "
            f"{t.nonfinite_clear_window}. {sentence(nonfinite_said)}; the alert resolves once it has, or once no step "
            f"has been non-finite for {t.nonfinite_clear_window}.{nonfinite_return}",
            t.nonfinite_action,
            parameters={"restore_after_steps": str(t.nonfinite_lr_restore_steps)} if nonfinite_return else {},
        ),
        Alert(
            "RankscopeLossScaleCollapse",
            # Every rank's GradScaler sees the same all-reduced gradients: one rank per node tells the run's.
            f"label_replace(min by ({RUN}) ({metric_name('loss_scale')}{ONE_PER_NODE}) < {num(t.loss_scale_min)}, "
            f'"signal", "scale", "", "")\n'
            f"or\n"
            f"label_replace(\n"
            f"  max by ({RUN}) (rate({overflows}{ONE_PER_NODE}[{t.loss_scale_window}]))\n"
            f"  /\n"
            f"  (max by ({RUN}) (rate({metric_name('steps_total')}{ONE_PER_NODE}[{t.loss_scale_window}])) > 0)\n"
            f'  > {num(t.loss_scale_overflow_share)}, "signal", "overflow_share", "", ""\n'
            f")",
            t.loss_scale_for,
            t.loss_scale_severity,
            "Dynamic loss scaling is failing: the GradScaler's scale collapsed or most steps overflow.",
            "Run {{ $labels.run_id }}: "
            '{{ if eq $labels.signal "scale" }}the GradScaler\'s loss scale is {{ $value | printf "%.3g" }} '
            f"(below {num(t.loss_scale_min)})"
            "{{ else }}{{ $value | humanizePercentage }} of steps overflowed and were skipped "
            f"(threshold {t.loss_scale_overflow_share:.0%} over {t.loss_scale_window}){{{{ end }}}} "
            f"for {t.loss_scale_for}. fp16 no longer represents the gradients; the updates are being lost.",
        ),
        Alert(
            "RankscopeGradientExplosion",
            f"{GRAD_NORM_MAX} > {num(t.grad_norm_explosion)}",
            t.grad_explosion_for,
            t.grad_explosion_severity,
            "The total gradient norm is exploding.",
            'The total gradient norm of run {{ $labels.run_id }} is {{ $value | printf "%.3g" }}, above '
            f"{num(t.grad_norm_explosion)}, for {t.grad_explosion_for}.",
        ),
        Alert(
            "RankscopeGradientVanishing",
            f"{GRAD_NORM_MAX} < {num(t.grad_norm_vanishing)}\nand on ({RUN}) {STEPS_RATE} > 0",
            t.grad_vanishing_for,
            t.grad_vanishing_severity,
            "The total gradient norm has vanished while the run keeps stepping.",
            'The total gradient norm of run {{ $labels.run_id }} is {{ $value | printf "%.3g" }}, below '
            f"{num(t.grad_norm_vanishing)}, for {t.grad_vanishing_for} while the run is stepping: it is not learning.",
        ),
    ]
