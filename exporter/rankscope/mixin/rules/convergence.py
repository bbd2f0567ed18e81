"""Convergence: the training loss's rate of change and plateau, and the validation-loss plateau."""

from __future__ import annotations

from rankscope.mixin.config import Tunables
from rankscope.mixin.promql import (
    LOSS_CHANGE,
    LOSS_CHANGE_STEPS,
    LOSS_SMOOTHED,
    NODE,
    RUN,
    STEPS_RATE,
    VAL_LOSS,
    VAL_LOSS_NODE_COUNT,
    VAL_LOSS_NODE_SUM,
    applied,
    metric_name,
    num,
    percent,
)
from rankscope.mixin.rules import Alert


def records(t: Tunables) -> list[dict[str, str]]:
    """The latest validation loss and the training loss's rate of change: run-level series only."""
    return [
        # The latest validation loss (a gauge held between validations), averaged over the ranks reporting it:
        # an instant read, no range over the ranks' series. Each node's sum and count first (where its ranks'
        # series are), then the run's mean from them.
        {"record": VAL_LOSS_NODE_SUM, "expr": f'sum by ({NODE}) ({metric_name("loss")}{{split="val"}})'},
        {"record": VAL_LOSS_NODE_COUNT, "expr": f'count by ({NODE}) ({metric_name("loss")}{{split="val"}})'},
        {
            "record": VAL_LOSS,
            "expr": f"sum by ({RUN}) ({VAL_LOSS_NODE_SUM})\n/\nsum by ({RUN}) ({VAL_LOSS_NODE_COUNT})",
        },
        {
            # The loss's rate of change: the least-squares slope of the smoothed loss (per second, robust to
            # the noise of single points) over the run's mean steps per second in the same window is the slope
            # per step, scaled to LOSS_CHANGE_STEPS and relative to the loss's mean level in the window, so one
            # threshold fits fast and slow runs and any loss scale; negative is improving. Nothing where the run
            # did not step in the window or the loss's level is 0. Run-level series only: a few per run.
            "record": LOSS_CHANGE,
            "expr": f"{LOSS_CHANGE_STEPS} * deriv({LOSS_SMOOTHED}[{t.loss_change_window}])\n"
            f"/ (avg_over_time({STEPS_RATE}[{t.loss_change_window}]) > 0)\n"
            f"/ (abs(avg_over_time({LOSS_SMOOTHED}[{t.loss_change_window}])) > 0)",
        },
    ]


def alerts(t: Tunables) -> list[Alert]:
    return [
        Alert(
            "RankscopeLossPlateau",
            # Stepping now (a paused or stalled run has its own alerts), and reporting loss a whole window ago:
            # a fresh run's first minutes, whose slope rests on a few points, never count as a plateau. Not over
            # a window a rollback cut into: it holds the climb the rollback undid and the restored checkpoint's
            # loss, two branches of the run, whose slope says nothing about progress (a loop-off campaign arm
            # read a poisoned climb and its rollback as a plateau).
            f"{LOSS_CHANGE} > -{num(t.loss_plateau_improvement)}\n"
            f"and on ({RUN}) {STEPS_RATE} > 0\n"
            f"and on ({RUN}) {LOSS_SMOOTHED} offset {t.loss_change_window}\n"
            f"unless on ({RUN}) {applied('rollback', t.loss_change_window)}",
            t.loss_plateau_for,
            t.loss_plateau_severity,
            "The training loss has stopped improving.",
            "The smoothed training loss of run {{ $labels.run_id }} changed by {{ $value | humanizePercentage }} "
            f"of its level per {LOSS_CHANGE_STEPS} steps over the last {t.loss_change_window} (less than "
            f"{percent(t.loss_plateau_improvement)} improvement is a plateau), for {t.loss_plateau_for}. It has "
            "converged, or the learning rate is too low or too high.",
        ),
        Alert(
            "RankscopeValLossPlateau",
            # Validation is sparse (the gauge holds its value between validations): the best value of this
            # window against the best of the window before, while stepping, with at least one new validation
            # in the window. A run without a full window before this one has no comparison and no alert.
            f"(\n"
            f"  min_over_time({VAL_LOSS}[{t.val_loss_plateau_window}] offset {t.val_loss_plateau_window})\n"
            f"  - min_over_time({VAL_LOSS}[{t.val_loss_plateau_window}])\n"
            f")\n"
            f"/ (abs(min_over_time({VAL_LOSS}[{t.val_loss_plateau_window}] offset {t.val_loss_plateau_window})) > 0)\n"
            f"< {num(t.val_loss_plateau_improvement)}\n"
            f"and on ({RUN}) changes({VAL_LOSS}[{t.val_loss_plateau_window}]) > 0\n"
            f"and on ({RUN}) {STEPS_RATE} > 0",
            t.val_loss_plateau_for,
            t.val_loss_plateau_severity,
            "The validation loss has stopped improving.",
            "The best validation loss of run {{ $labels.run_id }} over the last "
            f"{t.val_loss_plateau_window} improved on the best of the {t.val_loss_plateau_window} before by "
            "{{ $value | humanizePercentage }} (less than "
            f"{percent(t.val_loss_plateau_improvement)} is a plateau), for {t.val_loss_plateau_for}. The model "
            "has stopped generalising better: it has converged or begun to overfit.",
        ),
    ]
