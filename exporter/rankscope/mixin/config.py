"""The rule pack's one config: every Tunable, the severities and where each is routed, which alert asks the
trainer for which action, and the runbook URL pattern.

The rule areas (:mod:`rankscope.mixin.rules`), the dashboards, the Alertmanager routes and the Kubernetes
resources all read it, so an operator tunes one place (``rankscope-mixin --set NAME=VALUE``) and a test can
generate a fast variant (short ``for``, short windows) of exactly the rules that ship. The control catalog
(:mod:`rankscope.control.catalog`) declares the actions and names no alert; which alert may ask for which of
them is declared here (:data:`ACTION_TUNABLES`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, fields, replace
from typing import Any

from rankscope import contract, hang_threshold
from rankscope._checks import check_range
from rankscope.control import catalog
from rankscope.mixin.promql import metric_name, num


@dataclass(frozen=True)
class Severity:
    """What a severity means and where Alertmanager sends it."""

    meaning: str
    receiver: str
    group_wait: str = ""
    group_interval: str = ""
    repeat_interval: str = ""
    routed_to: str = "nobody (visible in the Alertmanager UI and Grafana)"
    """Where the receiver's notifications go, in words (alertmanager.yml's header)."""


#: Severity -> meaning and route (also in docs/runbook.md and prometheus/README.md). A severity with the
#: "null" receiver notifies no one (the Alertmanager default route).
SEVERITY_ROUTES = {
    # A page goes out at once (group_wait below Prometheus's evaluation interval, so an alert the trainer's
    # action resolves at the next evaluation has paged first), and its resolution follows within
    # group_interval: the on-call person hears of an incident the loop fixed, and that it did.
    "page": Severity(
        "a person must look now: the run is stopped, broken, or wasting the whole job's time",
        "pager",
        "1s",
        "30s",
        "4h",
        "the pager (a generic webhook; PagerDuty/Slack below)",
    ),
    "ticket": Severity(
        "a person should look within working hours; the trainer may already have acted",
        "tickets",
        "5m",
        "30m",
        "24h",
        "the ticket queue (notifies no one until you wire it)",
    ),
    "info": Severity("context for dashboards and the Alertmanager UI; notifies no one", "null"),
}
#: Alerts with an `action` label go to the trainer's control endpoint first (and then on by severity). Resends
#: are harmless: the trainer applies each alert once per (fingerprint, startsAt), so repeats only cover a lost
#: delivery.
CONTROL_ROUTE = Severity("the trainer acts on the alert's `action` label", "trainer-control", "0s", "30s", "1h")
SEVERITIES = {name: severity.meaning for name, severity in SEVERITY_ROUTES.items()}
#: What the trainer's control endpoint can do (the `action` alert label): rankscope.control.catalog.
ACTIONS = tuple(spec.name for spec in catalog.CATALOG)


@dataclass(frozen=True)
class ActionChoice:
    """An `*_action` tunable: the alerts whose `action` label it sets and the catalog actions it may take
    ("" first where asking for nothing is the default; every tunable may be set to "": :func:`action_choices`)."""

    alerts: tuple[str, ...]
    choices: tuple[str, ...]


#: Which alert asks the trainer for which action.
ACTION_TUNABLES = {
    "memory_action": ActionChoice(
        ("RankscopeHostMemoryHigh", "RankscopeDeviceMemoryHigh"), ("checkpoint", "reduce_micro_batch")
    ),
    "divergence_action": ActionChoice(("RankscopeLossDiverging",), ("rollback", "reduce_lr")),
    "nonfinite_action": ActionChoice(("RankscopeNonFiniteSteps",), ("reduce_lr", "rollback")),
    "slow_step_action": ActionChoice(("RankscopeSlowSteps",), ("", "reduce_micro_batch")),
    "hang_action": ActionChoice(("RankscopeRankHung",), ("restart", "")),
}
#: How the alerts' texts say what the trainer does for each action an alert may carry: (in the summary, in the
#: description). An action without words here fails generation (KeyError naming it).
EFFECTS = {
    "": ("the on-call person decides", "the trainer does nothing by itself: the on-call person follows the runbook"),
    "checkpoint": ("the trainer checkpoints", "the trainer takes a checkpoint"),
    "reduce_lr": ("the trainer reduces the learning rate", "the trainer reduces the learning rate"),
    "rollback": (
        "the trainer rolls back to an earlier checkpoint",
        "the trainer reloads the newest checkpoint from before the incident and skips the data that followed it",
    ),
    "restart": (
        "the trainer restarts the group from its newest checkpoint",
        "the trainer writes every rank's stacks beside the checkpoints, then every rank exits with status 75 so "
        "that torchrun (--max-restarts) starts the group again from the newest checkpoint",
    ),
    "reduce_micro_batch": (
        "the trainer halves the micro-batch",
        "the trainer halves the micro-batch and doubles gradient accumulation (the same global batch)",
    ),
}
#: The straggler alert, by name for the run report (rankscope.report), which names its episodes' ranks.
IMBALANCE_ALERT = "RankscopeRankImbalance"
#: The non-finite alert, by name for the run report, which times its fault from the first non-finite step.
NONFINITE_ALERT = "RankscopeNonFiniteSteps"
#: The hang alert, by name for the run report, which times its fault from the last step before the hang.
HANG_ALERT = "RankscopeRankHung"
#: Alertmanager inhibitions: (source alert, target alerts). A dead rank stalls the whole run (its peers block
#: in the next collective) and makes the compute-time comparison meaningless: page once, for the cause.
INHIBITIONS = (
    ("RankscopeRankDown", ("RankscopeRunStalled", IMBALANCE_ALERT)),
    # The hang alert names the rank and acts: the catch-all stall alert would page a second time for it.
    ("RankscopeRankHung", ("RankscopeRunStalled",)),
)


def action_choices(tunable: str) -> list[str]:
    """The values an `*_action` tunable may take: its declared choices that the catalog still offers, and ""
    (the alert only pages: any alert may be left to a person, as `--set '*_action='` leaves them all)."""
    offered = [c for c in ACTION_TUNABLES[tunable].choices if c == "" or catalog.action_spec(c) is not None]
    return offered if "" in offered else [*offered, ""]


def effect(action: str) -> tuple[str, str]:
    """What the trainer does for `action`, as an alert's summary and its description say it."""
    if action not in EFFECTS:
        raise KeyError(f"no words in rankscope.mixin.config.EFFECTS for the catalog action {action!r}")
    return EFFECTS[action]


def sentence(words: str) -> str:
    return words[0].upper() + words[1:]


_DURATION = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w|y))+$")


@dataclass(frozen=True)
class Tunables:
    """Every knob of the rules: thresholds, windows, `for` durations and severities (``*_severity``: one
    of :data:`SEVERITIES`, saying who is told). Durations are Prometheus durations (``90s``, ``5m``)."""

    rate_window: str = "2m"
    """Range for rate() and histogram quantiles; keep it >= 4 scrape intervals."""
    loss_smoothing_window: str = "2m"
    """The loss's median over this range is compared, so a noisy batch or a short spike cannot fire."""
    loss_leap_window: str = "20s"
    """Each rank's loss's lower quartile over this range is the run's recent loss, which names a leap (see
    divergence_leap_factor) long before the smoothed loss can. Keep it >= 4 scrape intervals."""
    loss_baseline_window: str = "30m"
    """Divergence compares the smoothed loss with its median over this range (its baseline)."""
    loss_change_window: str = "30m"
    """Sliding window of the loss's rate of change (the least-squares slope of the smoothed loss, per 1000
    steps, relative to its mean level); the plateau alert waits until a run has reported loss this long."""

    host_memory_ratio: float = 0.85
    """Host memory in use (0..1) above which the trainer checkpoints."""
    host_memory_for: str = "1m"
    host_memory_severity: str = "ticket"
    device_memory_ratio: float = 0.90
    """Allocated device memory over total (0..1) above which the trainer checkpoints."""
    device_memory_kind: str = "allocated"
    """Which `kind` of rankscope_device_memory_bytes counts as used (reserved sits near total in healthy runs)."""
    device_memory_for: str = "1m"
    device_memory_severity: str = "ticket"
    memory_action: str = "checkpoint"
    """What both memory alerts ask the trainer for: checkpoint, or reduce_micro_batch (the same global batch in
    half-size micro-batches; the reference trainer checkpoints first). Choices: :func:`action_choices`."""

    divergence_factor: float = 2.0
    """The smoothed loss above this many times its baseline (its median over loss_baseline_window) is
    divergence. The baseline is the loss's typical level, not its lowest: near zero a loss's lowest dip is
    noise, and a converged run whose median went from a dip of 0.0012 to 0.0025 was twice its minimum (the
    fault campaign's fault-free run, and the loop rolled back training that was fine), but not its median."""
    divergence_min_increase: float = 0.0
    """...when it is also this much above the baseline, in the loss's own units (0: the factor alone). An
    absolute margin is tied to one loss's scale: 0.1 missed a learning-rate spike that took a converged
    loss from 0.002 to 0.09 for minutes in the fault campaign."""
    divergence_relapse_fall: float = 4.0
    """In a run's first loss_baseline_window the median is the loss's own fall from where it started, and a
    divergence soon after the fall becomes that median within seconds (the fault campaign's learning-rate spike
    22 s into a run sat at chance for 18 minutes unnamed). There the smoothed loss is divergence when it had
    fallen below its highest in the window divided by this factor and then climbed back more than
    divergence_relapse_share of that fall. A factor, not a difference: near zero a converged loss's
    noise halves and doubles (0.0012 to 0.0025), a loss that learned falls by a larger factor."""
    divergence_relapse_share: float = 0.5
    """...the share (0..1) of its fall, from its highest to its lowest, the smoothed loss climbed back."""
    divergence_leap_factor: float = 2.0
    """The loss leapt: its recent lower quartile (over loss_leap_window) is above this many times the highest the
    smoothed loss reached over loss_baseline_window. A leap the smoothed loss (a median) shows only once half its
    window is high, 60 s and more into it; the recent quartile shows it once three quarters of its 20 s are. Above
    the window's highest, not its median: near zero a loss's median flips between a batch's usual values (the fault
    campaign's converged loss went from 0.0001 to 0.087 and back), its highest already covers them. In a run's first
    loss_baseline_window the recent quartile also counts as the smoothed loss does for divergence_relapse_share."""
    divergence_for: str = "10s"
    """How long the smoothed loss stays over its line before the alert fires. The median over
    loss_smoothing_window is already the guard against noise (it crosses once more than half its window is
    high), and the recent quartile over loss_leap_window against a few bad batches; every second of the `for` is
    training the rollback throws away. 10 s, not less: a 20 s spike of bad batches holds the recent quartile over
    its line for 5 s, and it is not a divergence. Replayed at 1 s over the fault campaign's six logged runs (7.3
    hours), even a `for` of 5 s fired nowhere outside a fault; the one place a shorter `for` met a crossing
    outside a fault, the minute after a rollback, the alert no longer judges (benchmarks/README.md). Evaluated
    every 15 s, any `for` up to 15 s is the same two evaluations."""
    divergence_severity: str = "ticket"
    divergence_action: str = "rollback"
    """What divergence asks the trainer for: rollback (reload the newest checkpoint from before the incident and
    skip the data after it), or reduce_lr. Rollback by default: a loss that diverged and does not come back by
    itself (a learning-rate spike kept in the checkpoints, a broken data shard) came back under a rollback and
    not under a halved rate in the fault campaign (benchmarks/README.md). It needs checkpoints reaching back
    the alert's smoothing window and `for` (130 s) before it fires; without one it is refused and pages."""
    nonfinite_window: str = "10m"
    """Range over which non-finite steps are counted."""
    nonfinite_steps: float = 2.0
    """More than this many non-finite steps in the window fires (fp16 loss scaling skips a few by design)."""
    nonfinite_for: str = "0s"
    nonfinite_severity: str = "page"
    nonfinite_action: str = "reduce_lr"
    """What non-finite steps ask the trainer for: reduce_lr, or rollback (weights a NaN already reached come
    back from the checkpoint)."""
    nonfinite_lr_restore_steps: int = 2000
    """With reduce_lr: the learning rate comes back this many steps after the reduction (the alert's
    `restore_after_steps`; 0 = the cut lasts the rest of the run), as a GradScaler grows its loss scale back
    after 2000 finite steps. Non-finite steps that go on fire the alert again a clear window after the action,
    and the new cut moves the return; a burst that is over costs the run a stretch of its rate, not the rest of
    it (the fault campaign's loop reached its target thousands of steps later with the cut for good:
    benchmarks/README.md). Keep it longer than the clear window's steps."""
    nonfinite_clear_window: str = "1m"
    """The alert holds only while the run had a non-finite step within this range, and not within this range
    after its action was applied: it resolves this long after the steps are finite again, and at once when the
    trainer has acted (non-finite steps a whole range after the action fire it again). Keep it >= 2 scrape
    intervals."""
    loss_scale_min: float = 1.0
    """A GradScaler's loss scale below this has collapsed: fp16 cannot represent the gradients even unscaled."""
    loss_scale_overflow_share: float = 0.05
    """Overflow-skipped steps as a share of all steps (0..1) above this: dynamic scaling skips about one step
    per growth interval (2000 by default) by design; this many mean the updates themselves are being lost."""
    loss_scale_window: str = "15m"
    """Range over which the share of overflow-skipped steps is measured."""
    loss_scale_for: str = "10m"
    loss_scale_severity: str = "ticket"
    checkpoint_failure_window: str = "1h"
    """A failed checkpoint keeps its alert firing until a checkpoint is written after it, at most this long (each
    failure is an event; no `for`)."""
    checkpoint_failing_for: str = "0s"
    checkpoint_failing_severity: str = "page"
    goodput_ratio: float = 0.9
    """The job's goodput (productive share of its wall time) over `goodput_window` below this is a ticket."""
    goodput_window: str = "1h"
    """The rolling window of the goodput alert (the whole-job ratio is recorded too)."""
    goodput_min_wall_seconds: float = 3600.0
    """A job younger than this is not judged: its start-up would dominate any window."""
    goodput_for: str = "15m"
    goodput_severity: str = "ticket"
    loss_plateau_improvement: float = 0.01
    """The smoothed training loss improving by less than this share (0..1) of its level per 1000 steps, over
    `loss_change_window`, has plateaued (a loss that climbs has not improved either)."""
    loss_plateau_for: str = "15m"
    loss_plateau_severity: str = "ticket"
    val_loss_plateau_window: str = "1h"
    """The best validation loss of this window is compared with the best of the window before it; keep it
    several validation intervals long (validation is sparse: a value every `val_every` steps)."""
    val_loss_plateau_improvement: float = 0.01
    """The window's best validation loss improving on the previous window's best by less than this share (0..1)
    is a plateau (a validation loss that got worse has not improved either)."""
    val_loss_plateau_for: str = "30m"
    val_loss_plateau_severity: str = "ticket"
    grad_norm_explosion: float = 1e5
    """Total gradient norm above this is an explosion."""
    grad_explosion_for: str = "5m"
    grad_explosion_severity: str = "ticket"
    grad_norm_vanishing: float = 1e-7
    """Total gradient norm below this, while the run steps, is vanishing."""
    grad_vanishing_for: str = "15m"
    grad_vanishing_severity: str = "ticket"

    imbalance_ratio: float = 1.5
    """Slowest rank's compute time over the median of the other ranks': a rank k times slower than the rest
    reads k, with 2 ranks as with many."""
    imbalance_for: str = "10m"
    imbalance_severity: str = "page"
    data_wait_p90_seconds: float = 0.1
    """p90 data-loader wait per rank above this is a bottleneck. It must be a bucket boundary of
    rankscope_data_wait_seconds: "p90 above it" is read as "more than 10 % of batches in the buckets above it",
    which needs one bucket per rank instead of all of them and is exact at a boundary."""
    data_wait_share: float = 0.4
    """Data wait as a share of step time (0..1) above this is a bottleneck."""
    data_loader_for: str = "10m"
    data_loader_severity: str = "ticket"
    comm_share: float = 0.5
    """Run-wide all-reduce time as a share of step time (0..1) above this is high overhead."""
    comm_for: str = "15m"
    comm_severity: str = "ticket"
    slow_step_seconds: float = 30.0
    """A rank's mean step time over `rate_window` above this is slow (the design's "mean batch time above a
    threshold"): set it from the job's budget; the default only catches steps gone pathologically slow."""
    slow_step_for: str = "10m"
    slow_step_severity: str = "ticket"
    slow_step_action: str = ""
    """What slow steps ask the trainer for: nothing ("", a person decides) or reduce_micro_batch."""

    hang_floor_seconds: float = hang_threshold.FLOOR_SECONDS
    """RankscopeRankHung: no step ended on any rank, and no checkpoint, validation or pause, for longer than
    max(this, hang_step_multiple x the run's recent step time) is a hang, from that last end. The defaults are
    the goodput ledger's too (rankscope.hang_threshold; metrics.hang_floor_seconds, metrics.hang_step_multiple)."""
    hang_step_multiple: float = hang_threshold.STEP_MULTIPLE
    hang_step_window: str = hang_threshold.duration(hang_threshold.WINDOW_SECONDS)
    """The run's recent step time: its mean step time over this window (local rank 0 of each node), the latest
    such mean..."""
    hang_step_lookback: str = hang_threshold.duration(hang_threshold.LOOKBACK_SECONDS)
    """...within this range (no step completes in a hang: the mean from before it holds its threshold)."""
    hang_checkpoint_limit_seconds: float = 600.0
    """A rank checkpointing (rankscope_phase) for less than this excuses the run from the hang alert."""
    hang_validation_limit_seconds: float = 600.0
    """A rank validating for less than this excuses the run from the hang alert."""
    hang_for: str = "0s"
    """No `for`: the threshold is already a time without a step (at least hang_floor_seconds)."""
    hang_severity: str = "page"
    hang_action: str = "restart"
    """What a hang asks the trainer for: restart (every rank writes its stacks and exits for torchrun to
    restart the group from its newest checkpoint) or nothing ("")."""

    stall_seconds: float = 600.0
    """No completed step for this long, while the ranks are scraped, is a stalled run (RankscopeRunStalled, the
    catch-all: kept for loops without phase tracking; inhibited while RankscopeRankHung fires). Before the first
    step: ranks inside it with no phase change for this long."""
    stall_for: str = "1m"
    stall_severity: str = "page"
    rank_down_for: str = "2m"
    rank_down_severity: str = "page"
    vanished_window: str = "10m"
    """RankscopeRankVanished fires for this long after a rank's next process found its previous one gone
    without a word."""
    vanished_for: str = "0s"
    """An event: the next process found out, nothing to wait for."""
    vanished_severity: str = "ticket"
    rank_down_lookback: str = "30m"
    """A down target counts as a rank of a live run if it served metrics within this range and its last
    `rankscope_run_finished` there was not 1."""
    live_window: str = "1m"
    """A run has ended when none of its ranks served metrics within this range, or every rank that did said it
    finished (rankscope_run_finished 1): an ended run raises no alert but RankscopeRankDown. Keep it >= 2 scrape
    intervals."""
    ended_lookback: str = "1h"
    """How far back a run's series make it a run that ended (rather than one never seen); keep it >= the longest
    window an alert reads (checkpoint_failure_window)."""
    paused_for: str = "30m"
    paused_severity: str = "info"

    runbook_url: str = "https://github.com/rankscope/rankscope/blob/main/docs/runbook.md#{alert}"
    """Every alert's runbook_url: ``{alert}`` stands for the lower-cased alert name (the runbook's anchor)."""
    evaluation_interval: str = ""
    """Rule-group evaluation interval; empty uses Prometheus's global evaluation_interval."""
    slow_interval: str = "30s"
    """Evaluation interval of the slow areas' groups (``rankscope.performance``: throughput, step-time quantiles,
    the straggler, data-loader, communication and slow-step alerts). Their rates span 2 minutes and their alerts
    wait 10 minutes or more, so evaluating them every 30 s instead of every 5 s changes their values little and
    delays their alerts by at most a twentieth of their `for`, while at 4096 ranks the group costs half of all the
    rules' time (benchmarks.scale). Applied only while every alert of those groups waits at least ten times as long
    (rules tuned to fire within seconds evaluate them like every other group), and never shorter than
    `evaluation_interval`. Empty: every group at the same interval."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_for", "_window", "_lookback")) and not _DURATION.match(value):
                raise ValueError(f"{f.name} must be a Prometheus duration such as 30s or 5m, got {value!r}")
        if "{alert}" not in self.runbook_url:
            raise ValueError(f"runbook_url must contain {{alert}} (the alert's anchor), got {self.runbook_url!r}")
        for name in ("evaluation_interval", "slow_interval"):
            if getattr(self, name) and not _DURATION.match(getattr(self, name)):
                raise ValueError(f"{name} must be empty or a duration such as 15s, got {getattr(self, name)!r}")
        for name in ("host_memory_ratio", "device_memory_ratio", "data_wait_share", "comm_share",
                     "loss_scale_overflow_share", "loss_plateau_improvement", "divergence_relapse_share",
                     "val_loss_plateau_improvement"):  # fmt: skip
            check_range(name, getattr(self, name), gt=0, lt=1)
        for name in ("divergence_factor", "divergence_leap_factor", "divergence_relapse_fall", "imbalance_ratio"):
            check_range(name, getattr(self, name), gt=1)
        for name in ("grad_norm_explosion", "grad_norm_vanishing", "data_wait_p90_seconds", "stall_seconds",
                     "loss_scale_min", "slow_step_seconds", "hang_floor_seconds", "hang_step_multiple",
                     "hang_checkpoint_limit_seconds", "hang_validation_limit_seconds"):  # fmt: skip
            check_range(name, getattr(self, name), gt=0)
        check_range("nonfinite_steps", self.nonfinite_steps, ge=0)
        check_range("nonfinite_lr_restore_steps", self.nonfinite_lr_restore_steps, ge=0, integer=True)
        check_range("divergence_min_increase", self.divergence_min_increase, ge=0)
        for f in fields(self):
            if f.name.endswith("_severity") and getattr(self, f.name) not in SEVERITIES:
                raise ValueError(f"{f.name} must be one of {', '.join(SEVERITIES)}, got {getattr(self, f.name)!r}")
        boundaries = contract.metric("data_wait_seconds").buckets
        if self.data_wait_p90_seconds not in boundaries:
            raise ValueError(
                f"data_wait_p90_seconds must be a bucket boundary of {metric_name('data_wait_seconds')} "
                f"({', '.join(num(b) for b in boundaries)}), got {num(self.data_wait_p90_seconds)}"
            )
        if self.device_memory_kind not in ("allocated", "reserved", "peak"):
            raise ValueError(f"device_memory_kind must be allocated, reserved or peak, got {self.device_memory_kind!r}")
        for name in ACTION_TUNABLES:
            choices = action_choices(name)
            if getattr(self, name) not in choices:
                allowed = ", ".join(c or '"" (no action)' for c in choices)
                raise ValueError(
                    f"{name} must be one of {allowed} (the actions rankscope.mixin.config lets "
                    f"{' and '.join(ACTION_TUNABLES[name].alerts)} ask for), got {getattr(self, name)!r}"
                )


def apply_overrides(t: Tunables, pairs: list[str]) -> Tunables:
    """Apply ``NAME=VALUE`` overrides; NAME may be a pattern (``*_for``). Errors name the bad pair."""
    kinds = {f.name: f.type for f in fields(t)}  # annotations are strings (postponed evaluation)
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--set expects NAME=VALUE, got {pair!r}")
        matched = [n for n in kinds if fnmatch.fnmatchcase(n, name)]
        if not matched:
            raise ValueError(f"--set {pair!r}: no tunable matches {name!r}; known: {', '.join(kinds)}")
        for n in matched:
            if kinds[n] in ("float", "int"):
                number, what = (float, "a number") if kinds[n] == "float" else (int, "a whole number")
                try:
                    changes[n] = number(raw)
                except ValueError:
                    raise ValueError(f"--set {pair!r}: {n} must be {what}, got {raw!r}") from None
            else:
                changes[n] = raw
    return replace(t, **changes)
