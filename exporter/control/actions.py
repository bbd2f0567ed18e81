"""What the control endpoint can be asked to do, and the checks on an operator's request.

An operator (or a script) posts `{"action": ..., "params": {...}, "reason": ...}`
to `/v1/actions`. Anything that is not exactly that is refused with a 4xx and
a one-line reason, before anything is queued.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACTIONS",
    "RESULTS",
    "ActionRequest",
    "RequestError",
    "check_reason",
    "one_line",
    "parse_action_body",
    "parse_lr_factor",
]

#: Every action the channel knows, in the order the docs list them.
ACTIONS: tuple[str, ...] = ("checkpoint", "reduce_lr", "pause", "resume", "stop")

#: Outcomes, the `result` label of rankscope_control_actions_total and `status` of a settled action.
RESULTS: tuple[str, ...] = (
    "applied",  # every rank applied it at the same step
    "noop",  # nothing to do (resume while running, pause while paused)
    "refused_cooldown",  # the same action was applied too recently
    "refused_cap",  # the action's cap (e.g. lr_max_reductions) is reached
    "refused_floor",  # reduce_lr with every learning rate already at the floor
    "overridden",  # carried out, but its effect did not happen (e.g. the loop overwrote a reduced learning rate)
    "failed",  # some rank raised while applying it (see its log), or the loop reported it not done
    "duplicate",  # an alert (fingerprint, startsAt) already received
    "ignored",  # a resolved alert, or one without an `action` label
)

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
    """"alert" (Alertmanager) or "operator" (/v1/actions)."""
    reason: str
    """Recorded with the outcome and in checkpoints: "alert:<alertname>" or "operator:<reason>"."""
    lr_factor: float | None = None
    """reduce_lr only: the factor asked for (None: the configured default)."""
    key: str | None = None
    """Idempotency key: "<fingerprint>@<startsAt>" for alerts, None for operators."""

    def params(self) -> dict[str, float]:
        return {} if self.lr_factor is None else {"lr_factor": self.lr_factor}


_BODY_FIELDS = ("action", "params", "reason")
_PARAMS = ("lr_factor",)


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
    unknown = sorted(set(params) - set(_PARAMS))
    if unknown:
        raise RequestError(400, f"unknown parameter params.{unknown[0]}; known: {', '.join(_PARAMS)}")
    reason = body.get("reason", "")
    if not isinstance(reason, str):
        raise RequestError(400, f"field 'reason' must be a string, got {_json_type(reason)}")
    check_reason(reason, "field 'reason'")
    if action not in ACTIONS:
        raise RequestError(422, f"unknown action {_short(action)}; known: {', '.join(ACTIONS)}")
    lr_factor = None
    if "lr_factor" in params:
        if action != "reduce_lr":
            raise RequestError(422, f"params.lr_factor applies only to reduce_lr, not to {action}")
        value = params["lr_factor"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestError(400, f"params.lr_factor must be a number, got {_json_type(value)}")
        lr_factor = parse_lr_factor(value, "params.lr_factor")
    return ActionRequest(action, "operator", f"operator:{reason or 'unspecified'}", lr_factor)


def parse_lr_factor(value: Any, where: str) -> float:
    """A reduce_lr factor: a number (or numeric string, from alert labels) strictly between 0 and 1."""
    try:
        factor = float(value)
    except (TypeError, ValueError):
        raise RequestError(422, f"{where} must be a number, got {_short(value)}") from None
    if not (math.isfinite(factor) and 0.0 < factor < 1.0):
        raise RequestError(422, f"{where} must be between 0 and 1 (exclusive), got {_short(value)}")
    return factor


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
