"""Alertmanager's webhook payload (version 4) turned into action requests.

    {"version": "4", "status": "firing", "truncatedAlerts": 0, "groupKey": ..., "receiver": ...,
     "alerts": [{"status": "firing", "labels": {"alertname": ..., "action": "reduce_lr", ...},
                 "annotations": {...}, "startsAt": "...", "endsAt": "...", "fingerprint": "..."}]}

The top-level `status` covers the whole group; each alert's own `status` says
whether *it* fires, so that is the one we act on. The alert's `action` label
names the action; its parameters (e.g. `lr_factor`, see `catalog`) may come
from its labels or annotations (the label wins). Alerts that are resolved or carry no `action` label are
acknowledged and ignored. Fields we do not use are allowed, so a newer
Alertmanager that adds fields is not refused (a 4xx would make it drop the
notification for good).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rankscope.control.actions import (
    _ALL_PARAMETERS,
    ACTIONS,
    MAX_REASON_CHARS,
    ActionRequest,
    RequestError,
    _json_type,
    _short,
    one_line,
    parse_parameter,
)

__all__ = ["AlertBatch", "parse_alert_payload"]

_STATUSES = ("firing", "resolved")
_MAX_KEY_CHARS = 200


@dataclass(frozen=True)
class AlertBatch:
    """What one notification asks for."""

    requests: tuple[ActionRequest, ...]
    """Firing alerts that name an action, in payload order."""
    ignored: tuple[str, ...]
    """The action (or "none") of each resolved or action-less alert: acknowledged, never queued."""
    truncated: int
    """Alerts Alertmanager left out of this payload (max_alerts)."""


def parse_alert_payload(body: Any, run_id: str | None = None) -> AlertBatch:
    """Check a decoded `/v1/alerts` body. Raises RequestError (400 shape, 422 meaning).

    With `run_id`, an alert labelled with another run's `run_id` is acknowledged and
    ignored: a notification about an earlier run (still firing, or re-sent) that reaches
    the control port of a new run must not act on it. Alerts without the label still act."""
    if not isinstance(body, dict):
        raise RequestError(400, f"body must be a JSON object, got {_json_type(body)}")
    version = body.get("version")
    if version != "4":
        raise RequestError(400, f"field 'version' must be \"4\" (Alertmanager webhook payload), got {_short(version)}")
    truncated = body.get("truncatedAlerts", 0)
    if isinstance(truncated, float) and truncated.is_integer():
        truncated = int(truncated)  # JSON has one number type: 3.0 is the integer 3
    if isinstance(truncated, bool) or not isinstance(truncated, int) or truncated < 0:
        raise RequestError(400, f"field 'truncatedAlerts' must be an integer >= 0, got {_short(truncated)}")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise RequestError(400, f"field 'alerts' must be an array, got {_json_type(alerts)}")
    requests: list[ActionRequest] = []
    ignored: list[str] = []
    for index, alert in enumerate(alerts):
        request = _parse_alert(alert, f"alerts[{index}]", run_id)
        if isinstance(request, ActionRequest):
            requests.append(request)
        else:
            ignored.append(request)
    return AlertBatch(tuple(requests), tuple(ignored), truncated)


def _parse_alert(alert: Any, where: str, run_id: str | None) -> ActionRequest | str:
    """The alert's request, or the action label ("none" if absent) of an alert to ignore."""
    if not isinstance(alert, dict):
        raise RequestError(400, f"{where} must be an object, got {_json_type(alert)}")
    status = alert.get("status")
    if status not in _STATUSES:
        raise RequestError(400, f'{where}.status must be "firing" or "resolved", got {_short(status)}')
    labels = _string_map(alert.get("labels"), f"{where}.labels")
    annotations = _string_map(alert.get("annotations", {}), f"{where}.annotations")
    fingerprint = _key_part(alert.get("fingerprint"), f"{where}.fingerprint")
    starts_at = _key_part(alert.get("startsAt"), f"{where}.startsAt")
    action = labels.get("action")
    other_run = run_id is not None and labels.get("run_id", run_id) != run_id
    if status != "firing" or action is None or other_run:
        # Bounded label value for the ignored counter: an unknown action name is not echoed.
        return action if action in ACTIONS else "none"
    name = labels.get("alertname", "unnamed")
    if action not in ACTIONS:
        known = ", ".join(ACTIONS)
        raise RequestError(422, f"{where} ({_short(name)}): unknown action {_short(action)}; known: {known}")
    # Alert names are not ours to refuse (a 4xx would lose the notification): cleaned, not checked.
    reason = "alert:" + one_line(name, MAX_REASON_CHARS - len("alert:"))
    params = {}
    for parameter in _ALL_PARAMETERS:
        raw = labels.get(parameter, annotations.get(parameter))
        if raw is not None:
            params[parameter] = parse_parameter(action, parameter, raw, f"{where} ({_short(name)}) {parameter}")
    return ActionRequest(action, "alert", reason, params, key=f"{fingerprint}@{starts_at}", started_at=_unix(starts_at))


def _unix(timestamp: str) -> float | None:
    """An RFC 3339 time as Unix seconds (Alertmanager writes nanoseconds; Python reads microseconds)."""
    text = timestamp.strip().replace("Z", "+00:00")
    text = re.sub(r"(\.\d{6})\d+", r"\1", text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise RequestError(400, f"{where} must be an object, got {_json_type(value)}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise RequestError(400, f"{where}.{_short(key)} must be a string, got {_json_type(item)}")
    return value


def _key_part(value: Any, where: str) -> str:
    # Fingerprint and startsAt make the idempotency key, so both are required.
    if not isinstance(value, str) or not value:
        raise RequestError(400, f"{where} must be a non-empty string, got {_short(value)}")
    if len(value) > _MAX_KEY_CHARS:
        raise RequestError(400, f"{where} must be at most {_MAX_KEY_CHARS} characters")
    return value
