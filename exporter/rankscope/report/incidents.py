"""Incidents: the alerts a run raised, the control actions taken, and how long from one to the other.

Alerts come from Prometheus's own `ALERTS` series (one sample per rule
evaluation while an alert is pending or firing), so an episode's times are
evaluation times: *onset* is its first pending sample (the first evaluation that
saw the fault), or its first firing one for a rule without `for`. Actions come
from `rankscope_control_actions_total{action, source, result}` (rank 0 counts
each settled action): an increase between two scrapes is an action settled in
between, and the later scrape is the time it is known applied by. The run log
sharpens that where it can: a checkpoint event has its exact time, step and
reason (`alert:<name>` names the alert), a learning-rate drop in the per-step
records gives the step a reduction took effect, the `finished` record the stop.
A trainer that logs its control outcomes (`action` records: the id, result,
reason and step `/v1/status` reports, at the time the action was settled) gives
every action, refused ones included, its exact time, step and operator's reason;
the log's pause/resume records then give the paused spans too.

An alert-sourced action is attributed to the latest episode of an alert whose
`action` label asks for it. Its fault-to-action time runs from the fault's first
sign, where one is known (the first non-finite step before the alert, from the
run log or else the loss series, for the non-finite alert), else from the
episode's onset, to the action being applied on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rankscope.mixin.config import HANG_ALERT, NONFINITE_ALERT
from rankscope.report.runlog import RunLog
from rankscope.report.series import Series

__all__ = [
    "NONFINITE_ALERT",
    "ActionEvent",
    "AlertEpisode",
    "Incidents",
    "action_events",
    "alert_episodes",
    "find_incidents",
    "nonfinite_steps",
]

#: A learning rate below this fraction of the previous step's is a reduction (the cosine schedule moves ~0.1 %).
LR_DROP = 0.9
#: A stop's logged outcome comes at most this long after its checkpoint (the loop's way out).
STOP_SETTLE_SECONDS = 300.0
#: Labels that say which alert an episode is, beyond its name (the rest is shown but not needed).
_NOT_IDENTITY = ("__name__", "alertstate")


@dataclass
class AlertEpisode:
    """One alert from its first pending (or firing) evaluation to its last."""

    alertname: str
    labels: dict[str, str]
    pending_at: float | None
    firing_at: float | None
    ended_at: float
    """Time of its last sample (pending or firing)."""
    active: bool
    """Still pending or firing at the end of the data."""

    @property
    def onset(self) -> float:
        """The first evaluation that saw the condition: the fault, as Prometheus first knew it."""
        return self.pending_at if self.pending_at is not None else self.firing_at  # type: ignore[return-value]

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")

    @property
    def action(self) -> str:
        return self.labels.get("action", "")

    @property
    def where(self) -> str:
        """The labels that place it (rank, node, ...), on one line."""
        keep = [k for k in ("rank", "node", "signal", "kind") if k in self.labels]
        return ", ".join(f"{k}={self.labels[k]}" for k in keep)

    @property
    def title(self) -> str:
        return f"{self.alertname} ({self.where})" if self.where else self.alertname


@dataclass
class ActionEvent:
    """A control action settled by the trainer."""

    action: str
    source: str
    """alert or operator (as the control endpoint labels it)."""
    result: str
    """applied, refused_cooldown, failed, ... (the `result` label)."""
    at: float
    """Known settled by this time (the scrape that counted it, or the run log's exact time)."""
    after: float | None = None
    """Settled after this time (the scrape before), when known."""
    step: int | None = None
    reason: str = ""
    count: int = 1
    cause: AlertEpisode | None = None
    evidence: list[str] = field(default_factory=list)
    """Where it was seen: "prometheus", "run log"."""
    detail: str = ""
    """What the control channel said of its outcome (why it was refused, when it took effect)."""
    first_sign: float | None = None
    """Time of the fault's first sign before its alert (the first non-finite step; the last step completed
    before a hang), when known."""
    first_sign_step: int | None = None
    exact: bool = False
    """`at` is the settle time the run log recorded (not a scrape's)."""

    @property
    def fault_at(self) -> float | None:
        """Where fault to action is measured from: the fault's first sign, else the alert's onset."""
        if self.first_sign is not None:
            return self.first_sign
        return None if self.cause is None else self.cause.onset

    @property
    def first_sign_what(self) -> str:
        """What the first sign is, in words."""
        hang = self.cause is not None and self.cause.alertname == HANG_ALERT
        return "the last step before the hang" if hang else "the first non-finite step"

    @property
    def fault_to_action(self) -> float | None:
        """Seconds from the fault (see `fault_at`) to this action being applied (None unless it was)."""
        fault = self.fault_at
        return None if fault is None or self.result != "applied" else self.at - fault


@dataclass
class Incidents:
    episodes: list[AlertEpisode]
    actions: list[ActionEvent]
    checkpoints: list[tuple[float, str]]
    """(time, reason) of every checkpoint the run log recorded."""
    paused: list[tuple[float, float]]
    """(from, to) while the run was paused."""
    nonfinite: list[tuple[float, int | None]] = field(default_factory=list)
    """(time, step) of every non-finite training step seen (the run log's, else the loss series' samples)."""


def _split(times: np.ndarray, gap: float) -> list[np.ndarray]:
    if len(times) == 0:
        return []
    cuts = np.nonzero(np.diff(times) > gap)[0] + 1
    return np.split(times, cuts)


def alert_episodes(alerts: Sequence[Series], interval: float, end: float) -> list[AlertEpisode]:
    """Episodes from raw ALERTS samples; a gap of more than 3 evaluations ends an episode."""
    groups: dict[tuple, dict[str, np.ndarray]] = {}
    labels_of: dict[tuple, dict[str, str]] = {}
    for series in alerts:
        key = tuple(sorted((k, v) for k, v in series.labels.items() if k not in _NOT_IDENTITY))
        state = series.labels.get("alertstate", "firing")
        found = groups.setdefault(key, {})
        found[state] = np.concatenate([found.get(state, np.array([])), series.t[series.v > 0]])
        labels_of[key] = {k: v for k, v in key}
    episodes = []
    for key, states in groups.items():
        pending, firing = np.sort(states.get("pending", np.array([]))), np.sort(states.get("firing", np.array([])))
        every = np.sort(np.concatenate([pending, firing]))
        spacing = float(np.median(np.diff(every))) if len(every) > 1 else interval
        gap = 3 * max(spacing, interval)
        for run in _split(every, gap):
            lo, hi = run[0], run[-1]
            fired = firing[(firing >= lo) & (firing <= hi)]
            pended = pending[(pending >= lo) & (pending <= hi)]
            labels = labels_of[key]
            episodes.append(
                AlertEpisode(
                    alertname=labels.get("alertname", "?"),
                    labels=labels,
                    pending_at=float(pended[0]) if len(pended) and (not len(fired) or pended[0] <= fired[0]) else None,
                    firing_at=float(fired[0]) if len(fired) else None,
                    ended_at=float(hi),
                    active=bool(end - hi <= gap),
                )
            )
    return sorted(episodes, key=lambda e: (e.onset, e.alertname))


def action_events(counters: Sequence[Series]) -> list[ActionEvent]:
    """Every increase of rankscope_control_actions_total, as events (a reset starts from zero)."""
    events = []
    for series in counters:
        labels = series.labels
        previous_value, previous_time = 0.0, None
        for t, value in zip(series.t, series.v, strict=True):
            if not math.isfinite(value):
                continue
            increase = value - previous_value if value >= previous_value else value  # a reset: counted anew
            if increase >= 1:
                events.append(
                    ActionEvent(
                        action=labels.get("action", "?"),
                        source=labels.get("source", "?"),
                        result=labels.get("result", "?"),
                        at=float(t),
                        after=previous_time,
                        count=int(round(increase)),
                        evidence=["prometheus"],
                    )
                )
            previous_value, previous_time = value, float(t)
    return sorted(events, key=lambda e: e.at)


def _control_actions(log: RunLog) -> list[ActionEvent]:
    """The control outcomes the trainer logged (`action` records with a `result`), at their settle times."""
    found = []
    for record in log.of("action"):
        if not isinstance(record.get("result"), str) or not isinstance(record.get("time"), int | float):
            continue  # an older trainer's record: the action's name only, stamped when written
        reason = str(record.get("reason") or "")
        detail = str(record.get("detail") or "")
        step = record.get("step")
        found.append(ActionEvent(str(record.get("action", "?")), str(record.get("source") or "?"), record["result"],
                                 float(record["time"]), step=step if isinstance(step, int) else None,
                                 reason=reason, detail=detail, evidence=["run log"], exact=True))  # fmt: skip
    return found


def _log_actions(log: RunLog) -> list[ActionEvent]:
    """Actions the run log shows: alert checkpoints, stops, learning-rate reductions, rollbacks, micro-batch cuts."""
    found = []
    for record in log.of("checkpoint"):
        reason = str(record.get("reason", ""))
        kind = reason.split(":", 1)[0]
        if kind in ("interval", "final") or not isinstance(record.get("time"), int | float):
            continue
        action = "stop" if kind == "stop" else "checkpoint"
        source = "alert" if kind == "alert" else "operator"
        found.append(ActionEvent(action, source, "applied", float(record["time"]), step=record.get("step"),
                                 reason=reason, evidence=["run log"]))  # fmt: skip
    for kind, action in (("rollback", "rollback"), ("micro_batch", "reduce_micro_batch")):
        for record in log.of(kind):
            reason = str(record.get("action_reason" if kind == "rollback" else "reason", ""))
            if not reason or not isinstance(record.get("time"), int | float):
                continue  # a resume's record, or a record without its time
            if kind == "rollback":
                step, what = record.get("rolled_back_from"), f"back to step {record.get('step')}"
            else:
                step = record.get("step")
                what = f"micro-batch {record.get('micro_batch')} x {record.get('accumulation')}"
            source = "alert" if reason.startswith("alert:") else "operator"
            found.append(ActionEvent(action, source, "applied", float(record["time"]), step=step,
                                     reason=f"{what} ({reason})", evidence=["run log"]))  # fmt: skip
    train = log.train()
    # A record's own time is when its batch of steps was flushed: a true "applied by" for the step.
    steps, lrs, flushed = train["step"], train["lr"], train["flushed"]
    for i in range(1, len(steps)):
        consecutive = steps[i] == steps[i - 1] + 1
        if consecutive and lrs[i - 1] > 0 and lrs[i] < LR_DROP * lrs[i - 1] and math.isfinite(flushed[i]):
            # The rate a step uses is logged with it: a reduction at the boundary after step s shows at s + 1.
            reason = f"learning rate x{lrs[i] / lrs[i - 1]:.2g}"
            found.append(ActionEvent("reduce_lr", "?", "applied", float(flushed[i]), step=int(steps[i - 1]),
                                     reason=reason, evidence=["run log"]))  # fmt: skip
    return found


def _merge(prometheus: list[ActionEvent], logged: list[ActionEvent], slack: float) -> list[ActionEvent]:
    """Prometheus's events, sharpened by the log's matching ones; the log's others added."""
    unmatched = list(logged)
    for event in prometheus:
        lo = (event.after if event.after is not None else event.at - slack) - slack
        match = next((e for e in unmatched if e.action == event.action and e.result == event.result
                      and lo <= e.at <= event.at + slack), None)  # fmt: skip
        if match is None:
            continue
        unmatched.remove(match)
        event.step = match.step
        event.reason = match.reason if match.reason else event.reason
        event.detail = match.detail or event.detail
        event.source = match.source if match.source != "?" else event.source
        # A logged settle time is exact; otherwise both are "known applied by" times: the counter's scrape
        # comes after the channel settled the action, the log's record right after the step that applied it.
        event.at = match.at if match.exact else min(event.at, match.at)
        event.exact = match.exact
        event.evidence.append("run log")
    return sorted([*prometheus, *unmatched], key=lambda e: e.at)


def _logged_actions(log: RunLog, slack: float) -> list[ActionEvent]:
    """The logged control outcomes, plus what the log's other records show that they do not cover."""
    control = _control_actions(log)

    def covered(e: ActionEvent) -> bool:
        # A stop is settled once the loop has left: after its checkpoint, the final validation and the
        # last flush, seconds later. Any other action's record is written at the step that applied it.
        after = STOP_SETTLE_SECONDS if e.action == "stop" else slack
        return any(c.action == e.action and c.result == "applied" and -slack <= c.at - e.at <= after for c in control)

    derived = [e for e in _log_actions(log) if not covered(e)]
    return sorted([*control, *derived], key=lambda e: e.at)


def _attribute(actions: list[ActionEvent], episodes: list[AlertEpisode], slack: float) -> None:
    for event in actions:
        if event.source not in ("alert", "?"):
            continue
        named = event.reason.removeprefix("alert:") if event.reason.startswith("alert:") else None
        candidates = [
            e for e in episodes
            if e.action == event.action and e.firing_at is not None and e.firing_at <= event.at + slack
            and (named is None or e.alertname == named)
        ]  # fmt: skip
        if candidates:
            event.cause = max(candidates, key=lambda e: e.firing_at or 0.0)
            if event.source == "?":
                event.source = "alert"


def _step_at(global_step: Series | None, t: float) -> int | None:
    if global_step is None or not len(global_step):
        return None
    before = global_step.t <= t
    return int(global_step.v[before][-1]) if before.any() else None


def _logged_pauses(actions: list[ActionEvent], end: float) -> list[tuple[float, float]]:
    """(pause, resume) from the logged outcomes: each applied pause to the next applied resume or stop."""
    spans, since = [], None
    for event in actions:
        if not event.exact or event.result != "applied":
            continue
        if event.action == "pause" and since is None:
            since = event.at
        elif event.action in ("resume", "stop") and since is not None:
            spans.append((since, event.at))
            since = None
    return spans + ([(since, end)] if since is not None else [])


def nonfinite_steps(log: RunLog | None, loss: Series | None) -> list[tuple[float, int | None]]:
    """(time, step) of the non-finite training steps: the run log's (each step's time spread between its
    flushes), else the loss series' non-finite samples (known by that scrape)."""
    if log is not None:
        train = log.train()
        if len(train["step"]):
            bad = ~np.isfinite(train["loss"]) & np.isfinite(train["time"]) & np.isfinite(train["step"])
            return [(float(t), int(s)) for t, s in zip(train["time"][bad], train["step"][bad], strict=True)]
    if loss is None:
        return []
    return [(float(t), None) for t in loss.t[~np.isfinite(loss.v)]]


def completed_steps(log: RunLog | None, global_step: Series | None) -> list[tuple[float, int | None]]:
    """(time, step) of the training steps completed: the run log's, else each scrape where the step moved on."""
    if log is not None:
        train = log.train()
        if len(train["step"]):
            known = np.isfinite(train["time"]) & np.isfinite(train["step"])
            return [(float(t), int(s)) for t, s in zip(train["time"][known], train["step"][known], strict=True)]
    if global_step is None or len(global_step) < 2:
        return []
    moved = np.flatnonzero(np.diff(global_step.v) > 0) + 1
    return [(float(global_step.t[i]), int(global_step.v[i])) for i in moved]


def _first_signs(
    actions: list[ActionEvent], nonfinite: list[tuple[float, int | None]], steps: list[tuple[float, int | None]]
) -> None:
    """For an action the non-finite alert caused: the first non-finite step since the previous such action; for
    one the hang alert caused: the last step completed before the alert (the hang began when it ended)."""
    previous = {NONFINITE_ALERT: -math.inf, HANG_ALERT: -math.inf}
    for event in sorted(actions, key=lambda e: e.at):
        cause = event.cause
        if cause is None or cause.alertname not in previous or event.result != "applied":
            continue
        since = previous[cause.alertname]
        if cause.alertname == NONFINITE_ALERT:
            signs = [(t, s) for t, s in nonfinite if since < t <= cause.onset][:1]
        else:
            signs = [(t, s) for t, s in steps if since < t <= cause.onset][-1:]
        if signs:
            event.first_sign, event.first_sign_step = signs[0]
        previous[cause.alertname] = event.at


def _paused(paused: Series | None) -> list[tuple[float, float]]:
    if paused is None or not len(paused):
        return []
    on = paused.t[paused.v >= 1]
    spacing = float(np.median(np.diff(paused.t))) if len(paused) > 1 else 1.0
    return [(float(r[0]), float(r[-1])) for r in _split(on, 1.5 * spacing)]


def find_incidents(
    alerts: Sequence[Series],
    counters: Sequence[Series],
    *,
    interval: float,
    end: float,
    log: RunLog | None = None,
    global_step: Series | None = None,
    paused: Series | None = None,
    loss: Series | None = None,
) -> Incidents:
    """Alert episodes and control actions of a run, matched up (see the module docstring); `loss` is the
    training loss series (its non-finite samples are the fault's first sign when there is no run log)."""
    episodes = alert_episodes(alerts, interval, end)
    slack = 2 * interval + 1.0
    actions = _merge(action_events(counters), _logged_actions(log, slack) if log else [], slack)
    for event in actions:
        if event.step is None:
            event.step = _step_at(global_step, event.at)
    _attribute(actions, episodes, slack)
    nonfinite = nonfinite_steps(log, loss)
    _first_signs(actions, nonfinite, completed_steps(log, global_step))
    checkpoints = [
        (float(r["time"]), str(r.get("reason", "")))
        for r in (log.of("checkpoint") if log else [])
        if isinstance(r.get("time"), int | float)
    ]
    # The log's settle times are exact; the gauge is sampled once a scrape (and lags by its page cache).
    pauses = _logged_pauses(actions, end) or _paused(paused)
    return Incidents(episodes, actions, checkpoints, pauses, nonfinite)
