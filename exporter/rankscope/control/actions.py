"""What the control endpoint can be asked to do, and the checks on an operator's request.

An operator (or a script) posts `{"action": ..., "params": {...}, "reason": ...}`
to `/v1/actions`. Anything that is not exactly that is refused with a 4xx and
a one-line reason, before anything is queued.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rankscope.control.catalog import CATALOG, RESULTS, action_spec, parameter_owners

__all__ = [
    "ACTIONS",
    "RESULTS",
    "ActionRequest",
    "RequestError",
    "check_reason",
    "one_line",
    "parse_action_body",
    "parse_parameter",
]

#: Every action the channel knows, in the order the docs list them (declared in `catalog`).
ACTIONS: tuple[str, ...] = tuple(spec.name for spec in CATALOG)

MAX_REASON_CHARS = 200
#: Characters a reason may not hold: control characters and line breaks (the same pattern is in openapi.yaml).
_NOT_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP status and a one-line reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ActionRequest:
    """One action asked for, checked and ready to queue."""

    action: str
    """One of ACTIONS."""
    source: str
    """"alert" (Alertmanager), "operator" (/v1/actions) or "signal" (SIGTERM/SIGINT, a lost agent)."""
    reason: str
    """Recorded with the outcome and in checkpoints: "alert:<alertname>" or "operator:<reason>"."""
    params: dict[str, float] = field(default_factory=dict)
    """The parameters asked for, checked against the catalog (the rest take their configured defaults)."""
    key: str | None = None
    """Idempotency key: "<fingerprint>@<startsAt>" for alerts, None for operators."""
    started_at: float | None = None
    """Unix time the alert's incident began (its startsAt); None for operators, or an unreadable time."""


_BODY_FIELDS = ("action", "params", "reason")
_ALL_PARAMETERS = tuple(dict.fromkeys(p.name for spec in CATALOG for p in spec.parameters))


def parse_action_body(body: Any) -> ActionRequest:
    """Check a decoded `/v1/actions` body. Raises RequestError (400 shape, 422 meaning)."""
    if not isinstance(body, dict):
        raise RequestError(400, f"body must be a JSON object, got {_json_type(body)}")
    unknown = sorted(set(body) - set(_BODY_FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field {unknown[0]!r}; known: {', '.join(_BODY_FIELDS)}")
    if "action" not in body:
        raise RequestError(400, "field 'action' is required")
    action = body["action"]
    if not isinstance(action, str):
        raise RequestError(400, f"field 'action' must be a string, got {_json_type(action)}")
    params = body.get("params", {})
    if not isinstance(params, dict):
        raise RequestError(400, f"field 'params' must be an object, got {_json_type(params)}")
    unknown = sorted(set(params) - set(_ALL_PARAMETERS))
    if unknown:
        raise RequestError(400, f"unknown parameter params.{unknown[0]}; known: {', '.join(_ALL_PARAMETERS)}")
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestError(400, f"params.{name} must be a number, got {_json_type(value)}")
    reason = body.get("reason", "")
    if not isinstance(reason, str):
        raise RequestError(400, f"field 'reason' must be a string, got {_json_type(reason)}")
    check_reason(reason, "field 'reason'")
    if action not in ACTIONS:
        raise RequestError(422, f"unknown action {_short(action)}; known: {', '.join(ACTIONS)}")
    checked = {name: parse_parameter(action, name, value, f"params.{name}") for name, value in params.items()}
    return ActionRequest(action, "operator", f"operator:{reason or 'unspecified'}", checked)


def parse_parameter(action: str, name: str, value: Any, where: str) -> float:
    """A parameter of `action` (a number, or a numeric string from alert labels) within its declared bounds."""
    spec = action_spec(action)
    parameter = spec.parameter(name) if spec is not None else None
    if parameter is None:
        owners = parameter_owners(name)
        raise RequestError(422, f"{where} applies only to {' or '.join(owners) or 'no action'}, not to {action}")
    number = parameter.check(value)
    if number is None:
        try:
            float(value)
        except (TypeError, ValueError):
            raise RequestError(422, f"{where} must be a number, got {_short(value)}") from None
        kind = "an integer " if parameter.integer else ""
        raise RequestError(422, f"{where} must be {kind}{parameter.bounds_text()}, got {_short(value)}")
    return number


def check_reason(reason: str, where: str) -> None:
    """Reasons end up in logs and checkpoint files: short, one line, no control characters."""
    if len(reason) > MAX_REASON_CHARS:
        raise RequestError(400, f"{where} must be at most {MAX_REASON_CHARS} characters, got {len(reason)}")
    if _NOT_ONE_LINE.search(reason):
        raise RequestError(400, f"{where} must be one line of text without control characters")


def one_line(text: str, limit: int) -> str:
    """`text` made safe for a reason: control characters replaced, cut to `limit` characters."""
    return _NOT_ONE_LINE.sub("?", text)[:limit]


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    """A value quoted for a one-line error, cut so an attacker cannot flood the logs."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
