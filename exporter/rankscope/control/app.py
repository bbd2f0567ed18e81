"""The control endpoint as a WSGI application, built from its dependencies.

    app = create_app(AppDeps(queue, snapshot, token="s3cret", run_id="demo"))

Tests call `app(environ, start_response)` directly, without a socket;
`rankscope.control.endpoint` serves the same app on a daemon thread.

Checks run in this order, and the first that fails answers: route (404),
method (405), bearer token (401 missing, 403 wrong), Content-Length (411
missing, 413 too large), Content-Type (415), UTF-8 and JSON (400), schema
(400), meaning (422: unknown action, bad parameter), run state (409 stopping,
503 queue full). Nothing changes before every check has passed. Alertmanager
treats a 4xx as final and retries a 5xx, so only a transient condition (a full
queue, an internal error) answers 5xx.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rankscope.control.actions import ActionRequest, RequestError, _short, parse_action_body
from rankscope.control.alerts import parse_alert_payload
from rankscope.control.catalog import action_spec
from rankscope.control.state import ActionQueue, ActionRecord, RunSnapshot, Submitted

__all__ = ["AppDeps", "ROUTES", "create_app"]

logger = logging.getLogger("rankscope")

#: path -> allowed methods. The OpenAPI document lists exactly these (checked by the tests).
ROUTES: dict[str, tuple[str, ...]] = {
    "/healthz": ("GET",),
    "/v1/status": ("GET",),
    "/v1/actions": ("POST",),
    "/v1/alerts": ("POST",),
    "/v1/stacks": ("GET",),
}
#: Liveness says nothing about the run, so probes need no token.
_PUBLIC = frozenset({"/healthz"})
#: A refused body is read and dropped up to this size, so the client sees our answer rather than a
#: connection reset; a larger one is not worth the bandwidth.
_DRAIN_LIMIT = 16 * 1024 * 1024

_REASONS = {
    200: "OK",
    202: "Accepted",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass
class AppDeps:
    """Everything the endpoint reads or changes."""

    queue: ActionQueue
    snapshot: RunSnapshot
    token: str | None
    """The bearer token; None only when the channel was started with insecure: true."""
    run_id: str = "local"
    world_size: int = 1
    max_body_bytes: int = 1_048_576
    count: Callable[[str, str, str], None] = lambda action, source, result: None
    """Counts an outcome (rankscope_control_actions_total{action, source, result})."""
    stacks: Callable[[bool], dict[str, Any]] | None = None
    """GET /v1/stacks: every rank's stacks, folded (False), or this rank's only (True, `?local=1`)."""
    immediate: Callable[[ActionRequest], tuple[ActionRecord, bool]] | None = None
    """Carries out an `immediate` action (restart) now: (its record, whether it is a duplicate)."""


class _Answer(Exception):
    """A response decided before the end of the handler (a refusal, usually)."""

    def __init__(self, status: int, body: dict[str, Any], headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or []


def create_app(deps: AppDeps) -> WSGIApp:
    """The WSGI application of the control endpoint."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = _Body(environ)
        try:
            answer = _handle(deps, environ, body)
        except _Answer as refused:
            answer = refused
        except Exception:  # never let an internal error look like a final 4xx to Alertmanager
            logger.exception(
                "rankscope: control endpoint failed on %s %s", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO")
            )
            answer = _Answer(500, {"error": "internal error; see the trainer's log"})
        finally:
            body.drain()
        payload = (json.dumps(answer.body, allow_nan=False) + "\n").encode("utf-8")
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload))), *answer.headers]
        start_response(f"{answer.status} {_REASONS[answer.status]}", headers)
        return [payload]

    return app


def _handle(deps: AppDeps, environ: dict[str, Any], body: _Body) -> _Answer:
    path = environ.get("PATH_INFO", "") or "/"
    methods = ROUTES.get(path)
    if methods is None:
        raise _Answer(404, {"error": f"no such route {_short(path)}; routes: {', '.join(ROUTES)}"})
    method = environ.get("REQUEST_METHOD", "")
    if method not in methods:
        raise _Answer(
            405,
            {"error": f"{_short(method)} not allowed on {path}; use {', '.join(methods)}"},
            [("Allow", ", ".join(methods))],
        )
    if path not in _PUBLIC:
        _authorize(deps.token, environ.get("HTTP_AUTHORIZATION"))
    if path == "/healthz":
        return _Answer(200, {"status": "ok"})
    if path == "/v1/status":
        return _Answer(200, _status(deps))
    if path == "/v1/stacks":
        if deps.stacks is None:
            raise _Answer(404, {"error": "this endpoint serves no stacks"})
        return _Answer(200, deps.stacks("local=1" in environ.get("QUERY_STRING", "").split("&")))
    document = body.read_json(deps.max_body_bytes)
    try:
        if path == "/v1/actions":
            return _post_action(deps, document)
        return _post_alerts(deps, document)
    except RequestError as exc:
        headers = [("Retry-After", "1")] if exc.status == 503 else []
        raise _Answer(exc.status, {"error": exc.message}, headers) from None


def _authorize(token: str | None, header: str | None) -> None:
    if token is None:
        return  # started with insecure: true
    challenge = [("WWW-Authenticate", 'Bearer realm="rankscope"')]
    if not header:
        raise _Answer(401, {"error": "missing 'Authorization: Bearer <token>' header"}, challenge)
    scheme, _, credentials = header.partition(" ")
    credentials = credentials.strip()
    if scheme.lower() != "bearer" or not credentials:
        raise _Answer(401, {"error": "the Authorization header must be 'Bearer <token>'"}, challenge)
    # WSGI hands headers over as latin-1 strings; compare bytes in constant time.
    if not hmac.compare_digest(credentials.encode("latin-1", "replace"), token.encode("ascii")):
        raise _Answer(403, {"error": "wrong bearer token"})


def _post_action(deps: AppDeps, document: Any) -> _Answer:
    request = parse_action_body(document)
    if _is_immediate(request):
        record, _ = _immediate(deps, request)
        body = {"id": record.id, "action": request.action, "status": record.status}
        return _Answer(202, {**body, "detail": record.detail} if record.detail else body)
    submitted = deps.queue.submit([request])[0]
    logger.info("rankscope: control accepted %s (%s) as %s", request.action, request.reason, submitted.id)
    return _Answer(202, {"id": submitted.id, "action": request.action, "status": "pending"})


def _post_alerts(deps: AppDeps, document: Any) -> _Answer:
    batch = parse_alert_payload(document, deps.run_id)
    at_boundary = [request for request in batch.requests if not _is_immediate(request)]
    queued = iter(deps.queue.submit(at_boundary))  # never an immediate one: it would wait for a boundary
    submitted = []
    for request in batch.requests:
        if _is_immediate(request):
            record, duplicate = _immediate(deps, request)
            submitted.append(Submitted(record.id, duplicate))
        else:
            submitted.append(next(queued))
    # Counted only now: a refused notification changes nothing, metrics included.
    if batch.truncated:
        logger.warning(
            "rankscope: Alertmanager left %d alert(s) out of a notification (max_alerts); they were not seen",
            batch.truncated,
        )
    accepted, duplicates = [], []
    for request, answer in zip(batch.requests, submitted, strict=True):
        entry = {"id": answer.id, "action": request.action}
        if answer.duplicate:
            duplicates.append(entry)
            deps.count(request.action, "alert", "duplicate")
        else:
            accepted.append(entry)
            logger.info("rankscope: control accepted %s (%s) as %s", request.action, request.reason, answer.id)
    for action in batch.ignored:
        deps.count(action, "alert", "ignored")
    body = {"accepted": accepted, "duplicates": duplicates, "ignored": len(batch.ignored), "truncated": batch.truncated}
    return _Answer(202 if accepted else 200, body)


def _is_immediate(request: ActionRequest) -> bool:
    spec = action_spec(request.action)
    return spec is not None and spec.immediate


def _immediate(deps: AppDeps, request: ActionRequest) -> tuple[ActionRecord, bool]:
    if deps.immediate is None:
        raise RequestError(422, f"{request.action} needs the control channel's endpoint; this one cannot do it")
    return deps.immediate(request)


def _status(deps: AppDeps) -> dict[str, Any]:
    progress = deps.snapshot.read()
    actions = deps.queue.snapshot()
    return {
        "run_id": deps.run_id,
        "world_size": deps.world_size,
        "step": progress["step"],
        "learning_rates": [lr if lr == lr else None for lr in progress["learning_rates"]],  # NaN: unreadable
        "paused": progress["paused"],
        "paused_since": progress["paused_since"],
        "stopping": progress["stop_requested"] or deps.queue.stopping,
        "pending": actions["pending"],
        "recent": actions["recent"],
    }


class _Body:
    """The request body: read once, at most the declared length, and drained if left unread."""

    def __init__(self, environ: dict[str, Any]) -> None:
        self._input = environ.get("wsgi.input") or io.BytesIO()  # PEP 3333 requires it; a bare call may omit it
        self._declared = _content_length(environ.get("CONTENT_LENGTH"))
        self._content_type = environ.get("CONTENT_TYPE", "")
        self._consumed = False

    def read_json(self, limit: int) -> Any:
        if self._declared is None:
            raise _Answer(411, {"error": "a Content-Length header is required"})
        if self._declared < 0:
            raise _Answer(400, {"error": "Content-Length must be a non-negative integer"})
        if self._declared > limit:
            raise _Answer(413, {"error": f"body of {self._declared} bytes exceeds the limit of {limit} bytes"})
        media_type = self._content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise _Answer(415, {"error": f"Content-Type must be application/json, got {_short(media_type)}"})
        raw = self._input.read(self._declared) if self._declared else b""
        self._consumed = True
        if len(raw) != self._declared:
            raise _Answer(400, {"error": "body ended before Content-Length bytes"})
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except UnicodeDecodeError:
            raise _Answer(400, {"error": "body is not UTF-8"}) from None
        except json.JSONDecodeError as exc:
            raise _Answer(400, {"error": f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"}) from None
        except RecursionError:
            raise _Answer(400, {"error": "invalid JSON: nested too deeply"}) from None
        except ValueError as exc:
            raise _Answer(400, {"error": f"invalid JSON: {exc}"}) from None

    def drain(self) -> None:
        if self._consumed or not self._declared or self._declared < 0 or self._declared > _DRAIN_LIMIT:
            return
        self._consumed = True
        remaining = self._declared
        try:
            while remaining > 0:
                chunk = self._input.read(min(remaining, 65536))
                if not chunk:
                    return
                remaining -= len(chunk)
        except OSError:
            return


def _content_length(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        text = raw.strip()
        return int(text) if text.isascii() and text.isdigit() else -1
    except ValueError:
        return -1


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")
