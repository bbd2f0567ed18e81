"""The loop-off arm's on-call person: answers each page after a delay with the action the runbook says.

The runbook's action for an alert is the one the shipped rule pack would have put in its `action` label
(rankscope.mixin.config: the default of the `*_action` tunable that names the alert); an alert whose tunable
defaults to "" (or that has none) is one the runbook says to watch, and gets nothing. A page that Alertmanager
has already resolved by the time the operator gets to it gets nothing either: a person who saw the
"resolved" notice does not act on it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.mixin import rules
from rankscope.mixin.config import ACTION_TUNABLES, Tunables

from benchmarks.latency import Control
from devstack.monitoring import unix_time
from devstack.webhook import WebhookSink

from .runlog import read_records

__all__ = ["Operator", "OperatorAction", "runbook_actions", "runbook_parameters"]


def runbook_actions() -> dict[str, str]:
    """alertname -> the action the runbook says (the shipped default of its `*_action` tunable)."""
    defaults = Tunables()
    found = {}
    for tunable, choice in ACTION_TUNABLES.items():
        action = getattr(defaults, tunable)
        for alert in choice.alerts:
            if action:
                found[alert] = action
    return found


def runbook_parameters() -> dict[str, dict[str, str]]:
    """alertname -> the action's parameters the runbook gives: the shipped rule's (how long before the alert
    fired its incident began, how many steps a rate cut lasts); the loop-off arm's rules, with no action,
    carry none."""
    return {alert.name: dict(alert.parameters) for alert in rules.alerts(Tunables()) if alert.parameters}


@dataclass
class OperatorAction:
    """One page the operator answered (or chose not to)."""

    alertname: str
    rank: str
    paged_at: float
    answered_at: float
    action: str
    """The action posted ("" if the runbook says to watch, or the page had resolved)."""
    why: str


class Operator:
    """Reads the pager's deliveries on a thread of its own; acts on rank 0's control endpoint."""

    def __init__(self, pager: WebhookSink, control: Control, delay: float, run_id: str, run_log: Path) -> None:
        self.pager, self.control, self.delay, self.run_id, self.run_log = pager, control, delay, run_id, run_log
        self.runbook = runbook_actions()
        self.parameters = runbook_parameters()
        self.answered: list[OperatorAction] = []
        self._answered_changed = threading.Condition()
        self._seen = 0
        self._due: dict[str, tuple[float, dict]] = {}  # fingerprint@startsAt -> (paged at, alert)
        self._resolved: set[str] = set()
        self._answered: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="campaign-operator", daemon=True)

    def start(self) -> Operator:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            fresh = self.pager.wait_for_new(self._seen, timeout=0.5)
            self._seen += len(fresh)
            for delivery in fresh:
                for alert in delivery.body.get("alerts", []):
                    labels = alert.get("labels", {})
                    if labels.get("run_id") != self.run_id:
                        continue
                    key = f"{alert.get('fingerprint')}@{alert.get('startsAt')}"
                    if alert.get("status") == "resolved":
                        self._resolved.add(key)
                    elif key not in self._due and key not in self._answered:
                        self._due[key] = (delivery.received_at, alert)
            now = time.time()
            for key, (paged_at, alert) in list(self._due.items()):
                if now >= paged_at + self.delay:
                    del self._due[key]
                    self._answered.add(key)
                    self._answer(key, paged_at, alert)

    def _answer(self, key: str, paged_at: float, alert: dict) -> None:
        labels = alert.get("labels", {})
        name = labels.get("alertname", "?")
        action = self.runbook.get(name, "")
        if key in self._resolved:
            action, why = "", "resolved before the operator got to it"
        elif not action:
            why = "the runbook says to watch"
        else:
            why = "answered"
            try:  # the endpoint records it as operator:<reason>
                self.control.act(action, name, self._params(action, alert))
            except OSError as exc:  # the job may be between incarnations: nothing was posted
                action, why = "", f"{action} not posted: the endpoint did not answer ({exc})"
        with self._answered_changed:
            self.answered.append(OperatorAction(name, labels.get("rank", ""), paged_at, time.time(), action, why))
            self._answered_changed.notify_all()

    def _params(self, action: str, alert: dict) -> dict[str, Any] | None:
        """The runbook's parameters of the action (a rate cut for the steps it says). A rollback goes to before
        the incident, as the runbook says: the operator reads on the loss panel where it began, here the step
        the run log shows at the alert's startsAt less its incident_lookback_seconds (what the loop's own
        rollback goes back to), the runbook's where the alert carries none. Posted without it, the endpoint
        would take the incident to be now, and restore the divergence it was asked to undo."""
        name = alert.get("labels", {}).get("alertname", "")
        given = self.parameters.get(name, {})
        if action != "rollback":
            return {key: _number(value) for key, value in given.items()} if action == "reduce_lr" and given else None
        lookback = alert.get("annotations", {}).get(
            "incident_lookback_seconds", given.get("incident_lookback_seconds", 0)
        )
        began = unix_time(alert["startsAt"]) - float(lookback)
        steps = [r["step"] for r in read_records(self.run_log) if r.get("type") == "train" and r["time"] <= began]
        return {"before_step": steps[-1]} if steps else None

    def wait_answered(self, count: int, timeout: float) -> list[OperatorAction]:
        """The pages answered so far, once there are `count` of them or `timeout` seconds have passed."""
        with self._answered_changed:
            self._answered_changed.wait_for(lambda: len(self.answered) >= count, timeout)
            return list(self.answered)


def _number(text: str) -> float | int:
    """A rule's parameter (an annotation, so text) as the number the endpoint takes."""
    value = float(text)
    return int(value) if value.is_integer() else value
